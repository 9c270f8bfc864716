"""OpenAI's Responses API: POST /v1/responses (and a WebSocket at the same path), its
input_tokens and compact endpoints, and the stored responses (docs/serving.md, "OpenAI
Responses"). The requests: requests.py (input items: items.py; tools: tools.py;
encrypted reasoning and summaries: seal.py); the replies: reply.py (compaction:
compact.py); the stored responses: store.py; the endpoints: routes.py; the WebSocket
transport: websocket.py."""
