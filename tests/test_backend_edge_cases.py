"""Backend edge cases found in review, checked on a 1-rank gloo group in this process (or on 2
local gloo processes where numerics need real collectives)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import graphshard
from graphshard.passes import meta_keys
from graphshard.tools.launch import run_local
from graphshard.passes.graph_utils import (
    ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, collective_params, is_reduce_grad, is_unshard,
)
from tests.capture import GraphCapture
from tests.workers import Training, reference, train

EAGER_PASSES = {"compiler": "eager"}


@pytest.fixture
def gloo1():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch.compiler.reset()
        dist.destroy_process_group()


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        y = self.lin(x)
        y.mul_(2)  # in-place ops in the Dynamo graph must survive our graph surgery
        self.steps.add_(1)
        return y.sum()


def test_in_place_ops_and_buffer_updates_survive_the_backend(gloo1):
    torch.manual_seed(0)
    model = graphshard.shard(InPlace())
    x = torch.randn(3, 4)
    expected = model(x)
    compiled = torch.compile(model, backend="graphshard", options=EAGER_PASSES, fullgraph=True)
    assert torch.allclose(compiled(x), expected)
    assert model.steps.item() == 2


class NoGradRead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            scale = self.lin.weight.abs().mean()
        return (self.lin(x) * scale).sum()


def test_a_no_grad_read_does_not_stand_in_for_a_read_that_needs_a_gradient(gloo1):
    torch.manual_seed(0)
    model = graphshard.shard(NoGradRead())
    x = torch.randn(3, 4)
    model(x).backward()
    expected = model.lin._parameters["weight"].grad.full_tensor().clone()
    model.zero_grad()
    torch.compile(model, backend="graphshard", options=EAGER_PASSES, fullgraph=True)(x).backward()
    grad = model.lin._parameters["weight"].grad
    assert grad is not None and torch.allclose(grad.full_tensor(), expected)


class AllCheckpointed(nn.Module):
    """Every parameter is read only inside one checkpointed region: the Dynamo graph has no
    marker outside the checkpoint body."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)  # 3 rows: uneven at world size 2
        self.out = nn.Linear(3, 4)

    def _body(self, x):
        return self.out(torch.tanh(self.lin(x)))

    def forward(self, x):
        return checkpoint(self._body, x, use_reentrant=False).square().mean()


CHECKPOINT_BATCH = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))


