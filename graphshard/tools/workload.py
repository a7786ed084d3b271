"""A model with its example inputs and loss: what the tools train, dump, plan and benchmark."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Workload:
    model: Any  # an nn.Module
    inputs: tuple | dict  # positional arguments, or keyword arguments (Hugging Face's input_ids=)
    loss_fn: Callable | None  # loss = loss_fn(output, *inputs); None: the model computes its own
    description: str = ""  # what it was built from (a target, a model name)

    def run(self, model) -> Any:
        """`model` (the workload's, compiled or sharded) called on the example inputs."""
        return model(**self.inputs) if isinstance(self.inputs, dict) else model(*self.inputs)

    def local_inputs(self, rank: int, world_size: int) -> tuple:
        """This rank's 1/world_size slice of the (global) batch of positional inputs (dim 0)."""
        if isinstance(self.inputs, dict):
            raise TypeError(f"{self.description or 'this workload'} takes keyword inputs; "
                            "local_inputs slices positional ones")
        return tuple(t.chunk(world_size, dim=0)[rank].contiguous() for t in self.inputs)
