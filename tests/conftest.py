import os

import pytest
import torch.distributed as dist

# A private Inductor cache per test session keeps runs independent of the machine's cache.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "inductor"))


@pytest.fixture
def fake_pg(request):
    """A fake process group of the requested world size (default 8) in this one process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world_size = getattr(request, "param", 8)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield world_size
    finally:
        dist.destroy_process_group()
