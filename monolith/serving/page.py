"""The chat page at `/` (docs/serving.md, "The chat page"): static files shipped in the
package (monolith/serving/static: index.html, the page's own scripts and styles, and
the vendored libraries under vendor/, each with its licence). They hold no secret, so
they are served without the API key; the Host and Origin rules still apply (access.py).
Every file goes out with a Content-Security-Policy that lets the page load and call
only its own origin: nothing is fetched from anywhere else, and a model's reply
rendered into the page cannot run script."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from . import access
from .errors import APIError

STATIC = Path(__file__).parent / "static"
POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
          "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": POLICY, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".png": "image/png", ".svg": "image/svg+xml"}


def shipped_files(root: Path = STATIC) -> dict[str, Path]:
    """The page's files by their URL path under /static/ (only these are served)."""
    return {path.relative_to(root).as_posix(): path for path in sorted(root.rglob("*"))
            if path.is_file() and path.suffix in MEDIA_TYPES}


def routes(handlers) -> list[Route]:
    """GET / (index.html) and GET /static/{path}, checked against the server's Host and
    Origin rules (handlers.state.config) but not its API key."""
    files = shipped_files()
    config = handlers.state.config

    def send(request: Request, path: Path | None) -> Response:
        try:
            access.check_origin(config, request)
            if path is None:
                raise APIError(404, f"GET {request.url.path}: the page has no such file", code="not_found")
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=HEADERS)

    async def index(request: Request) -> Response:
        return send(request, files.get("index.html"))

    async def static(request: Request) -> Response:
        return send(request, files.get(request.path_params["path"]))

    return [Route("/", index, methods=["GET"]), Route("/static/{path:path}", static, methods=["GET"])]
