import os

import pytest
import torch.distributed as dist

# A private Inductor cache per test session keeps runs independent of the machine's cache.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "inductor"))


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
