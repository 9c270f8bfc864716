"""python -m monolith.serve [--model M] [--draft D | --no-draft] [--host H] [--port P] ...:
an OpenAI-compatible HTTP server (docs/serving.md). The server answers at once and loads
the model in the background: GET /health says 503 until it is ready, then 200. With no
--model it serves the bundled demo pair. --model given more than once serves several
models, each with the --draft values given after it; the first loads at start, the
others when a request names them (--keep-alive, --max-loaded-models, --memory-budget
unload idle ones)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path

from .blas import preload_openblas
from .cli import ArgumentParser, byte_size
from .distributed import add_distributed_arguments, join, rank_of, to_stderr
from .engine_setup import load_engine
from .model_flags import SPECULATIVE_FLAGS, SetupError, add_model_arguments, plan_model
from .serving.images import MAX_IMAGE_BYTES, MAX_IMAGES
from .serving.models import ModelSpec, duration, model_work_in_progress
from .serving.responses.store import STORED_BYTES, STORED_RESPONSES

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DEFAULT_MAX_BATCH = 4  # bench/concurrency.py: see README, "Concurrent requests"
MEMORY_BUDGET_SHARE = 0.9  # several models: their default memory budget, of the memory free at start


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
    ap.add_argument("--max-output-tokens", type=int, metavar="N",
                    help="the most tokens a reply takes when the request sets no limit (max_tokens, "
                         "max_output_tokens); a request may ask for more, up to the context (default: 32768, "
                         "Qwen3.6's recommended output length, or the checkpoint's generation_config.json "
                         "max_new_tokens / max_length when lower)")
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
    models = ap.add_argument_group("several models (--model given more than once; docs/serving.md, \"Several "
                                   "models\")")
    models.add_argument("--keep-alive", type=duration, metavar="SECONDS",
                        help="unload a model idle this long (seconds, or 30s, 5m, 1h; negative: never), to load it "
                             "again when a request names it; a request's keep_alive field sets its model's own "
                             "(default: never)")
    models.add_argument("--max-loaded-models", type=int, metavar="N",
                        help="the most models loaded at once: loading another first unloads the least recently "
                             "used idle one (default: no bound)")
    models.add_argument("--memory-budget", type=byte_size, metavar="BYTES",
                        help="the most memory the loaded models may take, e.g. 48G: loading another first unloads "
                             "the least recently used idle ones (default with several models: 90%% of the memory "
                             "free at start, logged)")
    models.add_argument("--allow-pull", action="store_true",
                        help="let clients add a model with Ollama's POST /api/pull: a hub id or a local checkpoint "
                             "directory, resolved, packed and loaded as --model with it would be, no draft "
                             "(default: /api/pull readies only the models given here)")
    ap.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    add_distributed_arguments(ap)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        models = [(model_args, plan_model(model_args)) for model_args in model_arguments(args)]
        check_server_options(args)
        names = served_names(args, [plan for _, plan in models])
    except SetupError as e:
        return _failed(e)
    if args.distributed and rank_of(args) != 0:  # a stage only: rank 0 serves
        try:
            return join(args, models[0][1], to_stderr).serve()
        except SetupError as e:
            return _failed(e)
    return serve(args, models, names)


ONE_MODEL_FLAGS = ("pack", "draft_pack", "revision", "draft_revision", "distributed")  # name one model's


def model_arguments(args) -> list:
    """Each --model's flags: `args` itself for one model; for several, a copy per --model
    with the --draft values given after it (before the next --model; those before the
    first go with the first). SetupError for a flag that names one model's pack or
    revision, or --distributed, beside several models."""
    if len(args.models or ()) <= 1:
        return [args]
    given = [f"--{flag.replace('_', '-')}" for flag in ONE_MODEL_FLAGS if getattr(args, flag, None)]
    if given:
        raise SetupError(f"{', '.join(given)} name{'s' if len(given) == 1 else ''} one model's: give "
                         f"{'it' if len(given) == 1 else 'them'} with one --model")
    return [argparse.Namespace(**vars(args) | {
        "model": model, "models": [model], "draft_for": None,
        "draft": [draft for at, draft in args.draft_for or () if at == i] or None}) for i, model in enumerate(args.models)]


def served_names(args, plans) -> list[tuple[str, ...]]:
    """Each model's names: --served-model-name's (one model: all of them; several: one
    each, in order), else its plan's name. SetupError when a name is given twice."""
    given = args.served_model_name
    if given and len(plans) > 1 and len(given) != len(plans):
        raise SetupError(f"--served-model-name gives {len(given)} names for {len(plans)} models: give one for each "
                         "--model, in order")
    names = [tuple(given)] if given and len(plans) == 1 else [(name,) for name in given or [p.name for p in plans]]
    every = [name for each in names for name in each]
    twice = sorted({name for name in every if every.count(name) > 1})
    if twice:
        raise SetupError(f"the model name {twice[0]!r} is given twice: name each model once (--served-model-name)")
    return names


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
    if args.allow_pull and args.distributed:
        raise SetupError("--allow-pull adds models on this machine: it does not go with --distributed")
    for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not value > 0:
            raise SetupError(f"{flag} must be positive, got {value}")
    for flag, value in (("--max-tokens-limit", args.max_tokens_limit), ("--max-output-tokens", args.max_output_tokens),
                        ("--max-loaded-models", args.max_loaded_models), ("--memory-budget", args.memory_budget)):
        if value is not None and value < 1:
            raise SetupError(f"{flag} must be at least 1, got {value}")
    if args.api_key is not None and not args.api_key.strip():
        raise SetupError("--api-key is empty: an empty key would turn authentication off; give a key, "
                         "or leave the flag out (and MONOLITH_API_KEY unset) to serve without one")


