"""Who may call the server: the Host and Origin checks against DNS rebinding and foreign
browser pages, and the API key. Each takes the ServerConfig (app.py) and a starlette
Request or WebSocket (their headers), and raises the APIError to answer with."""

from __future__ import annotations

import hmac

from .errors import APIError


def check_origin(config, request) -> None:
    """Bound to loopback, only a loopback Host is served: a page whose own name
    resolves to 127.0.0.1 (DNS rebinding) sends its name. A browser page of another
    origin (its Origin header) is refused unless --allowed-origins names it; pages
    served from loopback are trusted, as clients without an Origin are."""
    host = request.headers.get("host", "")
    if config.loopback_only and not _loopback(_hostname(host)):
        raise APIError(403, f"the Host header {host[:80]!r} is not this machine's loopback address: a server "
                            "bound to loopback answers only requests addressed to localhost or 127.0.0.1",
                       code="host_not_allowed")
    origin = request.headers.get("origin")
    if origin is None or "*" in config.allowed_origins or origin in config.allowed_origins:
        return
    scheme, _, rest = origin.partition("://")
    if scheme in ("http", "https") and _loopback(_hostname(rest)):
        return
    raise APIError(403, f"requests from the browser origin {origin[:80]!r} are not allowed; start the server "
                        "with --allowed-origins to allow it", code="origin_not_allowed")


def authorize(config, request) -> None:
    key = config.api_key
    if not key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise APIError(401, "missing or invalid API key: send the header Authorization: Bearer KEY "
                       "(or x-api-key: KEY)", code="invalid_api_key")


def _hostname(host: str) -> str:
    """The name of a Host header (or an origin's authority), without the port."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _loopback(name: str) -> bool:
    if name in ("localhost", "::1") or name.endswith(".localhost"):
        return True
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "127" and all(p.isdigit() and int(p) < 256 for p in parts)
