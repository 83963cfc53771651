"""Argument checks shared by the schedule generators (each error names the values and the rule)."""

from __future__ import annotations


def check_sizes(name: str, pp_size: int, num_stages: int, n_microbatches: int) -> None:
    """Raise ValueError unless the three sizes are positive integers."""
    for label, value in (
        ("pp_size", pp_size),
        ("num_stages", num_stages),
        ("n_microbatches", n_microbatches),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: {label} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name}: {label} must be >= 1, got {value}")


def require_one_stage_per_rank(name: str, pp_size: int, num_stages: int) -> None:
    """Single-stage schedules run exactly one stage on each rank."""
    if num_stages != pp_size:
        raise ValueError(
            f"{name} runs one stage per rank: num_stages must equal pp_size, got "
            f"num_stages={num_stages}, pp_size={pp_size}"
        )


def require_looped_stages(name: str, pp_size: int, num_stages: int) -> int:
    """Looped schedules need the same number of stages on each rank; return that number."""
    if num_stages % pp_size != 0:
        raise ValueError(
            f"{name} places stage s on rank s % pp_size: num_stages must be a multiple of "
            f"pp_size, got num_stages={num_stages}, pp_size={pp_size}"
        )
    return num_stages // pp_size


def require_v_stages(name: str, pp_size: int, num_stages: int) -> None:
    """V-shaped schedules run exactly two stages on each rank."""
    if num_stages != 2 * pp_size:
        raise ValueError(
            f"{name} runs two stages per rank in a V: num_stages must equal 2 * pp_size = "
            f"{2 * pp_size}, got num_stages={num_stages}, pp_size={pp_size}"
        )
