"""Up-front checks of a job's parallel layout against the model and the world size.

Run by ``hp-train`` before it starts any rank (:func:`~hp_trainer.preflight.preflight`) and by
:class:`~hp_trainer.Trainer` before it creates a process group: a combination that cannot work
fails here, once, with a message naming the values, instead of failing later on every rank.
"""

from __future__ import annotations

from typing import Any

from hp_trainer.config import JobConfig

__all__ = ["validate_parallel_layout"]


def _fail(message: str) -> None:
    raise ValueError(f"invalid parallel layout: {message}")


def validate_parallel_layout(config: JobConfig, world_size: int, model_args: Any = None) -> None:
    """Check that the job's degrees, model and options compose.

    Checked: the product of the degrees equals ``world_size`` (``dp_shard = -1`` inferred);
    pipeline parallel needs a model with a splitter (``ModelSpec.pipelining_fn``), untied
    embeddings, enough blocks for the stages, a micro-batch size dividing the local batch and a
    validation batch that is a multiple of the local batch; context parallel needs a model whose
    attention has a context-parallel path, no ``compile.fullgraph``, and Ulysses/hybrid degrees
    dividing the heads; tensor parallel must divide the query and key/value heads and cannot shard
    tied embeddings; expert parallel needs a mixture-of-experts model; the sequence length must
    be a multiple of ``tp * 2 * cp``; the global batch a multiple of ``local_batch_size`` times
    the data-parallel degree.

    Args:
        config: The job configuration.
        world_size: The number of ranks the job runs on.
        model_args: The resolved model arguments (default: resolved from ``config``).

    Raises:
        ValueError: For the first combination that cannot work, naming the values.

    See Also:
        :titan:`torchtitan.distributed.parallel_dims.ParallelDims._validate`: TorchTitan checks the
        degrees only, on every rank, after the launcher started them.
    """
    from hp_trainer.components.hf_io.config import resolve_model_args
    from hp_trainer.distributed.context_parallel import supports_context_parallel
    from hp_trainer.distributed.parallel_dims import parallel_dims_from_config
    from hp_trainer.distributed.pipeline import stages_per_rank_of
    from hp_trainer.protocols.model_spec import get_model_spec

    par = config.parallelism
    training = config.training
    model = f"model {config.model.name}/{config.model.flavor}"
    dims = parallel_dims_from_config(par, world_size)  # raises on a bad product
    spec = get_model_spec(config.model.name)
    args = model_args if model_args is not None else resolve_model_args(spec, config)
    n_heads = int(args.n_heads)
    n_kv_heads = int(getattr(args, "n_kv_heads", None) or n_heads)
    tied = bool(getattr(args, "enable_weight_tying", False))

    if dims.tp > 1:
        for name, heads in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            if heads % dims.tp:
                _fail(
                    f"parallelism.tensor_parallel_degree = {dims.tp} must divide {model}'s "
                    f"{name} = {heads}"
                )
        if tied:
            _fail(
                f"parallelism.tensor_parallel_degree = {dims.tp} with {model}, which ties its "
                "embedding and LM head (TP shards them on different axes): use tp = 1 or an "
                "untied flavor"
            )
    if par.enable_async_tensor_parallel:
        _fail(
            "parallelism.enable_async_tensor_parallel = true needs symmetric memory on a CUDA "
            "device, which hp-trainer does not provide yet: set it false"
        )
    if training.seq_len % dims.seq_len_divisor:
        _fail(
            f"training.seq_len = {training.seq_len} must be a multiple of {dims.seq_len_divisor} "
            f"(tensor_parallel_degree {dims.tp} for sequence parallel x 2 * "
            f"context_parallel_degree {dims.cp} for load-balanced CP)"
        )
    micro_global = training.local_batch_size * dims.dp_degree
    if training.global_batch_size != -1 and training.global_batch_size % micro_global:
        _fail(
            f"training.global_batch_size = {training.global_batch_size} must be a multiple of "
            f"local_batch_size {training.local_batch_size} x data-parallel degree "
            f"{dims.dp_degree} = {micro_global}"
        )

    if dims.pp > 1:
        if spec.pipelining_fn is None:
            _fail(
                f"parallelism.pipeline_parallel_degree = {dims.pp} but model "
                f"{config.model.name!r} has no pipeline splitter (ModelSpec.pipelining_fn); "
                "use pipeline_parallel_degree = 1"
            )
        if tied:
            _fail(
                f"parallelism.pipeline_parallel_degree = {dims.pp} with {model}, which ties its "
                "embedding and LM head across the first and last stage: use an untied flavor"
            )
        stages = dims.pp * stages_per_rank_of(par.pipeline_parallel_schedule)
        parts = int(args.n_layers) + 2  # embedding, blocks, head
        if stages > parts:
            _fail(
                f"parallelism.pipeline_parallel_degree = {dims.pp} with schedule "
                f"{par.pipeline_parallel_schedule!r} needs {stages} stages, but {model} has "
                f"only {args.n_layers} blocks (+ embedding and head)"
            )
        mb = par.pipeline_parallel_microbatch_size
        if training.local_batch_size % mb:
            _fail(
                f"parallelism.pipeline_parallel_microbatch_size = {mb} must divide "
                f"training.local_batch_size = {training.local_batch_size}"
            )
        if (
            config.validation.enable
            and config.validation.local_batch_size % training.local_batch_size
        ):
            _fail(
                f"validation.local_batch_size = {config.validation.local_batch_size} with "
                f"pipeline_parallel_degree = {dims.pp} must be a multiple of "
                f"training.local_batch_size = {training.local_batch_size} (the activation "
                "shapes the stages exchange)"
            )
    problem = spec.layout_check(dims, args) if spec.layout_check is not None else None
    if problem is not None:
        _fail(f"{model}: {problem}")
    if dims.cp > 1:
        if not supports_context_parallel(spec):
            _fail(
                f"parallelism.context_parallel_degree = {dims.cp} but {model}'s attention has no "
                "context-parallel path; use context_parallel_degree = 1"
            )
        if config.compile.enable and config.compile.fullgraph:
            # the engine (collectives, autograd functions holding Python state) runs eagerly
            # between the compiled pieces of a block: a graph break, which fullgraph refuses
            _fail(
                f"compile.fullgraph = true with context_parallel_degree = {dims.cp}: the "
                "context-parallel attention runs eagerly between the compiled pieces of each "
                "block (a graph break); set compile.fullgraph = false"
            )
        method = par.context_parallel_rotate_method
        local_heads = n_heads // dims.tp
        ulysses = {"ulysses": dims.cp, "hybrid": par.context_parallel_ulysses_degree}.get(method)
        if method == "hybrid" and dims.cp % par.context_parallel_ulysses_degree:
            _fail(
                f"parallelism.context_parallel_ulysses_degree = "
                f"{par.context_parallel_ulysses_degree} must divide context_parallel_degree = "
                f"{dims.cp} for the hybrid"
            )
        if ulysses is not None and local_heads % ulysses:
            _fail(
                f"context_parallel_rotate_method = {method!r} splits the {local_heads} query "
                f"heads per TP rank ({model}: n_heads {n_heads} / tp {dims.tp}) over {ulysses} "
                "ranks, which does not divide them"
            )
    if par.context_parallel_ulysses_degree != 1 and (
        dims.cp == 1 or par.context_parallel_rotate_method != "hybrid"
    ):
        _fail(
            f"parallelism.context_parallel_ulysses_degree = "
            f"{par.context_parallel_ulysses_degree} is used only with "
            "context_parallel_rotate_method = 'hybrid' and context_parallel_degree > 1"
        )
    if dims.ep > 1 and getattr(args, "moe_args", None) is None:
        _fail(
            f"parallelism.expert_parallel_degree = {dims.ep} but {model} has no experts; use a "
            "mixture-of-experts model (qwen3_moe, deepseek_v3) or expert_parallel_degree = 1"
        )
    moe = config.moe
    dispatch_options = [
        f"moe.{name} = true"
        for name in ("dedup_dispatch", "overlap_backward")
        if getattr(moe, name)
    ]
    if dispatch_options and dims.ep == 1:
        _fail(
            f"{' and '.join(dispatch_options)} options the expert-parallel all-to-all dispatcher: "
            f"they need expert_parallel_degree > 1, got expert_parallel_degree = {dims.ep}"
        )
    if moe.dedup_ranks_per_node > 1 and dims.tp > 1:
        # the trainer builds the experts' [ep, tp] mesh without the [inter, intra] node axis
        _fail(
            f"moe.dedup_ranks_per_node = {moe.dedup_ranks_per_node} with "
            f"tensor_parallel_degree = {dims.tp}: under expert tensor parallelism the trainer "
            "runs the one-stage dedup dispatch on an [ep, tp] mesh (the two-stage one needs "
            "hp_cp_ep.ExpertTensorParallel(dedup=True) on an [inter, intra, tp] mesh, not built "
            "here); expected moe.dedup_ranks_per_node = 1"
        )
    if moe.dedup_ranks_per_node > 1 and dims.ep % moe.dedup_ranks_per_node:
        _fail(
            f"moe.dedup_ranks_per_node = {moe.dedup_ranks_per_node} must divide "
            f"expert_parallel_degree = {dims.ep}"
        )
    if getattr(args, "moe_args", None) is not None:
        from hp_trainer.models.common.expert_parallel import moe_layout_error

        problem = moe_layout_error(dims, args)
        if problem is not None:
            _fail(f"{model}: {problem}")
        low = config.training.mixed_precision_param == "bfloat16"
        if config.compile.enable and config.compile.fullgraph and (dims.ep > 1 or not low):
            # the split sizes of the EP all-to-all, and of the per-expert loop that replaces
            # the grouped GEMM while compiling outside bf16, are read on the host: graph breaks
            _fail(
                f"compile.fullgraph = true with {model}, expert_parallel_degree = {dims.ep} and "
                f"training.mixed_precision_param = {config.training.mixed_precision_param!r}: "
                "an MoE compiles as one graph only in bfloat16 without expert parallelism (the "
                "all-to-all's and the per-expert loop's split sizes are graph breaks); set "
                "compile.fullgraph = false"
            )
