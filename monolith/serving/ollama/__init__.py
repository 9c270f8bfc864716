"""Ollama's API (docs/serving.md, "Ollama API"): its routes (routes.py), requests
(requests.py) and replies (reply.py)."""
