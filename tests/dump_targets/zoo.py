"""Causal language models of the test zoo (tests/model_zoo.py) as `graphshard dump` targets:
`tests.dump_targets.zoo:causal_lm --model-args name=gpt2 --no-meta`."""

from __future__ import annotations

from tests.model_zoo import ZOO, causal_lm_loss, logits_of


def causal_lm(name: str = "gpt2"):
    """(model, example_inputs, loss_fn) of a zoo entry whose batch is input_ids alone."""
    spec = ZOO[name]
    inputs, _ = spec.batch()
    return spec.build(), (inputs["input_ids"],), lambda out, ids: causal_lm_loss(logits_of(out), ids)
