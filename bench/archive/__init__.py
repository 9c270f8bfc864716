"""Finished studies: their question is answered and their results are in
bench/archive/results/. They still run (`python -m bench.archive.NAME`) but nothing
checks them against the current code."""
