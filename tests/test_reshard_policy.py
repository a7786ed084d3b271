"""reshard_after_forward per unit, under a memory budget: which backward gathers disappear
(graphs at world size 8, fake process group), the budget kept by the predicted peak, bad
options, and numerics under Inductor on gloo against a single process."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json

import pytest
import torch

from graphshard import _torch_compat as compat
from graphshard.compiler.backend import GraphshardCompiler
from graphshard.compiler.options import GraphshardOptions
from graphshard.compiler.partition import _keeping_costs_peak_memory
from graphshard.compiler.pipeline import run_pipeline
from graphshard.passes.graph_utils import is_unshard
from graphshard.passes.keep_gathered import keep_gathered
from graphshard.passes.markers import UnshardSpec
from graphshard.passes.reshard_policy import params_to_keep
from graphshard.passes.units import unit_of
from graphshard.tools import dump
from graphshard.tools.launch import run_local
from tests.workers import Training, gpt_data, reference, train
from tests.zoo import TinyGPT, zoo_loss

# 4 blocks (units layers.0..3 of about 1 MiB gathered each), output projection last.
MODEL = ["transformer", "--model-args", "n_layers=4,dim=128", "--batch", "2", "--seq", "32",
         "--world-size", "8", "--quiet"]
LAYERS = [f"layers.{i}" for i in range(4)]


def _dump(tmp_path, *options: str, model: list[str] = MODEL) -> dict:
    out = tmp_path / "dump.json"
    argv = [*model, "--json", str(out)]
    for option in options:
        argv += ["--option", option]
    assert dump.main(argv) == 0
    return json.loads(out.read_text())


def _regathered(report: dict) -> set[str]:
    """Units (repeated blocks, else modules) whose parameters backward gathers again."""
    names = {p for c in report["collectives"] if c["graph"] == "backward" and c["op"] == "all_gather"
             for p in c["params"]}
    return {unit_of(name) for name in names}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    """One dump per option value, shared by the assertions below."""
    tmp = tmp_path_factory.mktemp("reshard")
    values = {"default": (), "true": ("reshard_after_forward=true",),
              "false": ("reshard_after_forward=false",),
              "pattern": ('reshard_after_forward={"layers.*": false, "layers.0": true}',),
              "last_block_resharded": ('reshard_after_forward={"layers.3": true}',)}
    result = {name: _dump(tmp, *options) for name, options in values.items()}
    resharded, kept = (result[k]["estimate"]["peak_memory_bytes"] / 2**20 for k in ("true", "false"))
    result["budgets"] = {}
    # From "nothing fits" (below the peak with every unit resharded) to "everything fits".
    for fraction in (-0.2, 0.35, 0.7, 1.0):
        budget = resharded + fraction * (kept - resharded) + 0.01
        result["budgets"][budget] = _dump(tmp, "reshard_after_forward=auto", f"memory_budget_mb={budget}")
    return result


def test_default_keeps_the_tail_of_forward_at_no_cost_in_peak_memory(reports):
    # full_shard: the last block, the final norm and the output projection, which backward
    # needs first, stay gathered; every other block is gathered again in backward.
    assert _regathered(reports["default"]) == {*LAYERS[:-1]}
    assert _regathered(reports["true"]) == {*LAYERS, "norm", "output"}
    assert _regathered(reports["false"]) == set()
    # Keeping the last block saves its backward gather and costs no predicted peak memory.
    resharded = reports["last_block_resharded"]
    assert _regathered(resharded) == {*LAYERS}
    assert reports["default"]["estimate"]["peak_memory_bytes"] <= resharded["estimate"]["peak_memory_bytes"]
    assert reports["default"]["estimate"]["comm_bytes"] < resharded["estimate"]["comm_bytes"]


def test_default_reshards_the_last_block_where_keeping_it_would_raise_the_peak(tmp_path):
    # Llama-3-8B's shapes (2 blocks, bf16, seq 4096, world size 8): its 128k-token vocabulary
    # puts the step's peak in the output projection's backward (the logits and their
    # gradient), before the scheduler would gather the last block again: kept, the block's
    # weights would sit there too (+0.4 GiB predicted). The default gathers it again; the
    # output projection, still gathered when forward ends, stays kept.
    model = ["llama3-8b", "--model-args", "n_layers=2", "--seq", "4096", "--batch", "1",
             "--param-dtype", "bf16", "--reduce-dtype", "fp32", "--world-size", "8", "--quiet"]
    default = _dump(tmp_path, model=model)
    kept = _dump(tmp_path, 'reshard_after_forward={"layers.1": false, "norm": false}', model=model)
    assert _regathered(default) == {"layers.0", "layers.1", "norm"}
    assert _regathered(kept) == {"layers.0"}
    assert kept["estimate"]["peak_memory_bytes"] > default["estimate"]["peak_memory_bytes"]


def test_default_tail_of_a_tied_hugging_face_model(tmp_path):
    # GPT-2 (transformers, 2 blocks): lm_head is the token embedding (wte), which forward uses
    # first and last. Kept: the last block, ln_f and wte; the first block is gathered again.
    # (Forward here means what the loss needs: the joint graph places the weight transposes
    # that only backward uses anywhere.)
    def dump_gpt2(*options: str) -> dict:
        out = tmp_path / f"gpt2{len(options)}.json"
        argv = ["tests.dump_targets.zoo:causal_lm", "--model-args", "name=gpt2", "--no-meta",
                "--world-size", "8", "--quiet", "--json", str(out)]
        for option in options:
            argv += ["--option", option]
        assert dump.main(argv) == 0
        return json.loads(out.read_text())

    default = dump_gpt2()
    resharded = dump_gpt2('reshard_after_forward={"transformer.h.1": true}')
    assert _regathered(default) == {"transformer.h.0"}
    assert _regathered(resharded) == {"transformer.h.0", "transformer.h.1"}
    assert default["estimate"]["peak_memory_bytes"] <= resharded["estimate"]["peak_memory_bytes"]


def test_a_pattern_mapping_decides_per_unit_deepest_match_wins(reports):
    assert _regathered(reports["pattern"]) == {"layers.0"}  # norm: the default tail


def test_keeping_units_trades_memory_for_communication(reports):
    true, false = reports["true"]["estimate"], reports["false"]["estimate"]
    assert false["peak_memory_bytes"] > true["peak_memory_bytes"]
    assert false["comm_bytes"] < true["comm_bytes"] and false["step_s"] < true["step_s"]


def test_auto_keeps_the_most_units_the_budget_allows(reports):
    kept_counts = []
    for budget, report in sorted(reports["budgets"].items()):
        peak = report["estimate"]["peak_memory_bytes"] / 2**20
        kept = [layer for layer in LAYERS if layer not in _regathered(report)]
        kept_counts.append(len(kept))
        if budget >= reports["default"]["estimate"]["peak_memory_bytes"] / 2**20:
            assert peak <= budget, (budget, peak, kept)
        # Ties go to the units backward gathers first: the last blocks of forward.
        assert kept == LAYERS[len(LAYERS) - len(kept):], kept
    assert kept_counts[0] == 0 and kept_counts[-1] == len(LAYERS), kept_counts
    assert kept_counts == sorted(kept_counts) and len(set(kept_counts)) >= 3, kept_counts


@pytest.mark.parametrize("options, message", [
    ({"reshard_after_forward": "auto"}, "memory_budget_mb"),
    ({"memory_budget_mb": 100}, "memory_budget_mb goes with"),
    ({"reshard_after_forward": {"layers.*": "no"}}, "mapping from module-name patterns to bools"),
    ({"reshard_after_forward": "sometimes"}, "reshard_after_forward must be"),
])
def test_bad_reshard_options_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        GraphshardOptions.from_dict(options)


@pytest.mark.slow
def test_reshard_options_match_a_single_process_under_inductor(tmp_path):
    """World size 2, Inductor, gloo: keeping all, some (pattern, with activation checkpointing)
    or the budget's choice of units gathered (with gradient accumulation and the native
    transports), or the default's tail through the partition derived to keep it (native
    transports), changes no number."""
    base = Training(model=functools.partial(TinyGPT, "none", n_blocks=3),
                    data=functools.partial(gpt_data, batch=8), loss=zoo_loss,
                    optimizer=functools.partial(torch.optim.SGD, lr=0.05), steps=2)
    runs = [
        dataclasses.replace(base, compile={"reshard_after_forward": False}),
        dataclasses.replace(base, model=functools.partial(TinyGPT, "full", n_blocks=3),
                            compile={"reshard_after_forward": {"blocks.*": False, "blocks.1": True}}),
        # the native transports (what NCCL users run); the runs above take gloo's all-to-all
        dataclasses.replace(base, compile={"reshard_after_forward": "auto", "memory_budget_mb": 64,
                                           "all_gather": "native", "reduce_scatter": "native"},
                            micro_batches=2),
    ]
    default = dataclasses.replace(base, compile={"all_gather": "native", "reduce_scatter": "native"})
    runs.append(default)  # the default keeps the tail: its partition derived (keep_gathered)
    results = run_local(_train_recording_partitions, 2, runs, str(tmp_path / "inductor"))
    # the rank that compiled the default run's training graph (the other loaded it) compiled
    # the derived pair
    default_options = GraphshardOptions.from_dict(default.compile)
    partitions = [derived for r in results for options, derived in r["partitions"]
                  if options == default_options]
    assert partitions == [True], [r["partitions"] for r in results]
    for run, per_rank in zip(runs, zip(*(r["results"] for r in results))):
        ref = reference(run)
        for result in per_rank:
            assert max(abs(a - b) for a, b in zip(result.losses, ref.losses)) < 1e-5, run.compile
            for name, value in ref.params.items():
                assert torch.allclose(result.params[name], value, atol=1e-5), (run.compile, name)


def _train_recording_partitions(rank: int, world: int, runs: list[Training], cache: str) -> dict:
    """`train`, recording for each partition its options and whether it returned the pair
    keep_gathered derived. A cache directory of the test's own, empty at the start: one rank
    compiles each graph, whatever an earlier run left in the suite's cache."""
    import os

    from graphshard.compiler import backend
    from graphshard.compiler import partition as partition_module

    derived, partitions = [], []
    original_keep_gathered, original_partition = partition_module.keep_gathered, backend.partition

    def keep_gathered_recorded(*args):
        derived.append(original_keep_gathered(*args))
        return derived[-1]

    def partition_recorded(compiler, *args, **kwargs):
        pair = original_partition(compiler, *args, **kwargs)
        partitions.append((compiler.options, bool(derived) and pair is derived[-1]))
        return pair

    partition_module.keep_gathered = keep_gathered_recorded
    backend.partition = partition_recorded
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    return {"results": train(rank, world, runs), "partitions": partitions}


