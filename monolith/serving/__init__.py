"""The OpenAI-compatible HTTP server: the starlette app (app.py), request schemas,
Qwen tool-call parsing, Prometheus metrics, the embedded demo model, and the model
flags shared with the chat CLI (loading.py). Only app.py imports starlette."""
