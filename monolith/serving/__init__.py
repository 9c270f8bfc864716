"""The HTTP server: the starlette app (app.py) serving OpenAI's chat and completions,
Anthropic's Messages and OpenAI's Responses APIs (docs/serving.md, which also says what
adding an API takes). Each API is a package (openai/, anthropic/, responses/) with its
requests, its reply format and its routes; they share the common core here: the request
every API becomes (requests.py), the field checks (fields.py), tools (tools/: their
checks, the calls read back and streamed, XML tool arguments), structured output
(structured.py), the handlers every API's routes call (handlers.py) and the engine
driving (driving.py). No API package imports another. Only the app and its endpoints (app.py,
handlers.py, driving.py, page.py, each API's routes.py, responses/websocket.py) import starlette."""
