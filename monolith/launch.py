"""python -m monolith.launch claude|codex|opencode [serve flags] [--client-bin PATH] [--print-env]
[-- CLIENT ARGS]: run a coding agent against a monolith server.

If a monolith server already answers at --host / --port (with --api-key, or
$MONOLITH_API_KEY, when it wants a key), the client uses it as it is: it keeps its own
model and settings. Otherwise launch starts `python -m monolith.serve` there with the
serve flags given here (--model, --no-draft, --max-context ...) and a key generated for
it (or --api-key's), shows its progress until GET /health says the model is ready, runs
the client, and stops the server (SIGTERM, then a wait) when the client exits. The
client gets the server's address, key and model name by its environment or its
arguments (monolith/agents.py), never by editing its configuration files. Everything
after `--` goes to the client as it is, and the exit status is the client's. A Ctrl-C
in the terminal goes to the client. --print-env prints what the client would be given
and starts nothing."""

from __future__ import annotations

import http.client
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from .agents import CLIENTS, Client, Server, Setup
from .model_flags import SetupError, plan_model
from .pack.manifest import cache_root
from .serve import build_parser as build_serve_parser

LAUNCH_ONLY = {"--client-bin": 1, "--print-env": 0, "--api-key": 1}  # launch's own flags: the values each takes
MODEL_FLAGS = ("--model", "--pack", "--served-model-name")  # checked against a server that is found
HEALTH_STATES = ("ok", "loading", "failed", "unhealthy")  # serving.app's /health
POLL_SECONDS = 0.25
STOP_SECONDS = 30  # serve's graceful shutdown takes up to 10 s


class LaunchError(Exception):
    """One line (or a few) for the user, exit 1."""


def build_parser():
    """serve's own parser (every serve flag means here what it means there) plus the client
    and launch's flags."""
    ap = build_serve_parser()
    ap.prog = "python -m monolith.launch"
    ap.usage = "%(prog)s {claude,codex,opencode} [serve flags] [--client-bin PATH] [--print-env] [-- CLIENT ARGS]"
    ap.description = __doc__
    ap.allow_abbrev = False  # serve gets the flags as typed: an abbreviation of launch's own would reach it
    ap.add_argument("client", choices=sorted(CLIENTS), help="the coding agent to run")
    ap.add_argument("--client-bin", metavar="PATH", help="the client's executable (default: its command on PATH)")
    ap.add_argument("--print-env", action="store_true",
                    help="print the environment and arguments the client would get, as shell lines, and exit")
    return ap


def parse(argv: list[str]):
    """(the parsed flags, the flags for serve as typed, the client's arguments)."""
    ours, client_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = build_parser().parse_args(ours)
    if ours[0] != args.client:
        raise LaunchError(f"name the client first: python -m monolith.launch {args.client} [flags]")
    if args.distributed:
        raise LaunchError("--distributed: start the ranks with mlx.launch yourself, then run launch against rank 0")
    if not 1 <= args.port <= 65535:
        raise LaunchError(f"--port must be in [1, 65535], got {args.port}")
    if args.api_key is not None and not args.api_key.strip():
        raise LaunchError("--api-key is empty: give a key, or leave the flag out to have one generated")
    return args, serve_flags(ours[1:]), client_args


def serve_flags(tokens: list[str]) -> list[str]:
    """The flags, as typed, less launch's own (the key goes to serve by its environment, off
    the command line)."""
    kept, skip = [], 0
    for token in tokens:
        if skip:
            skip -= 1
        elif token.split("=", 1)[0] in LAUNCH_ONLY:
            skip = 0 if "=" in token else LAUNCH_ONLY[token]
        else:
            kept.append(token)
    return kept


def client_origin(host: str, port: int) -> str:
    """http://HOST:PORT as a client on this machine reaches a server bound to `host`."""
    host = host.strip("[]")
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# ------------------------------------------------------------------ asking the server

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the server is local: never via a proxy