def server_config(args, plan, names: tuple[str, ...] | None = None):
    """The app's serving.app.ServerConfig from the flags (and $MONOLITH_API_KEY); `names`:
    every model's names (default: the one model of `plan`'s)."""
    from .serving.app import ServerConfig
    from .serving.images import ImageLimits

    api_key = args.api_key if args.api_key is not None else os.environ.get("MONOLITH_API_KEY") or None
    names = names or tuple(args.served_model_name or [plan.name])
    return ServerConfig(names, api_key, args.max_request_bytes,
                        max_tokens_limit=args.max_tokens_limit, max_output_tokens=args.max_output_tokens,
                        loopback_only=_loopback_address(args.host),
                        allowed_origins=tuple(args.allowed_origins), body_timeout=args.body_timeout,
                        response_store_size=args.response_store_size,
                        response_store_bytes=args.response_store_bytes,
                        images=ImageLimits(args.max_image_bytes, args.max_images, args.allow_image_urls),
                        response_store_dir=None if args.prompt_cache_dir is None
                        else str(Path(args.prompt_cache_dir) / "responses"))


def serve(args, models: list, names: list[tuple[str, ...]]) -> int:
    """Serve HTTP until stopped, loading the (first) model in the background (with
    --distributed, as rank 0: joining the other ranks first); the exit status. `models`:
    (flags, plan) of each model, `names` its names."""
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

    def loader(model_args, plan):
        def load():
            if not args.distributed:
                return load_engine(model_args, plan, log.info, args.max_queue, args.queue_timeout,
                                   max_batch=args.max_batch)
            ranks.append(join(args, plan, log.info))
            return load_engine(args, plan, log.info, args.max_queue, args.queue_timeout, max_batch=args.max_batch,
                               sources=ranks[0].sources, load=ranks[0].target)
        return load

    plan = models[0][1]
    pool = model_pool(args, [ModelSpec(each, loader(*model), _size_of(model[1])) for each, model in zip(names, models)],
                      log.info)
    if args.allow_pull:
        pool.pull = lambda name: ModelSpec((name,), *pulled(args, name, loader))
    try:
        app = create_app(pool, server_config(args, plan, tuple(n for each in names for n in each)), on_load_failure)
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
    status = _failed(str(failures[0]).replace("\n", " ")) if failures else 0 if server.started else 1
    if model_work_in_progress():  # stopped while a model loads: its thread is in MLX work
        log.info("stopped while loading a model: exiting without waiting for the load")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def pulled(args, name: str, loader) -> tuple:
    """(its load, its size) of a model a client pulls (--allow-pull): `name` as --model,
    the server's other model flags, no draft, no pack or revision of another model's;
    ValueError with one line when its flags do not plan."""
    cleared = {flag: None for flag in (*SPECULATIVE_FLAGS, *ONE_MODEL_FLAGS, "draft", "draft_for")}
    model_args = argparse.Namespace(**vars(args) | cleared | {"model": name, "models": [name], "no_draft": True,
                                                              "distributed": False})
    try:
        plan = plan_model(model_args)
    except SetupError as e:
        raise ValueError(str(e)) from None
    return loader(model_args, plan), _size_of(plan)


def model_pool(args, specs: list, log):
    """The server's serving.models.ModelPool: its keep-alive and bounds from the flags; with
    several models, a memory budget (--memory-budget, else MEMORY_BUDGET_SHARE of the memory
    free now), logged."""
    from .runtime.prompt_cache import available_memory
    from .serving.models import ModelPool

    budget = args.memory_budget
    if len(specs) > 1:
        if budget is None:
            budget = int(MEMORY_BUDGET_SHARE * available_memory())
        log(f"{len(specs)} models: {', '.join(spec.names[0] for spec in specs)}; the first loads now, the others "
            f"when a request names them; memory budget {budget / 2**30:.2f} GiB"
            + ("" if args.memory_budget else f" ({MEMORY_BUDGET_SHARE:.0%} of the memory free now)")
            + (f", at most {args.max_loaded_models} loaded" if args.max_loaded_models else ""))
    return ModelPool(specs, keep_alive=args.keep_alive, max_loaded=args.max_loaded_models, budget=budget,
                     load_timeout=args.queue_timeout)


def _size_of(plan):
    """The bytes `plan`'s model is expected to take before its first load: the safetensors
    files of its target's and drafts' directories (a hub id: 0, unknown until loaded)."""
    def size() -> int:
        paths = [Path(p) for p in (plan.target, *plan.drafts) if p is not None and Path(p).is_dir()]
        return sum(f.stat().st_size for path in paths for f in path.rglob("*.safetensors"))
    return size


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
