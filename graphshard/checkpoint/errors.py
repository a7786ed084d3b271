"""What a checkpoint call raises, and the one message naming every key that does not fit."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint cannot be saved, loaded or exported; the message says why."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint at the given path."""


class IncompleteCheckpointError(CheckpointError):
    """The directory is a checkpoint whose save did not finish (no completion marker)."""


def raise_if_unfit(missing: list, unexpected: list, mismatched: list, source: str,
                   headline: str) -> None:
    """One CheckpointError naming every key that does not fit, before anything is loaded."""
    problems = []
    if missing:
        problems.append(f"missing (in the model, not in the {source}): {missing}")
    if unexpected:
        problems.append(f"unexpected (in the {source}, not in the model): {unexpected}")
    if mismatched:
        problems.append(f"shape mismatch: {'; '.join(mismatched)}")
    if problems:
        raise CheckpointError(f"{headline}: " + "; ".join(problems))
