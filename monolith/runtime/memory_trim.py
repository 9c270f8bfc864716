"""Handing the freed C heap back to the system: the engine does when it goes idle, the
server after a request body of a MiB or more (which never reaches the engine if refused).

Each request allocates and frees native memory on several threads: the tokenizer's, the
HTTP server's workers, the engine's. glibc gives each thread an arena and keeps what a
thread freed inside it for reuse, so a server's RSS climbs toward the sum of every
arena's high-water mark and stays there although the memory is free (bench/fuzz.py:
without the prompt cache, 218 -> 259 MiB over 1,200 requests, while MLX's arrays and
buffer cache and Python's heap stayed flat). `malloc_trim(0)` returns the free pages of
every arena, wherever they lie; macOS's allocator has the same in
`malloc_zone_pressure_relief(NULL, 0)`. Elsewhere `trim()` does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable


def _release() -> Callable[[], object] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    except OSError:
        return None
    if sys.platform.startswith("linux") and hasattr(libc, "malloc_trim"):
        trim = libc.malloc_trim
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        return lambda: trim(0)
    if sys.platform == "darwin" and hasattr(libc, "malloc_zone_pressure_relief"):
        relief = libc.malloc_zone_pressure_relief
        relief.argtypes, relief.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_size_t
        return lambda: relief(None, 0)
    return None


_RELEASE = _release()


def trim() -> bool:
    """Give the free pages of the C heap back to the system; False where the platform's
    allocator has no way to (then RSS keeps the freed memory, which is still reused)."""
    if _RELEASE is None:
        return False
    _RELEASE()
    return True
