"""Causal language models of the test zoo (tests/model_zoo.py) as `graphshard dump` targets:
`tests.dump_targets.zoo:causal_lm --model-args name=gpt2 --no-meta`."""

from __future__ import annotations

from collections import UserDict

from tests.model_zoo import ZOO, causal_lm_loss, logits_of


def causal_lm(name: str = "gpt2"):
    """(model, example_inputs, loss_fn) of a zoo entry whose batch is input_ids alone."""
    spec = ZOO[name]
    inputs, _ = spec.batch()
    return spec.build(), (inputs["input_ids"],), lambda out, ids: causal_lm_loss(logits_of(out), ids)


def causal_lm_with_labels(name: str = "gpt2", batch: int = 2, seq_len: int = 8):
    """(model, example_inputs) with keyword inputs, as Hugging Face models are trained: the
    model computes its loss from `labels` (no loss_fn)."""
    import torch

    ids = torch.randint(0, 64, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    model = ZOO[name].build()
    # Named, or transformers logs that it picked the default, which Dynamo cannot trace in
    # one graph (plain torch.compile(fullgraph=True) fails on it too).
    model.loss_type = "ForCausalLM"
    return model, UserDict(input_ids=ids, labels=ids)  # a Mapping, as a tokenizer's BatchEncoding
