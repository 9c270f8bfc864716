"""Guarded buffers and fiber stacks for the emulator (see runner.py): each buffer in its
own mapping between PROT_NONE guard regions, with a canary in the slack of its last page."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

CANARY = 0xA5
POISON = 0xFF
PAGE = mmap.PAGESIZE
GUARD_FACTOR = 4
MAP_PRIVATE, MAP_ANONYMOUS, MAP_NORESERVE = 0x02, 0x20, 0x4000  # Linux

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class Guarded:
    """`nbytes` of data in its own mapping, between PROT_NONE guard regions of
    GUARD_FACTOR times the data size (at least a page) on both sides: an index that is a
    few rows or a wrong stride away faults instead of reading a neighbouring buffer."""

    def __init__(self, name: str, nbytes: int, itemsize: int, align: str, fill: int):
        self.name, self.nbytes, self.itemsize = name, nbytes, itemsize
        self.data_len = max(1, -(-nbytes // PAGE)) * PAGE
        self.guard = max(PAGE, -(-GUARD_FACTOR * nbytes // PAGE) * PAGE)
        self.total = self.data_len + 2 * self.guard
        base = _libc.mmap(None, self.total, 0, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if base in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"cannot map {self.total} bytes for buffer {name!r}")
        self.base = base
        self._protect(self.guard, self.data_len, mmap.PROT_READ | mmap.PROT_WRITE)
        slack = self.data_len - nbytes
        self.offset = self.guard + (slack if align == "end" else 0)
        self.address = self.base + self.offset
        self._bytes(self.guard, self.data_len)[:] = CANARY
        self._bytes(self.offset, nbytes)[:] = fill

    def _bytes(self, offset: int, length: int) -> np.ndarray:
        return np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(self.base + offset)) if length else \
            np.zeros(0, np.uint8)

    def _protect(self, start: int, length: int, prot: int) -> None:
        if _libc.mprotect(self.base + start, length, prot):
            raise OSError(ctypes.get_errno(), "mprotect failed")

    def view(self, dtype, shape, strides=None) -> np.ndarray:
        arr = self._bytes(self.offset, self.nbytes).view(dtype)
        if strides is None:
            return arr.reshape(shape)
        return np.lib.stride_tricks.as_strided(arr, shape, strides)

    def read_only(self) -> None:
        self._protect(self.guard, self.data_len, mmap.PROT_READ)

    def canary_ok(self) -> bool:
        self._protect(self.guard, self.data_len, mmap.PROT_READ)
        data = self._bytes(self.guard, self.data_len)
        lo, hi = self.offset - self.guard, self.offset - self.guard + self.nbytes
        return bool((data[:lo] == CANARY).all() and (data[hi:] == CANARY).all())

    def describe(self, address: int) -> str | None:
        if not self.base <= address < self.base + self.total:
            return None
        rel = address - self.address
        where = ("before the start" if rel < 0 else "past the end" if rel >= self.nbytes else "inside")
        return (f"buffer {self.name!r} ({self.nbytes} bytes): byte {rel} ({where}; element {rel // self.itemsize} "
                f"of {self.nbytes // self.itemsize})")

    def close(self) -> None:
        if self.base is not None:
            _libc.munmap(self.base, self.total)
            self.base = None


MAX_THREADS = 1024
_stacks: dict[int, tuple[mmap.mmap, object, int]] = {}


def fiber_stacks(stack_kb: int) -> int:
    """Address of MAX_THREADS fiber stacks of stack_kb KB, each above a PROT_NONE guard
    page: one mapping per size for the whole process, shared by every compiled kernel."""
    if stack_kb not in _stacks:
        size = stack_kb * 1024
        if size % PAGE:
            raise ValueError("stack_kb must be a whole number of pages")
        area = mmap.mmap(-1, MAX_THREADS * (size + PAGE), prot=mmap.PROT_READ | mmap.PROT_WRITE)
        anchor = ctypes.c_char.from_buffer(area)
        base = ctypes.addressof(anchor)
        for i in range(MAX_THREADS):
            if _libc.mprotect(base + i * (size + PAGE), PAGE, 0):
                raise OSError(ctypes.get_errno(), "mprotect failed")
        _stacks[stack_kb] = (area, anchor, base)
    return _stacks[stack_kb][2]
