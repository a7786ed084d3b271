"""Backend options: one frozen dataclass, validated once.

    torch.compile(model, backend="graphshard", options={"bucket_mb": 25, "prefetch": 1})
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping


# Collective kinds whose transport is an option: "native" op or an all-to-all rewrite.
TRANSPORTED_KINDS = ("all_gather", "reduce_scatter")


@dataclass(frozen=True)
class GraphshardOptions:
    bucket_mb: float = 64.0  # cap on one bucket's unsharded size; 0 turns bucketing off
    reorder: bool = True  # prefetch all-gathers and delay reduce-scatter waits
    prefetch: int = 1  # how many units ahead an all-gather may be issued
    max_inflight_mb: float | None = None  # budget for unsharded bytes held early or late; None = no cap
    # prefetch and delay reductions only where that does not raise the graph's peak memory
    overlap_within_peak: bool = False
    reduce_scatter: str = "auto"  # "native", "all_to_all" (+ local sum), "auto": a2a on gloo
    all_gather: str = "auto"  # "native", "all_to_all" (of N - 1 shard copies), "auto": a2a on gloo
    compiler: str = "inductor"  # final compiler: "inductor", or "eager" (run the FX graph)
    cluster: str | None = None  # cost-model JSON from `graphshard calibrate`; None: built-in
    # Keep a unit's gathered weights from forward to backward? None: the strategy decides
    # (full_shard: only the tail of forward: its last unit, and its last block where that costs
    # no peak memory); True / False: every unit resharded / kept; {module-name pattern: bool};
    # "auto": the cost model chooses within memory_budget_mb.
    reshard_after_forward: bool | str | Mapping[str, bool] | None = None
    memory_budget_mb: float | None = None  # per-rank peak (MiB) that "auto" keeps within
    # ranks compare each compiled graph's collective sequence and raise on a mismatch
    check_schedule: bool = True
    # ranks on one host that would compile the same graphs: one compiles, the others load its
    # result from the host's compile caches (compile_cache.py)
    compile_once_per_host: bool = True

    def __post_init__(self):
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"graphshard option {message}")

        check(isinstance(self.bucket_mb, (int, float)) and not isinstance(self.bucket_mb, bool)
              and self.bucket_mb >= 0, f"bucket_mb must be a number >= 0, got {self.bucket_mb!r}")
        check(isinstance(self.reorder, bool), f"reorder must be a bool, got {self.reorder!r}")
        check(isinstance(self.check_schedule, bool),
              f"check_schedule must be a bool, got {self.check_schedule!r}")
        check(isinstance(self.compile_once_per_host, bool),
              f"compile_once_per_host must be a bool, got {self.compile_once_per_host!r}")
        check(isinstance(self.overlap_within_peak, bool),
              f"overlap_within_peak must be a bool, got {self.overlap_within_peak!r}")
        check(isinstance(self.prefetch, int) and not isinstance(self.prefetch, bool)
              and self.prefetch >= 0, f"prefetch must be an int >= 0, got {self.prefetch!r}")
        check(self.max_inflight_mb is None or (
            isinstance(self.max_inflight_mb, (int, float)) and not isinstance(self.max_inflight_mb, bool)
            and self.max_inflight_mb >= 0),
            f"max_inflight_mb must be a number >= 0 or None, got {self.max_inflight_mb!r}")
        check(self.cluster is None or (isinstance(self.cluster, str) and os.path.isfile(self.cluster)),
              f"cluster must be the path of a JSON file from `graphshard calibrate`, got {self.cluster!r}")
        reshard = self.reshard_after_forward
        check(reshard is None or isinstance(reshard, bool) or reshard == "auto" or (
            isinstance(reshard, Mapping) and all(
                isinstance(k, str) and isinstance(v, bool) for k, v in reshard.items())),
              "reshard_after_forward must be True, False, 'auto', None or a mapping from "
              f"module-name patterns to bools, got {reshard!r}")
        check(self.memory_budget_mb is None or (
            isinstance(self.memory_budget_mb, (int, float)) and not isinstance(self.memory_budget_mb, bool)
            and self.memory_budget_mb > 0),
            f"memory_budget_mb must be a number > 0 or None, got {self.memory_budget_mb!r}")
        check((reshard == "auto") == (self.memory_budget_mb is not None),
              "memory_budget_mb goes with reshard_after_forward='auto' (the budget it keeps "
              f"within), and 'auto' needs it; got reshard_after_forward={reshard!r}, "
              f"memory_budget_mb={self.memory_budget_mb!r}")
        for kind in TRANSPORTED_KINDS:
            mode = getattr(self, kind)
            check(mode in ("auto", "native", "all_to_all"),
                  f"{kind} must be 'auto', 'native' or 'all_to_all', got {mode!r}")
        check(self.compiler in ("inductor", "eager"),
              f"compiler must be 'inductor' or 'eager', got {self.compiler!r}")

    @classmethod
    def from_dict(cls, options: Mapping[str, Any] | None) -> "GraphshardOptions":
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(
                f"unknown graphshard option(s) {unknown}; valid options: {', '.join(valid)}"
            )
        return cls(**dict(options))

    def via_all_to_all(self, on_gloo: bool) -> frozenset[str]:
        """The collective kinds to rewrite as all-to-all. "auto" means: where the group is gloo's
        (its reduce-scatter is an all-reduce, its all-gather copies its output), except the
        all-gather under a memory budget: its send buffer is as large as the gathered bucket,
        bytes the budget does not count."""
        def chosen(kind: str) -> bool:
            mode = getattr(self, kind)
            if kind == "all_gather" and self.max_inflight_mb is not None and mode == "auto":
                return False
            return mode == "all_to_all" or (mode == "auto" and on_gloo)

        return frozenset(kind for kind in TRANSPORTED_KINDS if chosen(kind))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_option_strings(pairs: list[str]) -> dict[str, Any]:
    """`["bucket_mb=25", "reorder=false"]` -> {"bucket_mb": 25.0, "reorder": False} (for CLIs).

    Values are converted by the type of the field's default; unknown keys are a clear error.
    """
    defaults = GraphshardOptions()
    valid = [f.name for f in fields(GraphshardOptions)]
    parsed: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise ValueError(f"option {pair!r} must be KEY=VALUE")
        if key not in valid:
            raise ValueError(f"unknown graphshard option {key!r}; valid options: {', '.join(valid)}")
        default = getattr(defaults, key)
        text = text.strip()
        if text.lower() == "none":
            value: Any = None
        elif key == "reshard_after_forward":
            value = _reshard_option(text)
        elif isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError(f"option {key} expects true/false, got {text!r}")
            value = text.lower() in ("true", "1", "yes", "on")
        elif isinstance(default, int):
            value = _number(key, text, int)
        elif isinstance(default, float) or key in ("max_inflight_mb", "memory_budget_mb"):
            value = _number(key, text, float)
        else:
            value = text
        parsed[key] = value
    GraphshardOptions.from_dict(parsed)  # validate values now, with the option's own message
    return parsed


def _reshard_option(text: str):
    """true / false / auto, or JSON {"pattern": bool, ...}."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() == "auto":
        return "auto"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ValueError("option reshard_after_forward expects true, false, auto or a JSON "
                         f'mapping like {{"layers.*": false}}, got {text!r}') from None


def _number(key: str, text: str, kind: type):
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"option {key} expects a{'n integer' if kind is int else ' number'}, "
                         f"got {text!r}") from None
