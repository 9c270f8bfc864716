"""Chip-layout packs: build (checkpoint -> pack), verify, unpack, inspect, cache."""

from .build import build_pack
from .cache import resolve_pack
from .inspect import inspect_pack
from .manifest import is_pack, read_manifest
from .plan import plan_pack
from .recipe import PackError
from .unpack import unpack_pack
from .verify import VERIFY_MODES, ensure_verified, verify_pack

__all__ = [
    "VERIFY_MODES",
    "PackError",
    "build_pack",
    "ensure_verified",
    "inspect_pack",
    "is_pack",
    "plan_pack",
    "read_manifest",
    "resolve_pack",
    "unpack_pack",
    "verify_pack",
]
