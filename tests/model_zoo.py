"""A zoo of real architectures built from tiny configs (random init, no downloads), and the
per-rank worker that trains each of them under graphshard for tests/test_model_zoo.py.

Every entry builds its model with a fixed seed (2 layers, hidden 32, vocab 64, dropout 0), a
global batch of 4 rows (every tensor's dim 0 is the batch) and a loss on the model's logits.
All of them compile with fullgraph=True.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, GLOBAL_BATCH, HIDDEN = 64, 8, 4, 32
LAYERS = 2
STEPS = 3
LR, EPS = 1e-2, 1e-4  # AdamW (fp32 runs)
SGD_LR = 0.5  # SGD (bf16 runs)
Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ZooModel:
    name: str
    build: Callable[[], nn.Module]  # seeded: every call returns the same weights
    batch: Callable[[], tuple[Batch, torch.Tensor]]  # (forward kwargs, targets), global batch
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> mean loss
    # BatchNorm normalises with each rank's own batch statistics (DDP without SyncBatchNorm):
    # the reference runs one forward per rank slice, each with that rank's buffers.
    per_rank_forward: bool = False


def logits_of(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def slice_rows(batch: Any, rank: int, world: int) -> Any:
    """This rank's rows of a tensor or of every tensor in a dict (dim 0 is the batch)."""
    if isinstance(batch, dict):
        return {k: slice_rows(v, rank, world) for k, v in batch.items()}
    per = batch.shape[0] // world
    return batch[rank * per:(rank + 1) * per]


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def seeded() -> nn.Module:
        torch.manual_seed(0)
        return build()

    return seeded


def _gen(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def causal_lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over labelled tokens (-100 is ignored)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=-100)


def class_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=_gen())


def _causal_batch() -> tuple[Batch, torch.Tensor]:
    tokens = _tokens()
    return {"input_ids": tokens}, tokens


# --------------------------------------------------------------------------- Hugging Face


def _hf_common() -> dict:
    return dict(vocab_size=VOCAB, attn_implementation="sdpa", use_cache=False)


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_positions=2 * SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0, **_hf_common())
    return GPT2LMHeadModel(config)  # lm_head tied to wte


def _llama(tied: bool) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                             num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=2 * SEQ, tie_word_embeddings=tied,
                             **_hf_common())
        return LlamaForCausalLM(config)

    return build


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                        intermediate_size=2 * HIDDEN, max_position_embeddings=2 * SEQ,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        **_hf_common())
    return BertForMaskedLM(config)  # decoder tied to the word embeddings


MASK_ID = 3


def _bert_batch() -> tuple[Batch, torch.Tensor]:
    tokens = _tokens()
    # Two masked positions in every row, so each rank's mean is over as many tokens.
    masked = torch.argsort(torch.rand(GLOBAL_BATCH, SEQ - 1, generator=_gen(2)), dim=1)[:, :2] + 1
    labels = torch.full_like(tokens, -100).scatter(1, masked, tokens.gather(1, masked))
    inputs = tokens.scatter(1, masked, MASK_ID)
    attention_mask = torch.ones_like(tokens)
    attention_mask[1::2, -1] = 0  # padding in odd rows: a real mask on both ranks
    return {"input_ids": inputs, "attention_mask": attention_mask}, labels


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(d_model=HIDDEN, d_kv=8, d_ff=2 * HIDDEN, num_layers=LAYERS,
                      num_decoder_layers=1, num_heads=4, relative_attention_num_buckets=8,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, **_hf_common())
    return T5ForConditionalGeneration(config)  # shared embedding, tied lm_head


def _t5_batch() -> tuple[Batch, torch.Tensor]:
    source = torch.randint(1, VOCAB, (GLOBAL_BATCH, SEQ), generator=_gen())
    labels = torch.randint(1, VOCAB, (GLOBAL_BATCH, SEQ // 2), generator=_gen(2))
    decoder_inputs = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1)
    return {"input_ids": source, "decoder_input_ids": decoder_inputs}, labels


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=HIDDEN, num_hidden_layers=LAYERS,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=2 * SEQ,
                           router_jitter_noise=0.0, **_hf_common())
    return MixtralForCausalLM(config)


