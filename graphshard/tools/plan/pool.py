"""Processes for the captures: each is single-threaded Python, so one per core."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def capture_pool(workers: int):
    """An executor with `map`: a spawn process pool of `workers`, or this process for one."""
    if workers <= 1:
        yield _InProcess()
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


class _InProcess:
    @staticmethod
    def map(fn, jobs):
        return map(fn, jobs)