def _collectives(gm: fx.GraphModule) -> dict:
    """{kind: sorted parameter names} of a lowered graph's collectives, and the markers left."""
    kinds = {ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter", ALL_REDUCE: "all_reduce"}
    found = {kind: [] for kind in kinds.values()}
    found["markers"] = []
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                if node.target in kinds:
                    found[kinds[node.target]].extend(collective_params(node))
                elif is_unshard(node) or is_reduce_grad(node):
                    found["markers"].append(node.name)
    return {kind: sorted(names) for kind, names in found.items()}


def _checkpointed_step(rank: int, world: int):
    """One compiled forward+backward of AllCheckpointed on this rank's half of the batch: the
    Dynamo graph's markers per (sub)graph, the lowered graphs' collectives, the full grads."""
    torch.manual_seed(0)
    model = graphshard.shard(AllCheckpointed())
    # reshard_after_forward=True: every parameter is gathered again in backward (by default the
    # last one of forward would stay gathered, tests/test_reshard_policy.py).
    capture = GraphCapture({"reshard_after_forward": True}, stages=("lowered",), keep=_collectives)
    markers = {}

    def backend(gm, example_inputs):
        for name, module in gm.named_modules():
            if isinstance(module, fx.GraphModule):
                markers[name] = sum(is_unshard(n) for n in module.graph.nodes)
        return capture.backend(gm, example_inputs)

    per = CHECKPOINT_BATCH.shape[0] // world
    torch.compile(model, backend=backend, fullgraph=True)(
        CHECKPOINT_BATCH[rank * per:(rank + 1) * per]).backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return markers, {kind: found for (kind, _), found in capture.graphs.items()}, grads


def test_parameters_read_only_inside_a_checkpointed_region_still_go_through_the_pipeline():
    torch.manual_seed(0)
    reference = AllCheckpointed()
    reference(CHECKPOINT_BATCH).backward()
    names = sorted(name for name, _ in reference.named_parameters())
    for markers, lowered, grads in run_local(_checkpointed_step, 2):
        # The case under test: the top-level Dynamo graph reads no parameter, the checkpoint
        # body reads each one once.
        assert markers.pop("") == 0 and sum(markers.values()) == len(names), markers
        assert sorted(lowered) == ["backward", "forward"]  # the pipeline ran on both graphs
        # Lowered, no marker left: forward gathers every parameter once; backward recomputes
        # the whole region (its output too: square's gradient reads it), so gathers every
        # parameter again, and reduce-scatters every gradient once.
        assert lowered["forward"] == {"all_gather": names, "reduce_scatter": [],
                                      "all_reduce": [], "markers": []}
        assert lowered["backward"] == {"all_gather": names, "reduce_scatter": names,
                                       "all_reduce": [], "markers": []}
        for name, p in reference.named_parameters():
            assert torch.allclose(grads[name], p.grad, atol=1e-6), name


def test_a_parameter_added_after_shard_is_refused(gloo1):
    model = graphshard.shard(nn.Sequential(nn.Linear(4, 4)))
    model.add_module("adapter", nn.Linear(4, 4))
    compiled = torch.compile(model, backend="graphshard", options=EAGER_PASSES)
    with pytest.raises(Exception, match="not sharded.*added or replaced after graphshard.shard"):
        compiled(torch.randn(2, 4))


def test_an_unsharded_model_is_refused_in_a_job_of_several_ranks_and_runs_alone(fake_pg):
    """shard() forgotten: each rank would train its own copy, the copies drifting apart."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(2, 4)
    with pytest.raises(Exception, match=r"2 trainable parameter.*graphshard.shard has not sharded"
                                        r".*job of 8 ranks.*Call graphshard.shard\(model\)"):
        torch.compile(model[2], backend="graphshard", options=EAGER_PASSES)(x[:, :4])
    torch._dynamo.reset()
    # what trains nothing across ranks compiles as Inductor would (no gradients: under the
    # default compiler, Inductor), or runs as written (frozen: the graph-only compiler)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="graphshard")(x), model(x))
    torch._dynamo.reset()
    model.requires_grad_(False)
    torch.testing.assert_close(
        torch.compile(model, backend="graphshard", options=EAGER_PASSES)(x), model(x))
    torch._dynamo.reset()


def test_rnn_modules_use_the_sharded_parameters(gloo1):
    torch.manual_seed(0)
    reference = nn.LSTM(4, 6, batch_first=True)
    model = graphshard.shard(copy.deepcopy(reference))
    with torch.no_grad():  # change the sharded weights: the RNN must see the change
        for p in model.parameters():
            p.mul_(0.5)
        for p in reference.parameters():
            p.mul_(0.5)
    x = torch.randn(2, 3, 4)
    out, _ = model(x)
    expected, _ = reference(x)
    assert torch.allclose(out, expected, atol=1e-6)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


class _RNNHead(nn.Module):
    """A GRU and a 2-layer bidirectional LSTM (which Dynamo does not trace: they run eagerly
    inside the compiled model; the LSTM's CPU kernel takes its weights through GatheredWeight's
    dispatch) and a linear head (compiled); the GRU's 21-row weights shard unevenly at world
    size 2."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(5, 7, batch_first=True)
        self.lstm = nn.LSTM(7, 6, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        out, _ = self.gru(x)
        out, (h, _) = self.lstm(out)
        return self.head(out[:, -1]) + h.sum(0).sum(-1, keepdim=True)


RNN_BATCHES = (6, 6, 10)  # global batch per step: the size changes, so the frame recompiles


def _rnn_data(step):
    gen = torch.Generator().manual_seed(3)
    return ([torch.randn(b, 4, 5, generator=gen) for b in RNN_BATCHES][step],)


def _square_mean(out, x):
    return out.square().mean()


@pytest.mark.slow
def test_an_rnn_inside_a_compiled_model_trains_like_the_reference_across_batch_sizes():
    # Dynamo runs the RNNs eagerly; their parameter reads, and the LSTM kernel's dispatch on
    # the gathered weights, must run eagerly (not be compiled as frames of their own: the
    # reads recompiled with dynamic shard sizes and failed, the dispatch sent the CPU LSTM op
    # to Inductor, which failed on it).
    run = Training(model=_RNNHead, data=_rnn_data, loss=_square_mean, steps=len(RNN_BATCHES),
                   optimizer=functools.partial(torch.optim.SGD, lr=0.1), compile={},
                   fullgraph=False)  # default options: Inductor compiles the linear head
    expected = reference(run).params
    for [result] in run_local(train, 2, [run]):
        assert result.params.keys() == expected.keys()
        for name, value in result.params.items():
            assert torch.allclose(value, expected[name], atol=1e-5), name


class _ResidualMLP(nn.Module):
    """2-D activations with residual connections, one layer applied twice: in backward the
    gradient reaching each linear's input is summed with another, which Inductor compiles as
    addmm (its matmul moved to the add). The head's 5 rows shard unevenly at world size 2."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.out = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 5)

    def forward(self, x):
        h = torch.tanh(self.a(x)) + x
        h = torch.tanh(self.b(h)) + h
        h = torch.tanh(self.b(h)) + h
        return self.out(h)


def _mlp_data(step):
    return (torch.randn(8, 32, generator=torch.Generator().manual_seed(step)),)


@pytest.mark.slow  # an Inductor launch; the quick loop's Inductor numerics: checkpointing's
def test_a_residual_mlp_on_2d_activations_trains_like_the_reference():
    run = Training(model=_ResidualMLP, data=_mlp_data, loss=_square_mean, steps=2,
                   optimizer=functools.partial(torch.optim.SGD, lr=0.1), compile={})  # Inductor
    expected = reference(run).params
    for [result] in run_local(train, 2, [run]):
        for name, value in result.params.items():
            assert torch.allclose(value, expected[name], atol=1e-5), name


def _varying_batch_data(step):
    return (torch.randn((6, 10, 14)[step], 32, generator=torch.Generator().manual_seed(step)),)


@pytest.mark.slow
def test_dynamic_shapes_with_uneven_shards_train_like_the_reference_under_inductor():
    # dynamic=True: the batch is symbolic, the shards keep static shapes (a symbolic shard size
    # reached the collectives' padding on the short-shard rank); native transports, the NCCL path
    run = Training(model=_ResidualMLP, data=_varying_batch_data, loss=_square_mean, steps=3,
                   optimizer=functools.partial(torch.optim.SGD, lr=0.1), dynamic=True,
                   compile={"all_gather": "native", "reduce_scatter": "native"})
    expected = reference(run).params
    for [result] in run_local(train, 2, [run]):
        for name, value in result.params.items():
            assert torch.allclose(value, expected[name], atol=1e-5), name


def test_inductor_frees_collective_buffers_after_the_wait_and_the_last_reader(gloo1):
    """The graph frees a collective's buffers itself (a backend thread may still hold them after
    the wait): Inductor must keep each free where the pass put it, the send buffer's after the
    wait (nothing orders a free before the wait for Inductor but the graph's order), the
    received buffer's after the matmul that reads it through a clone Inductor drops as a no-op,
    and the result must not change."""
    from torch._inductor.utils import run_and_get_code
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphshard._torch_compat import inductor_compile_graph
    from graphshard.passes.free_collective_buffers import free_collective_buffers
    from graphshard.passes.graph_utils import ALL_TO_ALL, WAIT

    group = dist.group.WORLD.group_name

    def step(x, w):
        send = torch.cat([x, x + 1])  # allocated by the graph, as a transport's send buffer
        received = WAIT(ALL_TO_ALL(send, [16], [16], group))
        weight_copy = received.clone()  # Inductor drops the clone: the matmul reads `received`
        return ((weight_copy @ w).relu().sum(),)

    x, w = torch.randn(8, 32), torch.randn(32, 32)
    gm = make_fx(step, tracing_mode="fake")(x, w)
    for node in gm.graph.nodes:
        if node.target is ALL_TO_ALL:  # as the transport stage marks the all-to-all it emits
            node.meta[meta_keys.LOWERED_FROM] = "all_gather"
    gm = free_collective_buffers(gm)
    compiled, (code,) = run_and_get_code(lambda: inductor_compile_graph(gm, [x, w], "inference"))
    lines = [line.strip() for line in code[code.index("def call"):].splitlines()]
    wait = next(i for i, line in enumerate(lines) if "wait_tensor" in line)
    matmul = next(i for i, line in enumerate(lines) if "extern_kernels.mm(" in line)
    frees = [i for i, line in enumerate(lines) if "resize_storage_bytes_(" in line]
    assert len(frees) == 2 and wait < frees[0] < matmul < frees[1], "\n".join(lines)
    torch.testing.assert_close(compiled([x, w])[0], step(x, w)[0])


def test_a_buffer_read_by_a_matmul_that_inductor_fuses_into_an_add_is_freed_after_the_add(gloo1):
    """Inductor's post-grad patterns rewrite add(mm(a, w), b) as addmm(b, a, w), placed where the
    add was: a received buffer the matmul reads is read there, so it must be freed after the add.
    (Freed right after the matmul, an MLP with residual connections on 2-D activations fails in
    backward: "The tensor has a non-zero number of elements, but its data is not allocated
    yet".)"""
    from torch._inductor.utils import run_and_get_code
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphshard._torch_compat import inductor_compile_graph
    from graphshard.passes.free_collective_buffers import free_collective_buffers
    from graphshard.passes.graph_utils import ALL_TO_ALL, WAIT

    group = dist.group.WORLD.group_name

    def step(w, x, y, v):
        send = torch.cat([w, w + 1])  # allocated by the graph, as a transport's send buffer
        weight = WAIT(ALL_TO_ALL(send, [16], [16], group))
        return (((x @ weight) + y) @ v,)  # mm + add: one addmm once compiled

    w, x, y, v = torch.randn(8, 32), torch.randn(4, 16), torch.randn(4, 32), torch.randn(32, 8)
    gm = make_fx(step, tracing_mode="fake")(w, x, y, v)
    for node in gm.graph.nodes:
        if node.target is ALL_TO_ALL:
            node.meta[meta_keys.LOWERED_FROM] = "all_gather"
    gm = free_collective_buffers(gm)
    compiled, (code,) = run_and_get_code(
        lambda: inductor_compile_graph(gm, [w, x, y, v], "inference"))
    lines = [line.strip() for line in code[code.index("def call"):].splitlines()]
    addmm = next(i for i, line in enumerate(lines) if "extern_kernels.addmm(" in line)  # fused
    frees = [i for i, line in enumerate(lines) if "resize_storage_bytes_(" in line]
    assert len(frees) == 2 and frees[-1] > addmm, "\n".join(lines)
    torch.testing.assert_close(compiled([w, x, y, v])[0], step(w, x, y, v)[0])


def test_inductor_frees_each_buffer_at_its_last_use():
    """Inductor's buffer reuse keeps a dead buffer allocated until a later one of the same size
    takes it over; in our graphs that held a unit's collective buffers beside the next unit's
    (the memory model and the schedule assume a buffer is freed at its last use). A chain of
    matmuls whose first result dies long before a same-sized one is allocated: plain Inductor
    reuses it, graphshard's compile of the same graph does not."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import run_and_get_code
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphshard._torch_compat import inductor_compile_graph

    def chain(x, w1, w2, w3, w4):
        a = x @ w1  # 64 x 64: dies at b
        b = a @ w2  # 64 x 128
        c = b @ w3  # 64 x 64: may take a's buffer over
        return ((c @ w4).sum(),)

    inputs = [torch.randn(64, 64), torch.randn(64, 64), torch.randn(64, 128),
              torch.randn(128, 64), torch.randn(64, 8)]
    _, plain = run_and_get_code(lambda: compile_fx_inner(make_fx(chain)(*inputs), inputs))
    _, ours = run_and_get_code(
        lambda: inductor_compile_graph(make_fx(chain)(*inputs), inputs, "inference"))
    assert any("# reuse" in code for code in plain)  # the case exists
    assert not any("# reuse" in code for code in ours)
