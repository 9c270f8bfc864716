"""Runtime: caches, sampling, the speculative round, the engine.

Keep this package's import light: the models import runtime.cache, so importing a
module here that imports monolith.models would be circular.
"""

from .cache import (
    SPARE_ROWS,
    CacheError,
    GDNState,
    GDNTape,
    HybridCache,
    KVCache,
    Snapshot,
)

__all__ = ["SPARE_ROWS", "CacheError", "GDNState", "GDNTape", "HybridCache", "KVCache", "Snapshot"]
