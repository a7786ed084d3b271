"""Names from Hugging Face transformers, looked up only where a model of its may be in hand.

transformers is optional: if it is not imported yet, no model given to graphshard can be one of
its (and importing it would cost 60 MiB and seconds); an older release may lack a name.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any


def transformers_names(module: str, *names: str) -> tuple[Any, ...] | None:
    """`names` from the transformers module `module` (e.g. "transformers.modeling_layers"), or
    None when transformers is not in use or this release does not have them all."""
    if "transformers" not in sys.modules:
        return None
    try:
        found = importlib.import_module(module)
        return tuple(getattr(found, name) for name in names)
    except (ImportError, AttributeError):
        return None


def is_transformers_class(cls: type) -> bool:
    """Whether `cls` is a Hugging Face model class (a PreTrainedModel)."""
    pretrained = transformers_names("transformers", "PreTrainedModel")
    return pretrained is not None and issubclass(cls, pretrained[0])


def is_transformers_model(model: Any) -> bool:
    return is_transformers_class(type(model))
