"""Chip-layout packs: build (checkpoint -> pack), verify, unpack, inspect, cache."""

from .build import build_pack
from .cache import resolve_pack
from .inspect import inspect_pack
from .manifest import is_pack, read_manifest
from .plan import plan_pack
from .recipe import PackError
from .unpack import unpack_pack
from .verify import verify_pack

__all__ = [
    "PackError",
    "build_pack",
    "inspect_pack",
    "is_pack",
    "plan_pack",
    "read_manifest",
    "resolve_pack",
    "unpack_pack",
    "verify_pack",
]
