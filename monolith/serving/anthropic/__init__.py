"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens
(docs/serving.md, "Anthropic Messages"). The requests: requests.py (`thinking` and
`output_config`: options.py; `context_management`: context_edits.py); the replies and
Anthropic's error body: reply.py; the endpoints: routes.py."""
