"""Benchmarks: `asyncrl bench NAME ...` (asyncrl/bench/main.py). Each prints its figures as
one JSON object on its last line and compares against its baseline in the same run."""