def get(origin: str, path: str, key: str | None = None):
    """(status, JSON body or None) of GET origin+path, or None when nothing listens there."""
    request = urllib.request.Request(origin + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with _OPENER.open(request, timeout=10) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    except (OSError, http.client.HTTPException) as e:
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        if isinstance(reason, ConnectionRefusedError):
            return None
        raise LaunchError(not_monolith(origin, f"GET {path}: {reason}")) from None
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def not_monolith(origin: str, what: str) -> str:
    return (f"the port is taken by something that is not a monolith server ({origin}, {what}): stop it, or "
            "give another --port")


def health(origin: str) -> dict | None:
    """The body of a monolith server's GET /health (`status` one of HEALTH_STATES), or None
    when nothing listens at `origin`."""
    answer = get(origin, "/health")
    if answer is None:
        return None
    status, body = answer
    state = body.get("status") if isinstance(body, dict) else None
    if state not in HEALTH_STATES or (status == 200) != (state == "ok"):
        raise LaunchError(not_monolith(origin, f"GET /health answered {status}"))
    return body


def served_models(origin: str, key: str | None) -> dict[str, int | None]:
    """{model name: its max_model_len, None while loading} of GET /v1/models."""
    answer = get(origin, "/v1/models", key)
    if answer is None:
        raise LaunchError(f"the server at {origin} stopped answering")
    status, body = answer
    if status == 401:
        raise LaunchError(f"the monolith server at {origin} " + ("refuses the key given" if key else "wants an API key")
                          + ": give its key with --api-key (or $MONOLITH_API_KEY), or give another --port to have "
                          "launch start a server of its own")
    try:
        models = {m["id"]: m.get("max_model_len") for m in body["data"] if m.get("owned_by") == "monolith"}
    except (TypeError, KeyError, AttributeError):
        models = {}
    if status != 200 or not models:
        raise LaunchError(not_monolith(origin, f"GET /v1/models answered {status}"))
    return models


def pick_model(origin: str, models: dict, wanted: str | None) -> str:
    """The model the client asks for: `wanted` (an error if the server lacks it), else the
    server's first."""
    if wanted is None:
        return next(iter(models))
    if wanted not in models:
        raise LaunchError(f"the monolith server at {origin} serves {', '.join(models)}, not {wanted}: stop it, "
                          "or give another --port to have launch start one for it")
    return wanted


# ------------------------------------------------------------------ the server


class ServerProcess:
    """A `python -m monolith.serve` that launch started, in its own session (a Ctrl-C in the
    terminal does not reach it). Its output goes to a log file, and to stderr until ready."""

    def __init__(self, flags: list[str], key: str, log_path):
        self.log_path = log_path
        self.last_line = "no output"  # shown again if it stops before it is ready
        self.echo = True
        self.proc = subprocess.Popen([sys.executable, "-m", "monolith.serve", *flags], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                     env={**os.environ, "MONOLITH_API_KEY": key}, start_new_session=True)
        self.copier = threading.Thread(target=self._copy, daemon=True)
        self.copier.start()

    def _copy(self) -> None:
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                self.last_line = line.strip() or self.last_line
                if self.echo and '"GET /health ' not in line:  # launch's own polls
                    sys.stderr.write(f"[serve] {line}")

    def wait_ready(self, origin: str) -> None:
        """Return once GET /health says ok; LaunchError with its last line if it exits first."""
        while (health(origin) or {}).get("status") != "ok":
            if self.proc.poll() is not None:
                self.copier.join(timeout=5)
                raise LaunchError(f"the server exited (status {self.proc.returncode}) before it was ready: "
                                  f"{self.last_line} (its output is above, and in {self.log_path})")
            time.sleep(POLL_SECONDS)
        self.echo = False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_SECONDS)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                self.proc.kill()
                self.proc.wait()
        self.copier.join(timeout=5)


def wait_loading(origin: str) -> None:
    """Wait for a server that launch did not start to finish loading its model."""
    while (state := health(origin)) is not None and state["status"] == "loading":
        time.sleep(POLL_SECONDS)
    if state is None or state["status"] != "ok":
        reason = "it stopped" if state is None else state.get("message", state["status"])
        raise LaunchError(f"the monolith server at {origin} did not become ready: {reason}")


def found_server(origin: str, key: str | None, wanted: str | None, state: dict, unused: list[str]) -> Server:
    """The server that already answers at `origin`, ready for the client."""
    if state["status"] not in ("ok", "loading"):
        raise LaunchError(f"the monolith server at {origin} cannot serve: {state.get('message', state['status'])}")
    models = served_models(origin, key)
    model = pick_model(origin, models, wanted)
    say(f"using the monolith server already at {origin} ({model})"
        + (f"; it keeps its own settings, so these are not used: {' '.join(unused)}" if unused else ""))
    if state["status"] == "loading":
        say("waiting for it to finish loading")
        wait_loading(origin)
        models = served_models(origin, key)  # its context is known once it is loaded
    return Server(origin, key, model, models.get(model))


