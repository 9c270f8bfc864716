"""The suite never touches the user's cache: conftest's session-wide `private_cache`
points MONOLITH_CACHE at a directory under pytest's basetemp, and everything monolith
keeps in its cache resolves under it, in this process and in the commands the tests
start. (At the session's end `private_cache` also checks that the user's cache lists
the same names, sizes and mtimes as at its start.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from monolith.pack.manifest import cache_root
from monolith.serving.responses import seal


def test_the_cache_is_a_directory_of_the_session_not_the_users(private_cache, tmp_path_factory):
    cache = Path(os.environ["MONOLITH_CACHE"])
    assert cache == private_cache.private and cache.is_dir()
    assert cache.resolve().is_relative_to(tmp_path_factory.getbasetemp().resolve())
    assert os.environ["MONOLITH_CACHE"] != private_cache.runner_env
    assert not cache.resolve().is_relative_to(private_cache.user.resolve())
    assert not private_cache.user.resolve().is_relative_to(cache.resolve())


def test_what_monolith_keeps_in_its_cache_lands_in_the_private_one(private_cache):
    cache = private_cache.private.resolve()
    assert cache_root().resolve().is_relative_to(cache)
    assert seal.key_path().resolve().is_relative_to(cache)
    sealed = seal.Sealer().seal("probe")  # the key is made on first use: in the private cache
    assert seal.key_path().is_file() and seal.Sealer().open(sealed, "probe") == "probe"


def test_a_command_the_tests_start_inherits_the_private_cache(private_cache):
    code = ("from monolith.pack.manifest import cache_root\n"
            "from monolith.serving.responses.seal import key_path\n"
            "print(cache_root()); print(key_path())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        assert Path(line).resolve().is_relative_to(private_cache.private.resolve())
    assert len(out.splitlines()) == 2
