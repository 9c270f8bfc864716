"""Finished studies: their question is answered and their results are in
bench/archive/results/. They still run (`python -m bench.archive.NAME`; warm_cold with
PYTHONPATH=tests, its harness being the tests') but nothing checks them against the
current code. The grammar studies share vocabulary.py; one_decode_loop.md is a report
with no script of its own (live scripts run from two checkouts in alternation)."""