# ------------------------------------------------------------------ the client


def client_binary(client: Client, given: str | None) -> str:
    found = shutil.which(given or client.command)
    if found:
        return found
    if given:
        raise LaunchError(f"--client-bin {given} is not an executable file")
    raise LaunchError(f"{client.command} is not on PATH: install {client.title} with `npm install -g "
                      f"{client.npm_package}`, or give its executable with --client-bin PATH")


def ctrl_c_reaches_client() -> bool:
    """Does a Ctrl-C reach the client without launch's help? It does when launch runs in the
    foreground of its controlling terminal: the terminal signals the whole process group,
    the client's too, and a second Ctrl-C from launch would read as a double press."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def run_client(binary: str, setup: Setup, client_args: list[str]) -> int:
    """Run the client to its end; SIGINT (unless the terminal delivers it), SIGTERM and SIGHUP
    sent to launch go to it. Its exit status, 128 + N if signal N ended it."""
    env = {name: value for name, value in os.environ.items() if name not in setup.unset}
    env.update(setup.env)
    running: list[subprocess.Popen] = []
    forward_ctrl_c = not ctrl_c_reaches_client()

    def forward(signum, _frame):
        if running and (signum != signal.SIGINT or forward_ctrl_c):
            running[0].send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        try:
            running.append(subprocess.Popen([binary, *setup.args, *client_args], env=env))
        except OSError as e:
            raise LaunchError(f"cannot run {binary}: {e}") from None
        code = running[0].wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code


def print_env(client: Client, origin: str, key: str | None, wanted: str, named: bool, client_args: list[str]) -> None:
    """What the client would be given, as shell lines (`eval` them), from the server that
    answers at `origin` or, when none does, the one launch would start there."""
    state = health(origin)
    if state is None:
        note = (f"no server answers at {origin}: launch would start one for {wanted} and generate its key; "
                "start one yourself with python -m monolith.serve --api-key KEY, and give --api-key KEY here")
        server = Server(origin, key or "KEY", wanted, None)
    else:
        models = served_models(origin, key)
        model = pick_model(origin, models, wanted if named else None)
        note, server = f"the monolith server at {origin}", Server(origin, key, model, models[model])
    setup = client.setup(server)
    print(f"# {note}")
    for name, value in setup.env.items():
        print(f"export {name}={shlex.quote(value)}")
    for name in setup.unset:
        print(f"unset {name}")
    print("# then: " + shlex.join([client.command, *setup.args, *client_args]))


def exit_by_signal(signum, _frame):
    raise SystemExit(128 + signum)


def say(text: str) -> None:
    print(f"monolith.launch: {text}", file=sys.stderr, flush=True)


def launch(args, flags: list[str], client_args: list[str]) -> int:
    client = CLIENTS[args.client]
    key = args.api_key or os.environ.get("MONOLITH_API_KEY") or None
    origin = client_origin(args.host, args.port)
    plan = plan_model(args)
    wanted = args.served_model_name[0] if args.served_model_name else plan.name
    named = any(getattr(args, flag[2:].replace("-", "_")) for flag in MODEL_FLAGS)
    if args.print_env:
        print_env(client, origin, key, wanted, named, client_args)
        return 0
    binary = client_binary(client, args.client_bin)
    state = health(origin)
    if state is not None:
        unused = [f for f in flags if f.startswith("--") and f.split("=")[0] not in ("--host", "--port", *MODEL_FLAGS)]
        return run_client(binary, client.setup(found_server(origin, key, wanted if named else None, state, unused)),
                          client_args)
    key = key or secrets.token_urlsafe(24)
    for signum in (signal.SIGTERM, signal.SIGHUP):  # end launch through its `finally`, which stops the server
        signal.signal(signum, exit_by_signal)
    log_path = cache_root().parent / "logs" / f"serve-{args.port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    say(f"starting python -m monolith.serve at {origin} for {wanted} (log: {log_path})")
    server = ServerProcess(flags, key, log_path)
    try:
        server.wait_ready(origin)
        say(f"the server is ready; running {binary}")
        code = run_client(binary, client.setup(Server(origin, key, wanted, served_models(origin, key).get(wanted))),
                          client_args)
    finally:
        server.stop()
        say("stopped the server")
    return code


def main(argv=None) -> int:
    try:
        return launch(*parse(list(sys.argv[1:] if argv is None else argv)))
    except (LaunchError, SetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
