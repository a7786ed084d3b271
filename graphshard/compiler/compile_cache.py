"""When AOTAutograd may serve a compile from its cache, and what its key must cover."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import sys
from pathlib import Path

import torch.fx as fx

import graphshard as graphshard_package
import graphshard.passes as passes_package
from graphshard import _torch_compat as compat
from graphshard.compiler.cost_model import ClusterSpec
from graphshard.compiler.dynamo_graph import SplitContext
from graphshard.compiler.options import GraphshardOptions
from graphshard.compiler.rank_agreement import job_nonce


def reuses_cache(options: GraphshardOptions, *, aot_cache: bool | None, observed: bool) -> bool:
    """Whether AOTAutograd may serve this compile from its cache (a job restarting on
    unchanged code skips tracing, partitioning and our passes, as plain torch.compile does).
    `aot_cache` None: unless observed, for an observer (`graphshard dump`) wants the graphs
    themselves; False: never (the bench's collectives-only replay, which reads every rank's
    own passes); True: also when observed, where the observer sees the compiles this host
    runs (one rank's, the others load it) and the entries are this job's own
    (`salt_cache_key`). Not for "eager", which produces
    nothing Inductor can store. "auto" agrees on its choice with the other ranks by a
    collective during the compile, so its entries are this job's only as well: ranks on one
    host load their host's compile, a restart compiles again (Inductor's FX graph cache
    serves the kernels)."""
    wanted = not observed if aot_cache is None else aot_cache
    return wanted and options.compiler == "inductor"


def salt_cache_key(gm: fx.GraphModule, options: GraphshardOptions, cluster: ClusterSpec,
                   split: SplitContext, *, observed: bool = False) -> bool:
    """Make what the compiled graphs depend on beyond the Dynamo graph part of AOTAutograd's
    cache key for `gm`: our options, the cluster the cost model schedules for, graphshard's
    code, the transport's form (sorted: a set's order is the process's hash seed's, and every
    rank of a host must salt alike), and for "auto" the job (an entry made in another job was
    decided without this job's collective, which every rank must join), as for an `observed`
    compile (one rank of each host must run it, however warm the cache). False, and
    nothing changed, where Dynamo itself keyed the graph (precompile packaging): that key is
    not ours to replace."""
    if compat.cache_key_salt(gm) is not None:
        return False
    job = job_nonce() if observed or options.reshard_after_forward == "auto" else None
    compat.salt_aot_autograd_cache_key(gm, "graphshard-" + hashlib.sha256(
        repr((options, cluster, _source_digest(), _library_versions(),
              sorted(split.via_all_to_all), job)).encode()).hexdigest()[:32])
    return True


def _library_versions() -> tuple[tuple[str, str], ...]:
    """The versions of the packages besides graphshard whose autograd.Functions the cache may
    store (compat.KEYED_FUNCTION_PACKAGES: named in the key, their code stood for by this)."""
    return tuple((name, importlib.metadata.version(name))
                 for name in compat.KEYED_FUNCTION_PACKAGES
                 if name != "graphshard" and name in sys.modules)


@functools.cache
def _source_digest() -> str:
    """Digest of graphshard's Python sources (the package and its passes): a changed pass must
    not be served a graph compiled by the old one from AOTAutograd's cache."""
    digest = hashlib.sha256()
    for package in (graphshard_package, passes_package):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()