# --------------------------------------------------------------------------- torch.nn


class EncoderLM(nn.Module):
    """nn.TransformerEncoder between a token embedding and a linear head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, nhead=4, dim_feedforward=2 * HIDDEN,
                                           dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(input_ids)))


class ConvNet(nn.Module):
    """Two conv + BatchNorm + ReLU stages, global pooling, a linear classifier. The convolutions
    have no bias, as in ResNets: BatchNorm subtracts it again, so its gradient would be float
    noise (about 1e-8), which AdamW turns into updates of lr * noise / eps."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(16, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


def _images() -> tuple[Batch, torch.Tensor]:
    images = torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=_gen())
    return {"images": images}, torch.randint(0, 10, (GLOBAL_BATCH,), generator=_gen(2))


ZOO: dict[str, ZooModel] = {m.name: m for m in (
    ZooModel("gpt2", _seeded(_gpt2), _causal_batch, causal_lm_loss),
    ZooModel("llama-tied", _seeded(_llama(True)), _causal_batch, causal_lm_loss),
    ZooModel("llama-untied", _seeded(_llama(False)), _causal_batch, causal_lm_loss),
    ZooModel("bert-mlm", _seeded(_bert), _bert_batch, token_loss),
    ZooModel("t5", _seeded(_t5), _t5_batch, token_loss),
    ZooModel("mixtral", _seeded(_mixtral), _causal_batch, causal_lm_loss),
    ZooModel("transformer-encoder", _seeded(EncoderLM), _causal_batch, causal_lm_loss),
    ZooModel("cnn-batchnorm", _seeded(ConvNet), _images, class_loss, per_rank_forward=True),
)}


# --------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class ZooConfig:
    """One training run of a zoo model: fp32, or bf16 compute (param_dtype) with fp32 gradient
    reduction; optionally with activation checkpointing of the blocks (CHECKPOINTING); compiled
    with the graphshard backend at its default options (Inductor), or eager (no torch.compile)."""

    model: str
    bf16: bool = False
    checkpointing: str = "none"  # a key of CHECKPOINTING
    compiled: bool = True

    @property
    def label(self) -> str:
        return (self.model + ("-bf16" if self.bf16 else "-fp32")
                + ("" if self.checkpointing == "none" else f"-ckpt-{self.checkpointing}")
                + ("" if self.compiled else "-eager"))


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)  # mean over ranks, per step
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # full, after the last step
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # this rank's, at the end
    output_dtype: torch.dtype | None = None
    grad_problems: list[str] = field(default_factory=list)  # see tests/workers.py
    collectives: dict[str, int] = field(default_factory=dict)  # graph kind -> collectives
    # Forward ops that the backward graph recomputes (activation checkpointing tags them),
    # of them matmuls, and SDPA forwards in the backward graph (attention recomputed)
    recomputed_ops: int = 0
    recomputed_matmuls: int = 0
    recomputed_attention: int = 0
    # graphs compiled by graphshard on this rank (forward graphs handed to Inductor): none on
    # a rank that loaded the compile of another rank of its host
    model_graphs: int = 0
    graphs: int = 0  # all Dynamo graphs (with bf16 and float inputs: + the input-cast hook's)
    graph_breaks: int = 0
    seconds: float = 0.0  # wall time of the run on this rank
    cpu_seconds: float = 0.0  # CPU time of this rank and of its compile subprocesses
    error: str | None = None  # the traceback, if the run failed


CHECKPOINTING = {
    "none": "no activation checkpointing",
    "hf": "Hugging Face's gradient_checkpointing_enable (non-reentrant)",
    "full": "graphshard.apply_activation_checkpointing(model, 'full')",
    "selective": "graphshard.apply_activation_checkpointing(model, 'selective'): matmul and "
                 "attention outputs saved",
}


def build(config: ZooConfig) -> nn.Module:
    model = ZOO[config.model].build()
    if config.checkpointing == "hf":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif config.checkpointing != "none":
        import graphshard
        if hasattr(model, "config"):  # transformers' default for causal LMs, off in _hf_common
            model.config.use_cache = True
        graphshard.apply_activation_checkpointing(model, config.checkpointing)
        assert not getattr(getattr(model, "config", None), "use_cache", False)
    return model


