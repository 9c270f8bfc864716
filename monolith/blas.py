"""Which BLAS MLX's CPU matrix products run on, and OpenBLAS by default on Linux.

MLX's Linux CPU wheel bundles a slow reference BLAS; an installed OpenBLAS preloaded
into the process takes its place (about 30x faster F32 products: docs/performance.md,
"The CPU backend here"). The dynamic loader reads LD_PRELOAD only when a process
starts, so `preload_openblas()`, called first by `python -m monolith.serve`, `chat` and
`generate`, re-executes the command once with LD_PRELOAD set when it finds an OpenBLAS
that is not loaded yet (OPENBLAS_NUM_THREADS defaults to 1: faster than a threaded
OpenBLAS at these sizes on a few cores). `launch` starts serve, which does the same.
$MONOLITH_OPENBLAS=0 keeps the bundled BLAS; $MONOLITH_OPENBLAS=PATH preloads that
library. macOS (Accelerate) is left alone. `describe()` is the log line saying which
BLAS runs."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

CHOICE = "MONOLITH_OPENBLAS"  # "0" (or off/no/false): the bundled BLAS; a path: that library
MARKER = "MONOLITH_OPENBLAS_PRELOADED"  # set on the re-executed process: never re-execute twice
OFF = ("0", "off", "no", "false")
INSTALL = "sudo apt-get install libopenblas0-pthread"
LIBRARY = "libopenblas.so.0"

_tried: str | None = None  # the library a re-execution preloaded, read from MARKER at start


def candidates() -> list[Path]:
    """Where Debian, Ubuntu, Fedora and Arch put the OpenBLAS library."""
    arch = platform.machine()
    return [Path(f"/usr/lib/{arch}-linux-gnu/{LIBRARY}"), Path(f"/usr/lib64/{LIBRARY}"), Path(f"/usr/lib/{LIBRARY}")]


def loaded_openblas(maps: Path = Path("/proc/self/maps")) -> str | None:
    """The path of the OpenBLAS library mapped into this process, or None."""
    try:
        text = maps.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
        if len(fields) == 6 and Path(fields[5]).name.startswith("libopenblas"):
            return fields[5]
    return None


def find_openblas(env=None) -> str | None:
    """The OpenBLAS library to preload: $MONOLITH_OPENBLAS's path, or an installed one."""
    env = os.environ if env is None else env
    chosen = env.get(CHOICE, "").strip()
    if chosen and chosen.lower() not in OFF:
        return chosen if Path(chosen).is_file() else None
    return next((str(p) for p in candidates() if p.is_file()), None)


def opted_out(env=None) -> bool:
    env = os.environ if env is None else env
    return env.get(CHOICE, "").strip().lower() in OFF


def preload_openblas(execve=os.execve) -> None:
    """Re-execute this command with OpenBLAS preloaded, when on Linux, not opted out, not
    re-executed already, not loaded already and installed; else return at once."""
    global _tried
    _tried = os.environ.pop(MARKER, None)  # the command's own children start afresh
    if not sys.platform.startswith("linux") or opted_out() or _tried is not None or loaded_openblas():
        return
    library = find_openblas()
    if library is None:
        return
    preload = os.environ.get("LD_PRELOAD")
    env = {**os.environ, MARKER: library, "LD_PRELOAD": library + (f":{preload}" if preload else "")}
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    sys.stdout.flush()
    sys.stderr.flush()
    execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def describe() -> str | None:
    """One line: which BLAS MLX's CPU matrix products use here, and how to get OpenBLAS
    where it is missing; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    library = loaded_openblas()
    if library is not None:
        threads = os.environ.get("OPENBLAS_NUM_THREADS")
        return (f"BLAS: OpenBLAS ({library}, {threads or 'its default number of'} thread"
                f"{'' if threads == '1' else 's'}) for MLX's CPU matrix products ({CHOICE}=0 turns it off)")
    bundled = "BLAS: MLX's bundled reference BLAS, about 30x slower F32 matrix products"
    if opted_out():
        return f"{bundled} ({CHOICE}={os.environ[CHOICE]})"
    if _tried is not None:
        return f"{bundled}: preloading {_tried} did not load it"
    return f"{bundled}; OpenBLAS is used when installed: {INSTALL}"
