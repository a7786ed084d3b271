"""Imported once by the launcher's fork server (graphshard.tools.launch): settles Inductor's
per-process host checks there, so the ranks it forks inherit them instead of each rank
repeating them before its first compile (or its first load from the compile caches)."""

from graphshard import _torch_compat as compat

try:
    compat.settle_inductor_host_probes()
except Exception:  # noqa: BLE001 - an optimisation: a rank that needs the answer probes itself
    pass
