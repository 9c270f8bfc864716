"""OpenAI's chat and completions APIs: POST /v1/chat/completions and /v1/completions
(docs/serving.md, "OpenAI chat and completions"). The requests: requests.py; the
replies: reply.py; the `monolith` extension (speculation in the stream): speculation.py;
the endpoints: routes.py."""
