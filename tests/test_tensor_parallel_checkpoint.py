"""Checkpoints of tensor-parallel models across layouts: saved at dp2 x tp2, resumed at dp4
without TP, at dp1 x tp2 and in one process, and the other way round; exported to
safetensors and loaded back with load_pretrained into a meta-built TP model.

Eager steps (checkpoints do not depend on the compiler; the compiled TP numerics are in
tests/test_tensor_parallel.py), a Hugging Face Llama, AdamW (its state is resharded too).
"""

from __future__ import annotations

import pytest
import torch

from graphshard.tools.launch import run_local
from tests.test_tensor_parallel import batch, build, loss_of

# every test here reads a multi-process launch of cold Inductor compiles
pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]


def _model(layout: tuple[int, int] | None, meta: bool = False):
    """A Llama at `layout` = (dp, tp) (tp 1: graphshard alone; None: unsharded)."""
    import graphshard
    from torch.distributed.device_mesh import init_device_mesh

    if meta:
        with torch.device("meta"):
            model = build("llama")
    else:
        model = build("llama")
    if layout is None:
        return model
    dp, tp = layout
    if tp == 1:
        return graphshard.shard(model)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    graphshard.parallelize(model, mesh["tp"])
    return graphshard.shard(model, mesh["dp"])


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full(model, optimizer) -> dict[str, torch.Tensor]:
    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()

    out = {f"param/{n}": whole(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        if p in optimizer.state:
            out[f"exp_avg/{n}"] = whole(optimizer.state[p]["exp_avg"])
    return out


def _train_and_save(layout, path: str, step: int) -> dict:
    import graphshard.checkpoint as ckpt

    model = _model(layout)
    optimizer = _adamw(model)
    loss_of(model, batch(step, 8).chunk(torch.distributed.get_world_size() // layout[1])[
        _dp_rank(layout)]).backward()
    optimizer.step()
    optimizer.zero_grad()
    ckpt.save(path, model, optimizer, step=step)
    return _full(model, optimizer)


def _dp_rank(layout) -> int:
    return torch.distributed.get_rank() // layout[1]


def _load(layout, path: str) -> dict:
    import graphshard.checkpoint as ckpt

    model = _model(layout)
    optimizer = _adamw(model)
    info = ckpt.load(path, model, optimizer)
    result = _full(model, optimizer)
    result["step"] = info.step
    return result


def world4(rank: int, world: int, root: str) -> dict:
    return {
        "saved-2x2": _train_and_save((2, 2), f"{root}/2x2", step=1),
        "saved-dp4": _train_and_save((4, 1), f"{root}/dp4", step=2),
        "2x2->dp4": _load((4, 1), f"{root}/2x2"),
        "dp4->2x2": _load((2, 2), f"{root}/dp4"),
    }


class Seeded(torch.nn.Module):
    """Two TP layers around a norm the plan leaves alone, and a buffer."""

    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = (torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                         torch.nn.Linear(16, 8))
        self.norm.weight.data.normal_()  # not LayerNorm's all-ones: a difference shows
        self.register_buffer("scale", torch.randn(8))


def _seeded_apart(rank: int, meta: bool) -> dict:
    """Each rank builds its own (differently seeded) model; shard() must leave every rank with
    rank 0's: the TP ranks too, for what the plan leaves replicated."""
    import graphshard
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(100 + rank)
    with torch.device("meta" if meta else "cpu"):
        model = Seeded()
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    graphshard.parallelize(model, mesh["tp"], {"up": "colwise", "down": "rowwise"})
    graphshard.shard(model, mesh["dp"])
    if meta:
        graphshard.materialize(model, init_fn=lambda m: m.reset_parameters()
                               if hasattr(m, "reset_parameters") else None)
        model.scale.copy_(torch.arange(8.0))  # a meta buffer: the init_fn's job
    result = {"local": {n: p.to_local().clone() for n, p in model.named_parameters()},
              "full": {n: p.full_tensor() for n, p in model.named_parameters()},
              "buffer": model.scale.clone()}
    with torch.no_grad():  # edits through the module's attributes reach the TP shards
        model.up.weight.zero_()
        model.down.weight[0].fill_(3.0)
        torch.nn.init.constant_(model.up.bias, 2.0)
    result["edited"] = {n: p.full_tensor() for n, p in model.named_parameters()}
    return result


def world2(rank: int, world: int, root: str) -> dict:
    import graphshard.checkpoint as ckpt

    results = {"seeded-apart": _seeded_apart(rank, meta=False),
               "seeded-apart-meta": _seeded_apart(rank, meta=True),"2x2->1x2": _load((1, 2), f"{root}/2x2"),
               "saved-1x2": _train_and_save((1, 2), f"{root}/1x2", step=3)}
    if rank == 0:
        ckpt.export(f"{root}/2x2", f"{root}/hf")
    torch.distributed.barrier()
    model = _model((1, 2), meta=True)
    ckpt.load_pretrained(model, f"{root}/hf")
    results["pretrained-1x2"] = {f"param/{n}": p.full_tensor()
                                 for n, p in model.named_parameters()}
    return results


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> tuple[dict, dict, str, list[dict]]:
    root = str(tmp_path_factory.mktemp("tp-checkpoints"))
    four = run_local(world4, 4, root, timeout_s=900)[0]
    two_ranks = run_local(world2, 2, root, timeout_s=900)
    return four, two_ranks[0], root, two_ranks


def _same(a: dict, b: dict, keys=None) -> None:
    keys = keys or [k for k in a if k != "step"]
    for key in keys:
        assert torch.equal(a[key], b[key]), key


def test_dp2_tp2_checkpoint_resumes_without_tp_and_back(layouts):
    four, _, _, _ = layouts
    _same(four["saved-2x2"], four["2x2->dp4"])
    assert four["2x2->dp4"]["step"] == 1
    _same(four["saved-dp4"], four["dp4->2x2"])
    assert any(k.startswith("exp_avg/") for k in four["saved-2x2"])


def test_dp2_tp2_checkpoint_resumes_at_dp1_tp2(layouts):
    four, two, _, _ = layouts
    _same(four["saved-2x2"], two["2x2->1x2"])


def test_tp_checkpoints_load_in_one_process(layouts):
    import graphshard.checkpoint as ckpt

    four, two, root, _ = layouts
    for name, saved in (("2x2", four["saved-2x2"]), ("1x2", two["saved-1x2"])):
        model = build("llama")
        optimizer = _adamw(model)
        ckpt.load(f"{root}/{name}", model, optimizer)
        _same(saved, _full(model, optimizer))


def test_tp_checkpoint_exports_and_loads_back_with_load_pretrained(layouts):
    four, two, _, _ = layouts
    params = [k for k in four["saved-2x2"] if k.startswith("param/")]
    _same(four["saved-2x2"], two["pretrained-1x2"], params)


def test_every_rank_starts_from_rank_0s_model_tp_ranks_too(layouts):
    """Ranks seeded apart: after shard() the TP ranks hold one model, rank 0's (real weights,
    and weights materialised from the meta device with rank 0's RNG)."""
    *_, ranks = layouts
    for name in ("seeded-apart", "seeded-apart-meta"):
        first, second = ranks[0][name], ranks[1][name]
        # what the plan leaves replicated over tp: the norm, the row-parallel bias, the buffer
        for param in ("norm.weight", "norm.bias", "down.bias"):
            assert torch.equal(first["local"][param], second["local"][param]), (name, param)
        assert torch.equal(first["buffer"], second["buffer"]), name
    torch.manual_seed(100)  # rank 0's seed: its model, built whole
    whole = Seeded()
    torch.manual_seed(100)  # and initialised from the meta device as materialize does
    with torch.device("meta"):
        materialised = Seeded()
    materialised.to_empty(device="cpu")
    for module in (materialised.up, materialised.norm, materialised.down):
        module.reset_parameters()
    for name, model in (("seeded-apart", whole), ("seeded-apart-meta", materialised)):
        for param, value in model.named_parameters():
            assert torch.equal(ranks[0][name]["full"][param], value.detach()), (name, param)


def test_in_place_edits_through_attributes_reach_tp_shards(layouts):
    *_, ranks = layouts
    before, after = ranks[0]["seeded-apart"]["full"], ranks[0]["seeded-apart"]["edited"]
    assert torch.equal(after["up.weight"], torch.zeros_like(before["up.weight"]))
    assert torch.equal(after["up.bias"], torch.full_like(before["up.bias"], 2.0))
    assert torch.equal(after["down.weight"][0], torch.full_like(before["down.weight"][0], 3.0))
    assert torch.equal(after["down.weight"][1:], before["down.weight"][1:])
