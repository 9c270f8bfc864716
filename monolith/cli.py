"""What every `python -m monolith.*` command shares: usage errors are one line on
stderr and exit status 1, like every other bad input (argparse would print the usage
and exit 2)."""

from __future__ import annotations

import argparse
import re
import sys


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(1)



_BYTE_SIZE = re.compile(r"(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(text: str) -> int:
    """argparse type: a byte count such as 4000000, 512M, 8GiB or 1.5G (K, M, G, T are
    powers of 1024, with or without "B" / "iB")."""
    match = _BYTE_SIZE.fullmatch(text.strip().lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (use e.g. 4000000, 512M or 8G)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])
