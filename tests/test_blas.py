"""OpenBLAS by default on Linux (monolith/blas.py): `python -m monolith.generate` re-executes
itself with an installed OpenBLAS preloaded and says so; MONOLITH_OPENBLAS=0 keeps the
bundled BLAS; the re-execution happens once, and only where a library is found."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from monolith import blas

needs_openblas = pytest.mark.skipif(not sys.platform.startswith("linux") or blas.find_openblas({}) is None,
                                    reason="no OpenBLAS installed (apt-get install libopenblas0-pthread)")


def generate(pack, tmp_path, *extra, **env):
    """`python -m monolith.generate` on the tiny pack, started with no BLAS preloaded."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS", blas.CHOICE, blas.MARKER)}
    proc = subprocess.run([sys.executable, "-m", "monolith.generate", "--model", str(pack), "--prompt-ids", "1,2,3",
                           "--max-tokens", "2", "--dtype", "float32", *extra], capture_output=True, text=True,
                          env={**clean, "MONOLITH_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", **env},
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc


@needs_openblas
def test_generate_runs_on_openblas_by_default_and_says_so(pack, tmp_path):
    doc = json.loads(generate(pack, tmp_path, "--json").stdout)
    assert "libopenblas" in doc["blas"]  # the child's own /proc/self/maps
    [line] = [line for line in generate(pack, tmp_path).stderr.splitlines() if line.startswith("BLAS: ")]
    assert line.startswith("BLAS: OpenBLAS (") and ", 1 thread)" in line


def test_the_opt_out_keeps_the_bundled_blas(pack, tmp_path):
    doc = json.loads(generate(pack, tmp_path, "--json", **{blas.CHOICE: "0"}).stdout)
    assert doc["blas"] == "bundled"
    stderr = generate(pack, tmp_path, **{blas.CHOICE: "0"}).stderr
    assert f"BLAS: MLX's bundled reference BLAS, about 30x slower F32 matrix products ({blas.CHOICE}=0)" in stderr


def test_the_command_is_re_executed_once_with_the_library_preloaded(monkeypatch, tmp_path):
    library = tmp_path / "libopenblas.so.0"
    library.write_bytes(b"")
    calls = []
    monkeypatch.setattr(blas, "loaded_openblas", lambda: None)
    monkeypatch.setattr(blas, "_tried", None)  # restored afterwards
    monkeypatch.setattr(blas, "candidates", lambda: [tmp_path / "missing.so", library])
    monkeypatch.setattr(sys, "platform", "linux")
    for name in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS", blas.CHOICE, blas.MARKER):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "libother.so")

    blas.preload_openblas(execve=lambda path, argv, env: calls.append((path, argv, env)))
    [(path, argv, env)] = calls
    assert path == sys.executable and argv == [sys.executable, *sys.orig_argv[1:]]
    assert env["LD_PRELOAD"] == f"{library}:libother.so" and env["OPENBLAS_NUM_THREADS"] == "1"
    assert env[blas.MARKER] == str(library)

    # the re-executed process: the marker stops a loop, and the line says the preload failed
    monkeypatch.setenv(blas.MARKER, str(library))
    blas.preload_openblas(execve=lambda *a: pytest.fail("re-executed twice"))
    assert blas.MARKER not in os.environ and f"preloading {library} did not load it" in blas.describe()

    monkeypatch.setenv(blas.CHOICE, "off")  # the opt-out
    blas.preload_openblas(execve=lambda *a: pytest.fail("opted out"))
    monkeypatch.delenv(blas.CHOICE)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")  # the user's thread count is kept
    blas.preload_openblas(execve=lambda path, argv, env: calls.append(env))
    assert calls[-1]["OPENBLAS_NUM_THREADS"] == "2"

    monkeypatch.setattr(blas, "candidates", lambda: [tmp_path / "missing.so"])  # none installed
    blas.preload_openblas(execve=lambda *a: pytest.fail("no library"))
    assert blas.describe().endswith("OpenBLAS is used when installed: sudo apt-get install libopenblas0-pthread")


def test_macos_is_left_alone(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(blas, "_tried", None)
    monkeypatch.delenv(blas.MARKER, raising=False)
    blas.preload_openblas(execve=lambda *a: pytest.fail("re-executed on macOS"))
    assert blas.describe() is None
