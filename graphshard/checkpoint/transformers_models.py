"""What transformers' from_pretrained and save_pretrained do beyond reading and writing
tensors, done for a sharded model: the key renames it applies at load, the non-persistent
buffers (rotary frequencies) it computes after loading, and the refusal of save_pretrained.

transformers is optional: a model can be one of its only once transformers is imported.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.nn as nn

from graphshard._transformers import is_transformers_model, transformers_names
from graphshard.checkpoint.errors import CheckpointError

_INITIALISED = "_is_hf_initialized"  # transformers' mark: "loaded, do not initialise again"


def _needs_transformers_5(what: str, exc: ImportError) -> CheckpointError:
    import transformers

    return CheckpointError(
        f"load_pretrained follows transformers' own {what} for its models, which this "
        f"transformers ({transformers.__version__}) lacks ({exc}): install transformers>=5, or "
        "load the model with from_pretrained before graphshard.shard")


def key_conversion(model: nn.Module) -> tuple[list, list[str]]:
    """transformers' conversion of `model`'s checkpoint keys, as its from_pretrained applies it
    and its save_pretrained undoes it: (the renamings: GPT-NeoX's embed_out -> lm_head, old
    LayerNorm gamma/beta -> weight/bias, ...; the weights it fuses from several checkpoint
    tensors, such as MoE experts, which load_pretrained does not). Nothing for other models."""
    if not is_transformers_model(model):
        return [], []
    try:
        from transformers.conversion_mapping import (
            WeightConverter,
            WeightRenaming,
            get_model_conversion_mapping,
        )
    except ImportError as exc:
        raise _needs_transformers_5("key conversion (transformers.conversion_mapping)", exc) from exc
    transforms = get_model_conversion_mapping(model)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [target for t in transforms if isinstance(t, WeightConverter)
             for target in t.target_patterns])


def loaded_name(name: str, renamings: list) -> str:
    """The model's name for checkpoint key `name`, after transformers' renamings."""
    for renaming in renamings:
        name = renaming.rename_source_key(name)[0]
    return name


def _dispatchers(model: nn.Module) -> dict[int, nn.Module]:
    """For each module, the transformers model whose `_init_weights` initialises it: the
    nearest enclosing one (a composite model's sub-models bring their own), as
    `PreTrainedModel.initialize_weights` dispatches."""
    pretrained = transformers_names("transformers", "PreTrainedModel")[0]
    owner_of: dict[int, nn.Module] = {}

    def visit(module: nn.Module, owner: nn.Module) -> None:
        owner_of[id(module)] = owner
        for child in module.children():
            visit(child, child if isinstance(child, pretrained) else owner)

    visit(model, model)
    return owner_of


@contextlib.contextmanager
def _marked_initialised(tensors: list[torch.Tensor]) -> Iterator[None]:
    unmarked = [t for t in tensors if not getattr(t, _INITIALISED, False)]
    for tensor in unmarked:
        setattr(tensor, _INITIALISED, True)
    try:
        yield
    finally:
        for tensor in unmarked:
            delattr(tensor, _INITIALISED)


def buffer_initialiser(model: nn.Module) -> Callable[[nn.Module, list[str]], None]:
    """`init(module, names)`: compute `module`'s buffers `names` (allocated, not yet computed)
    as transformers' from_pretrained does after loading: the model's `_init_weights(module)`,
    with every other tensor of the module marked as already initialised, so that only those
    buffers are written (its rotary embeddings recompute inv_freq from the config)."""
    try:
        from transformers.initialization import guard_torch_init_functions
    except ImportError as exc:
        raise _needs_transformers_5("initialisation (transformers.initialization)", exc) from exc
    owner_of = _dispatchers(model)

    def init(module: nn.Module, names: list[str]) -> None:
        keep = [t for name, t in (*module._parameters.items(), *module._buffers.items())
                if t is not None and name not in names]
        with _marked_initialised(keep), guard_torch_init_functions():
            owner_of[id(module)]._init_weights(module)

    return init


def save_pretrained_refusal(model: nn.Module) -> CheckpointError:
    """Why a sharded model's save_pretrained is refused, and what to call instead: each rank
    holds a shard of every weight, which transformers' writer cannot store."""
    return CheckpointError(
        f"save_pretrained cannot write a {type(model).__name__} sharded by graphshard (each rank holds only its "
        "shard of every weight). Save a checkpoint on every rank with "
        "graphshard.checkpoint.save(path, model), then write a folder that from_pretrained "
        "loads with graphshard.checkpoint.export(path, out_dir, config=path_to_config_json) in "
        "one process (or `graphshard export PATH OUT_DIR --config config.json`); "
        "model.config.save_pretrained(out_dir) writes the config")