class _Partitions(GraphshardCompiler):
    """graphshard's partition of a capture's joint graph (nothing runs after it), counting
    Inductor's min-cut partitions; keeps the joint graph, its arguments and the pair returned."""

    def __init__(self, monkeypatch):
        super().__init__(GraphshardOptions(compiler="eager"))
        self.min_cuts, self.min_cut = 0, compat.inductor_partition

        def counted(*args, **kwargs):
            self.min_cuts += 1
            return self.min_cut(*args, **kwargs)

        monkeypatch.setattr(compat, "inductor_partition", counted)

    def partition(self, joint, joint_inputs, **kwargs):
        from graphshard.tools.dump.capture import CaptureComplete

        self.joint, self.joint_inputs, self.kwargs = copy.deepcopy(joint), joint_inputs, kwargs
        self.result = super().partition(joint, joint_inputs, **kwargs)
        raise CaptureComplete()

    def min_cut_of(self, **context):
        """Inductor's min-cut partition of the kept joint graph, tagged under `context`."""
        ctx = dataclasses.replace(self.context("joint"), **context)
        return self.min_cut(run_pipeline(copy.deepcopy(self.joint), ctx), self.joint_inputs,
                            **self.kwargs)


def _tail_partitions(monkeypatch, target: str, model_args: dict, seq: int, **dtypes):
    from graphshard.tools.dump.loading import load_workload, sharded_on_fake_cluster
    from graphshard.tools.plan.capture import _run

    compiler = _Partitions(monkeypatch)
    workload = load_workload(target, batch=1, seq_len=seq, model_args=model_args)
    with sharded_on_fake_cluster(workload, 8, "full_shard", **dtypes):
        _run(workload, compiler)
        tail = params_to_keep(compiler.joint, None) - params_to_keep(compiler.joint, None,
                                                                     keep_tail=False)
        kept_by_min_cut = compiler.min_cut_of(keep_tail=True)
        resharded = compiler.min_cut_of(keep_tail=False)
        derived = keep_gathered(*resharded, tail)
    return compiler, tail, resharded, kept_by_min_cut, derived


