"""The methods being compared: name -> setup(model, mesh) -> the module to train.

A setup function takes a fresh copy of the model (identical initial weights on every rank) and
a 1-D device mesh over all ranks (a tensor-parallel method: the 2-D (dp, tp) mesh, `--tp`
ranks per TP group, each group training one data-parallel slice of the batch), and returns
the callable to train; its `.parameters()` are
what the optimizer steps (local tensors for DDP, DTensor shards for the FSDP methods). The
training step itself is the harness's, the same for every method. A setup that cannot run here
(an optional package missing, graphshard not landed yet) raises `MethodUnavailable`; the harness
reports it and runs the others.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from graphshard.bench.workload import tensor_parallel_module, transformer_blocks
from graphshard.passes.units import named_blocks


class MethodUnavailable(RuntimeError):
    """The method cannot run in this environment; the message says why."""


SetupFn = Callable[[nn.Module, DeviceMesh], nn.Module]

_observed = False  # see compiles_observed


def _ignore_stages(graph_kind: str, stage: str, gm) -> None:
    """An observer that keeps nothing: it makes a compile observed (its passes run)."""


@contextlib.contextmanager
def compiles_observed() -> Iterator[None]:
    """graphshard set up inside compiles as observed (compile_cache.reuses_cache): its passes
    run, on one rank of the host where the ranks' graphs are alike, whose compiler reports the
    predicted peak (the profile's own run); elsewhere it compiles as a user's does (the timing
    launch's cold compile, the profile's warm one, served by the cache)."""
    global _observed
    _observed = True
    try:
        yield
    finally:
        _observed = False


@dataclass(frozen=True)
class Method:
    setup: SetupFn
    compiled: bool  # has a compile cost worth reporting (first-step time)
    description: str
    # Set up on the (dp, tp) mesh; its inputs are its data-parallel rank's slice of the batch.
    tensor_parallel: bool = False


def _ddp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, process_group=mesh.get_group())


def _fsdp2(model: nn.Module, mesh: DeviceMesh, compile_blocks: bool = False,
           mp_policy=None) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy or MixedPrecisionPolicy()

    if compile_blocks:
        # torchtitan's recipe: compile each block whole (fullgraph) and wrap the compiled
        # block, so FSDP2's hooks stay outside the graphs. Compiling the whole model instead
        # graph-breaks on the hooks inside the block loop and Dynamo then skips the model's
        # forward frame, for every later method too.
        for name, block in named_blocks(model).items():
            model.set_submodule(name, torch.compile(block, fullgraph=True))
    # Per block, then the root (embeddings, final norm, output): the usual FSDP2 wrapping.
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    return fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def _fsdp2_compiled(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    return _fsdp2(model, mesh, compile_blocks=True)


def _parallelized(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """`model` with its own TP plan applied on mesh["tp"] (graphshard.parallelize)."""
    import graphshard
    from graphshard.tensor_parallel_plan import model_tp_plan

    inner = tensor_parallel_module(model)
    if not model_tp_plan(inner):
        raise MethodUnavailable("the model has no TP plan")
    graphshard.parallelize(inner, mesh["tp"])
    return model


def _fsdp2_tp(compile_blocks: bool) -> SetupFn:
    # FSDP2 + TP as torch documents it: parallelize on "tp", then fully_shard on "dp".
    def setup(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return _fsdp2(_parallelized(model, mesh), mesh["dp"], compile_blocks)

    return setup


def _float8(model: nn.Module) -> nn.Module:
    """torchao's float8 training with float8 all-gather on the Linears whose widths divide by
    16 (torchao's tensorwise recipe), as docs/float8.md converts a model."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise MethodUnavailable(f"torchao not importable ({exc}): pip install -e '.[float8]'") from exc
    convert_to_float8_training(
        model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
        module_filter_fn=lambda module, fqn: (module.in_features % 16 == 0
                                              and module.out_features % 16 == 0))
    if not any(type(m).__name__ == "Float8Linear" for m in model.modules()):
        raise MethodUnavailable("no Linear of this model has widths divisible by 16")
    return model


BF16_PARAMS = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}


def _fsdp2_float8(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """FSDP2 + torchao as torchao documents it: bf16 parameters, fp32 reduction, and the
    weights' float8 scales precomputed after each optimizer step."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    module = _fsdp2(_float8(model), mesh, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    module.after_optimizer_step = lambda: precompute_float8_dynamic_scale_for_fsdp(module)
    return module


def _simple_fsdp(mode: str) -> SetupFn:
    def setup(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        from graphshard.bench import torchtitan_simple_fsdp as titan

        try:
            titan.torchtitan_modules()
        except titan.TorchtitanUnavailable as exc:
            raise MethodUnavailable(str(exc)) from exc
        return titan.simple_fsdp(model, mesh, mode)

    return setup


def _graphshard_backend() -> object:
    """The backend name if its entry point is registered, else the entry point's target."""
    if "graphshard" in torch.compiler.list_backends():
        return "graphshard"
    try:
        from graphshard.compiler.backend import graphshard_backend
    except ImportError as exc:
        raise MethodUnavailable(f"graphshard backend not importable ({exc})") from exc
    return graphshard_backend


def _graphshard_shard(model: nn.Module, mesh: DeviceMesh, **shard_kwargs) -> nn.Module:
    try:
        import graphshard

        shard = graphshard.shard
    except (ImportError, AttributeError) as exc:
        raise MethodUnavailable(f"graphshard.shard not importable ({exc})") from exc
    return shard(model, mesh, **shard_kwargs)


def _compiled(setup: SetupFn, **compile_kwargs) -> SetupFn:
    def setup_and_compile(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return torch.compile(setup(model, mesh), **compile_kwargs)

    return setup_and_compile


def _graphshard_compiled(options: dict | None, shard_kwargs: dict | None = None,
                         activation_checkpointing: str = "none",
                         tensor_parallel: bool = False, float8: bool = False) -> SetupFn:
    def setup(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        import graphshard

        if float8:
            model = _float8(model)
        graphshard.apply_activation_checkpointing(model, activation_checkpointing)
        if tensor_parallel:
            model, mesh = _parallelized(model, mesh), mesh["dp"]
        sharded = _graphshard_shard(model, mesh, **(shard_kwargs or {}))
        _graphshard_backend()  # the entry point resolves (MethodUnavailable if not)
        from graphshard.compiler.backend import GraphshardCompiler
        from graphshard.compiler.options import GraphshardOptions

        # The backend object itself, not its name: the bench reads its predicted peak, which
        # a compile served from AOTAutograd's cache would not compute (compiles_observed).
        compiler = GraphshardCompiler(GraphshardOptions.from_dict(options),
                                      _ignore_stages if _observed else None, aot_cache=True)
        # fullgraph with TP: a graph break would leave the TP plan's DTensor ops eager.
        compiled = torch.compile(sharded, backend=compiler, fullgraph=tensor_parallel)
        compiled.graphshard_compiler = compiler
        return compiled

    return setup


def _alone(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    return model


def _collectives_only(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    from graphshard.bench.collectives_only import CollectivesOnly

    return CollectivesOnly(model, mesh)


METHODS: dict[str, Method] = {
    # A floor, not a way to train: each rank steps its own unsharded copy, no communication.
    "compute_only": Method(_compiled(_alone), True,
                           "no communication: each rank's unsharded model compiled (Inductor)"),
    # The other floor: graphshard's step's collectives replayed alone, no compute.
    "collectives_only": Method(_collectives_only, True,
                               "graphshard's collectives alone (recorded at its first step), no compute"),
    "ddp_eager": Method(_ddp, False, "DDP, eager"),
    "ddp_compile": Method(_compiled(_ddp), True, "torch.compile(DDP(model)), Inductor"),
    "fsdp2_eager": Method(_fsdp2, False, "FSDP2 fully_shard per block + root, eager"),
    "fsdp2_compile": Method(_fsdp2_compiled, True, "FSDP2 per block + root, blocks compiled (Inductor)"),
    # torchtitan's own SimpleFSDP (bench/torchtitan_simple_fsdp.py): whole model compiled
    # (fullgraph: a graph break would silently make the peer piecewise-compiled) with its
    # transformer-block bucketing and reordering.
    "simplefsdp_full": Method(_simple_fsdp("fully_shard"), True,
                              "torchtitan SimpleFSDP fully_shard, compiled (Inductor) + its passes"),
    "simplefsdp_hybrid": Method(_simple_fsdp("hybrid_shard"), True,
                                "torchtitan SimpleFSDP hybrid_shard (2 replicas), compiled + its passes"),
    "graphshard": Method(_graphshard_compiled(None), True, "graphshard.shard + backend='graphshard'"),
    "graphshard_nopasses": Method(
        _graphshard_compiled({"bucket_mb": 0, "reorder": False}), True,
        "graphshard with bucketing and reordering off",
    ),
    # Float8 (torchao, the float8 extra): asked for by name.
    "graphshard_bf16": Method(_graphshard_compiled(None, BF16_PARAMS), True,
                              "graphshard, bf16 parameters, fp32 reduction"),
    "graphshard_float8": Method(_graphshard_compiled(None, BF16_PARAMS, float8=True), True,
                                "torchao float8 Linears gathered in float8 + graphshard (bf16 params)"),
    "fsdp2_float8": Method(_fsdp2_float8, False,
                           "torchao float8 Linears + FSDP2 per block + root, float8 all-gather, "
                           "bf16 params, eager"),
    # Tensor parallelism on a (world / --tp, --tp) mesh: the model's own TP plan on "tp"
    # (graphshard.parallelize), then each method's data parallelism on "dp".
    "graphshard_tp": Method(_graphshard_compiled(None, tensor_parallel=True), True,
                            "graphshard.parallelize on tp + graphshard.shard on dp, fullgraph",
                            tensor_parallel=True),
    "fsdp2_tp": Method(_fsdp2_tp(compile_blocks=False), False,
                       "graphshard.parallelize on tp + FSDP2 per block + root on dp, eager",
                       tensor_parallel=True),
    "fsdp2_tp_compile": Method(_fsdp2_tp(compile_blocks=True), True,
                               "as fsdp2_tp, blocks compiled (Inductor) before fully_shard",
                               tensor_parallel=True),
}

# Ratios in the table are against these two.
BASELINES = ("fsdp2_eager", "ddp_eager")
# The default run is the data-parallel peer table; the TP and float8 methods are asked for by
# name.
DEFAULT_METHODS = tuple(name for name, m in METHODS.items()
                        if name not in ("compute_only", "collectives_only", "graphshard_bf16",
                                        "graphshard_float8", "fsdp2_float8")
                        and not m.tensor_parallel)


# Keys of a graphshard variant that are not backend options.
SHARD_KEYS = ("strategy", "param_dtype", "reduce_dtype")
AC_KEY = "ac"  # graphshard.apply_activation_checkpointing's mode
FLOAT8_KEY = "float8"  # true: torchao's float8 Linears first, as graphshard_float8
TP_KEY = "tp"  # true: the model's TP plan on the mesh's "tp" dim first, as graphshard_tp


def method(name: str) -> Method:
    """A registered method, or a graphshard variant spelled `graphshard:KEY=VALUE+KEY=VALUE`:
    backend options (`graphshard:reorder=false+bucket_mb=0`), graphshard.shard's strategy,
    param_dtype and reduce_dtype, `ac` (none, full, selective), `float8` (true: torchao's
    float8 Linears, as graphshard_float8) and `tp` (true: tensor parallelism on the
    (world / --tp, --tp) mesh, as graphshard_tp)."""
    if name in METHODS:
        return METHODS[name]
    base, sep, spec = name.partition(":")
    if base == "graphshard" and sep:
        from graphshard.compiler.options import parse_option_strings

        pairs = dict(pair.partition("=")[::2] for pair in spec.split("+"))
        shard_kwargs = {k: pairs.pop(k) for k in SHARD_KEYS if k in pairs}
        ac = pairs.pop(AC_KEY, "none")
        float8, tp = (pairs.pop(key, "false").lower() in ("true", "1")
                      for key in (FLOAT8_KEY, TP_KEY))
        options = parse_option_strings([f"{k}={v}" for k, v in pairs.items()])
        return Method(_graphshard_compiled(options, shard_kwargs, ac, tensor_parallel=tp,
                                           float8=float8), True,
                      f"graphshard with {shard_kwargs | {'ac': ac, 'float8': float8, 'tp': tp} | options}",
                      tensor_parallel=tp)
    raise KeyError(name)
