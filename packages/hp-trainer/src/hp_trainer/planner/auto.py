"""``--parallelism.auto true``: the planner's best layout applied to a job before it starts."""

from __future__ import annotations

import dataclasses
import os

from hp_trainer.config import JobConfig

__all__ = ["resolve_auto_layout"]


def _default_device() -> str:
    from hp_dtensor import device as hp_device

    kind = hp_device.get_device_type()
    if not hp_device.is_accelerator(kind):
        return "cpu"
    import torch

    module = getattr(torch, kind, None)
    get_name = getattr(module, "get_device_name", None)
    device_name = str(get_name()) if get_name is not None else kind
    name = device_name.replace(" ", "").lower()
    for profile in ("h200", "h100", "ascend910b"):
        if profile in name:
            return profile
    raise ValueError(
        f"parallelism.auto = true on a device ({device_name}) without a shipped profile: "
        "set parallelism.auto_device to h100, h200, ascend910b, cpu or a .toml profile "
        "(hp-plan calibrate writes one)"
    )


def resolve_auto_layout(config: JobConfig, world_size: int | None = None) -> JobConfig:
    """Replace the job's degrees, schedule, micro-batch size, AC mode and optimizer offload
    with the planner's best layout (a job without ``parallelism.auto`` is returned as is).

    The global batch is kept: ``training.global_batch_size``, or ``local_batch_size x world
    size`` when it is -1 (the pure-FSDP reading of the local batch). Every rank computes the
    same plan (the search is deterministic), so no rank needs to send it.

    Args:
        config: The job.
        world_size: Ranks (default: ``WORLD_SIZE``, else 1).

    Returns:
        The job with the chosen layout.

    Raises:
        ValueError: No layout fits (the message holds the closest candidates and what each
            lacks), or an unknown device profile.

    See Also:
        :titan:`torchtitan.config.job_config.Parallelism`: the degrees TorchTitan's user sets
        by hand.
    """
    par = config.parallelism
    if not par.auto:
        return config
    from hp_trainer.planner.search import plan_layouts

    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    training = config.training
    gbs = training.global_batch_size
    if gbs == -1:
        gbs = training.local_batch_size * world
    result = plan_layouts(
        config.model.name,
        config.model.flavor,
        world,
        par.auto_device or _default_device(),
        seq_len=training.seq_len,
        global_batch_size=gbs,
        optimizer=config.optimizer.name,
        compute_dtype_bytes=2 if training.mixed_precision_param != "float32" else 4,
        offload=config.optimizer.name != "Muon",
    )
    best = result.best
    if best is None:
        raise ValueError(
            f"parallelism.auto = true: no layout of {config.model.name}/{config.model.flavor} "
            f"fits {world} ranks\n{result.table()}"
        )
    c = best.candidate
    return dataclasses.replace(
        config,
        training=dataclasses.replace(
            training, local_batch_size=c.local_batch_size, global_batch_size=gbs
        ),
        parallelism=dataclasses.replace(
            par,
            data_parallel_replicate_degree=c.dp_replicate,
            data_parallel_shard_degree=c.dp_shard,
            tensor_parallel_degree=c.tp,
            context_parallel_degree=c.cp,
            pipeline_parallel_degree=c.pp,
            pipeline_parallel_schedule=c.schedule,
            pipeline_parallel_microbatch_size=c.microbatch_size,
            expert_parallel_degree=c.ep,
        ),
        activation_checkpoint=dataclasses.replace(config.activation_checkpoint, mode=c.ac),
        offload=dataclasses.replace(config.offload, optimizer=c.offload_optimizer),
    )
