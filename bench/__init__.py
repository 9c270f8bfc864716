"""Benchmarks and studies; run each from the repository root as `python -m bench.NAME`
(shared helpers: bench/common.py; finished studies: bench/archive/)."""
