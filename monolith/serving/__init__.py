"""The HTTP server: the starlette app (app.py) serving OpenAI's chat and completions,
Anthropic's Messages and OpenAI's Responses APIs (docs/serving.md, which also says what
adding an API takes). Each API has its requests, its reply format and its routes; they
share the field checks (fields.py), tools (tool_specs.py; calls read back: tools.py),
structured output (structured.py) and the engine driving (driving.py). Only the app and
its endpoints (app.py, driving.py, the *_routes.py, responses/websocket.py) import
starlette."""
