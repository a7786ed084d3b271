"""Benchmarks of graphshard against its peers: `python -m graphshard.bench --help`."""
