"""Full garbage collections paused while a compile builds its graphs.

A compile allocates hundreds of thousands of long-lived objects (FX nodes, fake tensors, sympy
expressions), and each time the survivors grow by a quarter CPython runs a full collection that
walks every object in the process: in a 35 s `graphshard dump` of a 32-block model, 13 full
collections took about 4 s of the collector's 5. Young collections still run, so short-lived
cycles are freed as usual; full collections come back when the compile ends. Paused around
graphshard's backend (AOTAutograd, the passes, Inductor) and, in dump and plan, around the whole
capture (Dynamo's trace too).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

# gen-1 collections between full ones (CPython's third threshold): more than a compile makes
_NO_FULL_COLLECTION = 1 << 30
_lock = threading.Lock()
_depth = 0  # pauses in effect (nested, or compiles on several threads)
_thresholds_before: tuple[int, int, int] = (0, 0, 0)


@contextlib.contextmanager
def full_collections_paused() -> Iterator[None]:
    """Within: no full (oldest-generation) collection. After the last pause in effect ends,
    in whatever order pauses on several threads end: the thresholds as they were."""
    global _depth, _thresholds_before
    with _lock:
        if _depth == 0:
            _thresholds_before = young, middle, full = gc.get_threshold()
            gc.set_threshold(young, middle, max(full, _NO_FULL_COLLECTION))
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.set_threshold(*_thresholds_before)
