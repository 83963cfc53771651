"""The chosen layout as a config overlay that ``hp-train --config`` reads."""

from __future__ import annotations

from pathlib import Path

from hp_trainer.planner.cost import LayoutEstimate

__all__ = ["layout_overlay", "write_overlay"]


def layout_overlay(
    model: str, flavor: str, estimate: LayoutEstimate
) -> dict[str, dict[str, object]]:
    """The ``{section: {field: value}}`` of a layout (model, batch, degrees, AC, offload).

    Args:
        model: Model name.
        flavor: Flavor.
        estimate: The chosen layout's estimate.

    Returns:
        Sections and values in :class:`~hp_trainer.JobConfig`'s names.

    See Also:
        :titan:`torchtitan.config.job_config.Parallelism`: the section the degrees go to.
    """
    c = estimate.candidate
    ac = {"none": "none", "selective": "selective", "full": "full", "swap": "swap"}[c.ac]
    return {
        "model": {"name": model, "flavor": flavor},
        "training": {
            "seq_len": c.seq_len,
            "local_batch_size": c.local_batch_size,
            "mixed_precision_param": "bfloat16" if c.compute_dtype_bytes == 2 else "float32",
        },
        "parallelism": {
            "data_parallel_replicate_degree": c.dp_replicate,
            "data_parallel_shard_degree": c.dp_shard,
            "tensor_parallel_degree": c.tp,
            "context_parallel_degree": c.cp,
            "pipeline_parallel_degree": c.pp,
            "pipeline_parallel_schedule": c.schedule,
            "pipeline_parallel_microbatch_size": c.microbatch_size,
            "expert_parallel_degree": c.ep,
        },
        "activation_checkpoint": {"mode": ac},
        "offload": {"optimizer": c.offload_optimizer, "params": c.offload_params},
    }


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_overlay(
    path: str | Path, model: str, flavor: str, estimate: LayoutEstimate, *, header: str = ""
) -> Path:
    """Write :func:`layout_overlay` as TOML (``hp-train --config PATH`` runs it).

    Args:
        path: The file to write.
        model: Model name.
        flavor: Flavor.
        estimate: The chosen layout.
        header: Comment lines put on top (the prediction).

    Returns:
        The path written.

    See Also:
        :titan:`torchtitan.config.ConfigManager`: TorchTitan's TOML configs.
    """
    lines = [f"# {line}" for line in header.splitlines()]
    for section, values in layout_overlay(model, flavor, estimate).items():
        lines.append(f"\n[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    out = Path(path)
    out.write_text("\n".join(lines).lstrip("\n") + "\n")
    return out