def _regathered_params(backward) -> set[str]:
    return {UnshardSpec.from_node(n).name for n in backward.graph.nodes if is_unshard(n)}


def _saved_gathered(forward) -> set[str]:
    return {UnshardSpec.from_node(n).name for n in forward.graph.output_node().args[0]
            if isinstance(n, torch.fx.Node) and is_unshard(n)}


@pytest.mark.parametrize("target, model_args, seq, dtypes, tail_kept", [
    ("transformer", {"n_layers": 4, "dim": 128}, 32, {}, True),
    ("llama3-8b", {"n_layers": 2}, 4096, {"param_dtype": "bf16", "reduce_dtype": "fp32"}, False),
], ids=["tail-kept", "tail-resharded"])
def test_the_tail_decision_partitions_once_and_derives_the_kept_partition(
        monkeypatch, target, model_args, seq, dtypes, tail_kept):
    # One min-cut partition per training graph (seconds on a large model): the partition that
    # keeps the tail is derived from the one that reshards it. It saves the tail's gathered
    # weights and gathers none of them again, as the min-cut partition that keeps them does,
    # and the peak check decides alike on both.
    compiler, tail, resharded, by_min_cut, derived = _tail_partitions(
        monkeypatch, target, model_args, seq, **dtypes)
    assert compiler.min_cuts == 1
    assert tail and derived is not None
    forward, backward = derived
    assert _regathered_params(resharded[1]) & tail  # what there is to keep
    assert not _regathered_params(backward) & tail
    assert _regathered_params(backward) == _regathered_params(by_min_cut[1])
    assert _saved_gathered(forward) >= _regathered_params(resharded[1]) & tail
    decide = functools.partial(_keeping_costs_peak_memory, compiler, compiler.joint, params=tail)
    assert decide(*derived) == decide(*by_min_cut) == (not tail_kept)
    chosen_forward, chosen_backward = compiler.result
    assert (not _regathered_params(chosen_backward) & tail) == tail_kept
