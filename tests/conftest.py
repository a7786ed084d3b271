import os

import pytest
import torch.distributed as dist

# The suite compiles into its own Inductor cache (.cache/inductor), not the machine's.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "inductor"))


from graphshard.tools import launch  # noqa: E402  (after the cache directory is chosen)

# A run whose rank a signal killed is relaunched once, with a warning carrying the crash report:
# a gloo rank has aborted in native code, with no Python frame to show, about once in several
# suite runs; a crash that recurs on the relaunch fails the test.
launch.RELAUNCHES_AFTER_A_SIGNAL = 1


@pytest.fixture
def fake_pg(request):
    """A fake process group of the requested world size (default 8) in this one process."""
    from graphshard._torch_compat import init_fake_process_group

    world_size = getattr(request, "param", 8)
    init_fake_process_group(world_size)
    try:
        yield world_size
    finally:
        dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    """Modules with slow tests first: under `-n 2` (pytest-xdist, one module per worker at a
    time) the long multi-process modules start early and the short ones fill in around them,
    instead of one long module running alone at the end."""
    slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in slow_modules)
