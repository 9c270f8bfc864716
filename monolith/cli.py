"""What every `python -m monolith.*` command shares: usage errors are one line on
stderr and exit status 1, like every other bad input (argparse would print the usage
and exit 2); a failure that is not bad input is a bug of ours and shows its traceback
before that line (`print_failure`); and a command whose output's reader leaves early
(`... | head`) ends quietly (`quiet_when_stdout_closes`)."""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import traceback

STDOUT_CLOSED = 141  # 128 + SIGPIPE: the status a shell reports for a writer whose reader left


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(1)


def print_failure(error: BaseException, bad_input: tuple[type, ...], stderr=None) -> None:
    """The `error:` line a command ends with. Bad input (an exception of the `bad_input`
    kinds: a missing or corrupt file, a wrong flag) is that one line; anything else is a
    bug of ours, so its traceback comes first, to be reported."""
    stderr = stderr or sys.stderr
    if isinstance(error, bad_input):
        message = str(error)
    else:
        traceback.print_exception(error, file=stderr)
        message = f"internal error (a bug in monolith; the traceback above says where): {type(error).__name__}: {error}"
    print(f"error: {message}".replace("\n", " "), file=stderr)


def quiet_when_stdout_closes(main):
    """`main`, returning STDOUT_CLOSED (141, as `cat` or `git` killed by SIGPIPE) with no
    error line and no traceback when the reader of stdout closes it before the output
    ends (`python -m monolith.pack inspect --json | head`): the output left is dropped.
    Not 0, since the output was cut short; a shell pipeline's status is the last
    command's unless `set -o pipefail`. `main` must let BrokenPipeError through."""

    @functools.wraps(main)
    def quiet(*args, **kwargs) -> int:
        try:
            status = main(*args, **kwargs)
            sys.stdout.flush()  # what is still buffered fails here, not at exit
            return status
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # the flush at exit has nowhere to fail
            os.close(devnull)
            return STDOUT_CLOSED

    return quiet


_BYTE_SIZE = re.compile(r"(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(text: str) -> int:
    """argparse type: a byte count such as 4000000, 512M, 8GiB or 1.5G (K, M, G, T are
    powers of 1024, with or without "B" / "iB")."""
    match = _BYTE_SIZE.fullmatch(text.strip().lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (use e.g. 4000000, 512M or 8G)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])
