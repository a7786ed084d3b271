"""The backend is found by name in a fresh interpreter, and leaves unsharded models to Inductor."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = r"""
import sys, torch
assert "graphshard" not in sys.modules
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
x = torch.randn(4, 8)
compiled = torch.compile(model, backend="graphshard", fullgraph=True)
out = compiled(x)
torch.testing.assert_close(out, model(x))
out.sum().backward()
from torch._dynamo.utils import counters
assert "graphshard" in sys.modules
# an unsharded model goes to Inductor unchanged: the compiled graph is Inductor's output code
assert counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"] >= 1, dict(counters["inductor"])
print("ok")
"""


@pytest.mark.slow  # a fresh interpreter's compile
def test_backend_entry_point_in_fresh_interpreter_compiles_unsharded_model_like_inductor(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