def optimizer(params, bf16: bool) -> torch.optim.Optimizer:
    # fp32: AdamW, so sharded optimizer state is exercised; eps large enough that float noise
    # in near-zero gradients is not amplified into updates (lr * noise / eps).
    # bf16: plain SGD. AdamW normalises every update to about lr whatever the gradient's size,
    # so bf16 rounding in near-zero gradients would become parameter differences of order lr
    # and the comparison would measure AdamW, not graphshard; under SGD a parameter's error is
    # lr times its gradient's error.
    return torch.optim.SGD(params, lr=SGD_LR) if bf16 else torch.optim.AdamW(params, lr=LR, eps=EPS)


def compute_loss(spec: ZooModel, output: Any, targets: torch.Tensor) -> torch.Tensor:
    # In fp32 also under bf16 (as Hugging Face upcasts logits): a bf16 loss is quantised to
    # steps of 2^-6 between 2 and 4, which would hide everything smaller.
    return spec.loss(logits_of(output).float(), targets)


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def bf16_compute_copy(master: nn.Module) -> nn.Module:
    """A copy of `master` whose parameters are bf16, except those of normalisation layers with
    running statistics (BatchNorm): batch_norm wants its weight in the dtype of those fp32
    buffers, and accepts a bf16 input (FSDP1's MixedPrecision leaves _BatchNorm alone too).
    Buffers stay as they are: graphshard casts parameters only."""
    low = copy.deepcopy(master)
    for module in low.modules():
        if not isinstance(module, nn.modules.batchnorm._NormBase):
            for p in module.parameters(recurse=False):
                p.data = p.data.to(torch.bfloat16)
    return low


def reference(config: ZooConfig, world: int, compute_bf16: bool | None = None) -> list[RunResult]:
    """Single process on the whole global batch, loss = mean of the per-rank-slice losses
    (what the sharded run averages). bf16: fp32 master weights, each step computing with
    bf16_compute_copy(master). compute_bf16=False runs a bf16 config's optimizer in fp32 (the
    bf16 reference's own distance to fp32). Returns one result per rank; they differ only in
    buffers, and only where `per_rank_forward` (BatchNorm running statistics, which stay per
    rank as under DDP)."""
    spec = ZOO[config.model]
    bf16 = config.bf16 if compute_bf16 is None else compute_bf16
    master = build(config)
    opt = optimizer(master.parameters(), config.bf16)
    inputs, targets = spec.batch()
    rank_buffers = [_buffers(master) for _ in range(world)]
    result = RunResult()
    for _ in range(STEPS):
        model, step_inputs = master, inputs
        if bf16:
            model = bf16_compute_copy(master)
            step_inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
                           for k, v in inputs.items()}  # graphshard casts forward inputs too
        if spec.per_rank_forward:
            # Each rank's forward with its own batch statistics and running buffers.
            outputs = [torch.func.functional_call(model, rank_buffers[r], (),
                                                  slice_rows(step_inputs, r, world), strict=False)
                       for r in range(world)]
            slice_losses = [compute_loss(spec, outputs[r], slice_rows(targets, r, world))
                            for r in range(world)]
        else:
            logits = logits_of(model(**step_inputs))
            outputs = [logits]
            slice_losses = [compute_loss(spec, slice_rows(logits, r, world),
                                         slice_rows(targets, r, world)) for r in range(world)]
        loss = torch.stack(slice_losses).mean()
        loss.backward()
        if bf16:
            for p, q in zip(master.parameters(), model.parameters()):
                p.grad = q.grad.float()
        opt.step()
        opt.zero_grad()
        result.losses.append(loss.item())
        result.output_dtype = logits_of(outputs[0]).dtype
    result.params = {n: p.detach().clone() for n, p in master.named_parameters()}
    if not spec.per_rank_forward:
        rank_buffers = [_buffers(master)] * world
    return [RunResult(result.losses, result.params, rank_buffers[r], result.output_dtype)
            for r in range(world)]


MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def _is_recomputed(node: torch.fx.Node) -> bool:
    # torch.utils.checkpoint tags the ops of a checkpointed region (selective: the ones its
    # policy does not save) PREFER_RECOMPUTE; the partitioner copies them, tag and all, into the
    # backward graph. Without checkpointing no op carries the tag (the partitioner's own
    # recomputation of cheap ops does not add it).
    from torch.utils.checkpoint import CheckpointPolicy

    return (node.op == "call_function"
            and node.meta.get("recompute") == CheckpointPolicy.PREFER_RECOMPUTE)


def _is_sdpa_forward(node: torch.fx.Node) -> bool:
    # Recomputed under checkpointing, SDPA (an RNG op: dropout) runs inside run_with_rng_state.
    def is_sdpa(target: Any) -> bool:
        return "scaled_dot_product" in str(target) and "backward" not in str(target)

    return node.op == "call_function" and (
        is_sdpa(node.target) or ("rng_state" in str(node.target) and any(map(is_sdpa, node.args))))


def train_sharded(rank: int, world: int, configs: list[ZooConfig]) -> list[RunResult]:
    """On each rank, for each config: shard a fresh model, compile it with the graphshard
    backend at its default options (or not at all), train STEPS steps on this rank's slice of
    the global batch. A failing config is reported in its result (every rank fails alike: the
    graphs are the same) and the next one runs."""
    import resource
    import time
    import traceback

    import graphshard
    from graphshard.compiler.backend import GraphshardCompiler
    from graphshard.compiler.pipeline import STAGES
    from graphshard.compiler.options import GraphshardOptions
    from graphshard.passes.graph_utils import is_collective
    from tests.workers import grad_layout_problems

    def cpu_seconds() -> float:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)  # Inductor's C++ compiles
        return time.process_time() + children.ru_utime + children.ru_stime

    results = []
    for config in configs:
        start, start_cpu = time.perf_counter(), cpu_seconds()
        spec, result = ZOO[config.model], RunResult()

        def observe(kind: str, stage: str, gm: torch.fx.GraphModule) -> None:
            if stage == STAGES[-1]:  # a forward or backward graph as handed to Inductor
                count = sum(map(is_collective, gm.graph.nodes))
                result.collectives[kind] = result.collectives.get(kind, 0) + count
                result.model_graphs += kind == "forward"
                if kind == "backward":
                    recomputed = [node for node in gm.graph.nodes if _is_recomputed(node)]
                    result.recomputed_ops += len(recomputed)
                    result.recomputed_matmuls += sum(node.target in MATMULS for node in recomputed)
                    result.recomputed_attention += sum(map(_is_sdpa_forward, gm.graph.nodes))

        try:
            model = build(config)
            graphshard.shard(model, **(dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                                       if config.bf16 else {}))
            torch._dynamo.utils.counters.clear()
            fn = model
            if config.compiled:
                # What backend="graphshard" builds (default options), plus an observer, which
                # sees the passes on the rank of the host that compiles (the other loads).
                backend = GraphshardCompiler(GraphshardOptions(), observe, aot_cache=True)
                fn = torch.compile(model, backend=backend, fullgraph=True)
            opt = optimizer(model.parameters(), config.bf16)
            inputs, targets = spec.batch()
            inputs, targets = slice_rows(inputs, rank, world), slice_rows(targets, rank, world)
            for _ in range(STEPS):
                output = fn(**inputs)
                result.output_dtype = logits_of(output).dtype
                loss = compute_loss(spec, output, targets)
                loss.backward()
                result.grad_problems.extend(grad_layout_problems(model))
                opt.step()
                opt.zero_grad()
                loss = loss.detach()
                torch.distributed.all_reduce(loss)
                result.losses.append(loss.item() / world)
            result.params = {n: p.full_tensor() for n, p in model.named_parameters()}
            result.buffers = _buffers(model)
            result.grad_problems = sorted(set(result.grad_problems))
            counters = torch._dynamo.utils.counters
            result.graphs = counters["stats"]["unique_graphs"]
            result.graph_breaks = sum(counters["graph_break"].values())
        except Exception:
            result.error = traceback.format_exc()
        result.seconds = time.perf_counter() - start
        result.cpu_seconds = cpu_seconds() - start_cpu
        results.append(result)
        torch._dynamo.reset()
    return results
