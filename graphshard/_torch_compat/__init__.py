"""Every private torch API graphshard's compiler and runtime use, in one place: this package,
one module per subject (`compiling`: Dynamo, AOTAutograd and Inductor hooks; `compile_cache`:
their caches' keys; `distributed`: process groups, meshes, DTensor; `tensors`: tensors, fake
tensors, pytrees, module internals), every name re-exported here, where callers read it
(`compat.name`, which a test may replace).

Each entry says what it is for and what public API would replace it. torch 2.13 is the version
the test suite runs on (pyproject pins it); a torch upgrade starts by re-checking this package.
"""

from graphshard._torch_compat.compiling import (  # noqa: F401
    aot_autograd_backend,
    graph_input_source,
    lazy_graph_modules,
    mark_static,
    boxed,
    inductor_partition,
    inductor_compile_graph,
    free_storage_op,
    inductor_compile,
    inductor_decompositions,
    fake_mode_of_inputs,
    short_traceback_error,
    run_eagerly_when_called_from_eager_code,
    backward_compiled_with_forward,
    compile_counters,
    allow_recompiles,
    quiet_selective_checkpoint_notice,
    compiled_module_original,
    inductor_config_changes_made_by,
    settle_inductor_host_probes,
    inductor_vector_isa_probed,
)
from graphshard._torch_compat.compile_cache import (  # noqa: F401
    cacheable_graph_compiler,
    salt_aot_autograd_cache_key,
    compile_cache_dir,
    compile_caches_enabled,
    aot_cache_bypass_reason,
    KEYED_FUNCTION_PACKAGES,
    keyed_package_functions_cacheable,
    cache_key_of_object,
    cache_key_salt,
)
from graphshard._torch_compat.distributed import (  # noqa: F401
    rank_invariant_group_name,
    process_group_size,
    process_group_rank,
    process_group,
    process_group_ranks,
    init_fake_process_group,
    sharded_like,
    set_local_tensor,
    root_mesh,
    strided_shard,
    clear_dtensor_caches,
    all_reduce_min,
    is_strided_shard,
    default_store,
)
from graphshard._torch_compat.tensors import (  # noqa: F401
    real_tensors,
    count_cpu_frees_on_every_thread,
    cpu_allocations,
    fake_mode_of_value,
    fake_tensor_mode,
    tree_leaves,
    tree_map,
    tree_map_only,
    is_op_overload,
    version_counter,
    wrapper_tensor,
    written_arguments,
    is_norm_with_running_stats,
    rnn_flat_weight_names,
    rnn_weight_cache_overrides,
    non_persistent_buffer_names,
)
