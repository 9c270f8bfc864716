"""What every `python -m monolith.*` command shares: usage errors are one line on
stderr and exit status 1, like every other bad input (argparse would print the usage
and exit 2)."""

from __future__ import annotations

import argparse
import sys


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(1)
