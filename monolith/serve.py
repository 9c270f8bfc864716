"""python -m monolith.serve [--model M] [--draft D | --no-draft] [--host H] [--port P] ...:
an OpenAI-compatible HTTP server (docs/serving.md). The server answers at once and loads
the model in the background: GET /health says 503 until it is ready, then 200. With no
--model it serves the bundled demo pair."""

from __future__ import annotations

import ipaddress
import logging
import os
import sys
from pathlib import Path

from .blas import preload_openblas
from .cli import ArgumentParser, byte_size
from .distributed import add_distributed_arguments, join, rank_of, to_stderr
from .engine_setup import SetupError, add_model_arguments, load_engine, plan_model
from .serving.images import MAX_IMAGE_BYTES, MAX_IMAGES
from .serving.responses_store import STORED_BYTES, STORED_RESPONSES

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DEFAULT_MAX_BATCH = 4  # bench/concurrency.py: see README, "Concurrent requests"


def build_parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m monolith.serve", description=__doc__)
    add_model_arguments(ap)
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", nargs="+", metavar="NAME",
                    help="the model name(s) clients use (default: the --model value, or monolith-demo)")
    ap.add_argument("--api-key", help="require Authorization: Bearer KEY on every endpoint but /health "
                                      "(default: $MONOLITH_API_KEY; unset = no key)")
    ap.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                    help="requests generated at once, sharing each forward (default 4; 1: one at a time)")
    ap.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more get 429 (default 64)")
    ap.add_argument("--queue-timeout", type=float, default=300.0,
                    help="seconds a request may wait in the queue before a 503 (default 300)")
    ap.add_argument("--max-request-bytes", type=int, default=8 * 2**20,
                    help="larger request bodies get 413 (default 8 MiB)")
    ap.add_argument("--max-tokens-limit", type=int, metavar="N",
                    help="the most tokens one request generates; larger max_tokens are capped (default: the "
                         "context, --max-context)")
    ap.add_argument("--allowed-origins", nargs="+", default=(), metavar="ORIGIN",
                    help="browser origins (e.g. https://ui.example.com, or *) served besides pages of this "
                         "machine's loopback; other cross-origin browser requests get 403")
    ap.add_argument("--header-timeout", type=float, default=30.0, metavar="SECONDS",
                    help="close a connection whose request head has not arrived in this long (default 30)")
    ap.add_argument("--body-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="a request body that has not arrived in this long gets 408 (default 60)")
    store = ap.add_argument_group("the Responses API's stored responses (previous_response_id, GET/DELETE "
                                  "/v1/responses/{id}); with --prompt-cache-dir DIR kept in DIR/responses across "
                                  "restarts")
    store.add_argument("--response-store-size", type=int, default=STORED_RESPONSES, metavar="N",
                       help=f"the most responses kept; the least recently used go first (default {STORED_RESPONSES})")
    store.add_argument("--response-store-bytes", type=byte_size, default=STORED_BYTES, metavar="BYTES",
                       help="the most bytes they take (a response's JSON with its conversation), e.g. 1G "
                            f"(default {STORED_BYTES >> 20}M)")
    images = ap.add_argument_group("image parts (docs/serving.md, \"Images\")")
    images.add_argument("--allow-image-urls", action="store_true",
                        help="fetch http(s) image URLs (default: refused with a 400; a local server should not "
                             "fetch for a web page); data: URLs are always taken")
    images.add_argument("--max-image-bytes", type=byte_size, default=MAX_IMAGE_BYTES, metavar="BYTES",
                        help=f"the most encoded bytes of one image (default {MAX_IMAGE_BYTES >> 20}M; a data: URL "
                             "also counts against --max-request-bytes)")
    images.add_argument("--max-images", type=int, default=MAX_IMAGES, metavar="N",
                        help=f"the most images in one request's conversation (default {MAX_IMAGES})")
    ap.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    add_distributed_arguments(ap)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = plan_model(args)
        check_server_options(args)
    except SetupError as e:
        return _failed(e)
    if args.distributed and rank_of(args) != 0:  # a stage only: rank 0 serves
        try:
            return join(args, plan, to_stderr).serve()
        except SetupError as e:
            return _failed(e)
    return serve(args, plan)


def check_server_options(args) -> None:
    """Check the server's own flags (the model flags are plan_model's): SetupError with
    one line."""
    if not 0 <= args.port <= 65535:
        raise SetupError(f"--port must be in [0, 65535], got {args.port}")
    for flag, value in (("--max-batch", args.max_batch), ("--max-queue", args.max_queue),
                        ("--max-request-bytes", args.max_request_bytes),
                        ("--max-image-bytes", args.max_image_bytes), ("--max-images", args.max_images),
                        ("--response-store-size", args.response_store_size),
                        ("--response-store-bytes", args.response_store_bytes)):
        if value < 1:
            raise SetupError(f"{flag} must be at least 1, got {value}")
    if not args.queue_timeout > 0:
        raise SetupError(f"--queue-timeout must be positive, got {args.queue_timeout}")
    for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not value > 0:
            raise SetupError(f"{flag} must be positive, got {value}")
    if args.max_tokens_limit is not None and args.max_tokens_limit < 1:
        raise SetupError(f"--max-tokens-limit must be at least 1, got {args.max_tokens_limit}")
    if args.api_key is not None and not args.api_key.strip():
        raise SetupError("--api-key is empty: an empty key would turn authentication off; give a key, "
                         "or leave the flag out (and MONOLITH_API_KEY unset) to serve without one")


def server_config(args, plan):
    """The app's serving.app.ServerConfig from the flags (and $MONOLITH_API_KEY)."""
    from .serving.app import ServerConfig
    from .serving.images import ImageLimits

    api_key = args.api_key if args.api_key is not None else os.environ.get("MONOLITH_API_KEY") or None
    return ServerConfig(tuple(args.served_model_name or [plan.name]), api_key, args.max_request_bytes,
                        max_tokens_limit=args.max_tokens_limit, loopback_only=_loopback_address(args.host),
                        allowed_origins=tuple(args.allowed_origins), body_timeout=args.body_timeout,
                        response_store_size=args.response_store_size,
                        response_store_bytes=args.response_store_bytes,
                        images=ImageLimits(args.max_image_bytes, args.max_images, args.allow_image_urls),
                        response_store_dir=None if args.prompt_cache_dir is None
                        else str(Path(args.prompt_cache_dir) / "responses"))


def serve(args, plan) -> int:
    """Serve HTTP until stopped, loading the model in the background (with --distributed,
    as rank 0: joining the other ranks first); the exit status."""
    import uvicorn

    from .serving.app import create_app
    from .serving.timeouts import timed_h11

    level = logging.DEBUG if args.log_level == "trace" else getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(levelname)s:     %(message)s", stream=sys.stderr)
    log = logging.getLogger("monolith.serve")
    failures: list[Exception] = []
    server: uvicorn.Server | None = None

    def on_load_failure(error: Exception) -> None:
        failures.append(error)
        server.should_exit = True

    ranks = []  # with --distributed: this rank's place, stopped on the way out

    def load():
        if not args.distributed:
            return load_engine(args, plan, log.info, args.max_queue, args.queue_timeout, max_batch=args.max_batch)
        ranks.append(join(args, plan, log.info))
        return load_engine(args, plan, log.info, args.max_queue, args.queue_timeout, max_batch=args.max_batch,
                           sources=ranks[0].sources, load=ranks[0].target)

    try:
        app = create_app(load, server_config(args, plan), on_load_failure)
    except OSError as e:  # the stored responses' directory
        return _failed(f"--prompt-cache-dir {args.prompt_cache_dir}: {e}")
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=10, http=timed_h11(args.header_timeout)))
    logging.getLogger("uvicorn.access").addFilter(HealthPolls())
    log.info("loading %s in the background; /health answers 503 until it is ready", plan.name)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn shuts down gracefully, then re-raises the Ctrl-C
        pass
    finally:
        for rank in ranks:
            rank.close()
    if failures:
        return _failed(str(failures[0]).replace("\n", " "))
    return 0 if server.started else 1


class HealthPolls(logging.Filter):
    """The access log's GET /health lines: of a run of 503s (a client polling while the
    model loads) only the first; every other answer as it comes."""

    def __init__(self):
        super().__init__()
        self.last = None  # the status of the last /health answer logged or dropped

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) < 5 or str(args[2]).split("?")[0] != "/health":
            return True
        repeated = args[4] == 503 and self.last == 503
        self.last = args[4]
        return not repeated


def _failed(error) -> int:
    """Say `error` on stderr as one "error: ..." line; exit status 1."""
    print(f"error: {error}", file=sys.stderr)
    return 1


def _loopback_address(host: str) -> bool:
    """Is the bind address this machine's loopback only (then only loopback Host headers are served)?"""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


if __name__ == "__main__":
    preload_openblas()  # re-executes this command once with OpenBLAS, where one is installed
    sys.exit(main())
