"""Benchmarks of graphshard against its peers: `python -m bench --help`."""
