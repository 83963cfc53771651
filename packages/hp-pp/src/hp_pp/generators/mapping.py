"""Which rank runs which pipeline stage: the "loop" and the "v" placements.

``loop`` places stage ``s`` on rank ``s % pp_size`` (stages wrap around the ranks, as in
Interleaved 1F1B); ``v`` places stages ``r`` and ``2 * pp_size - 1 - r`` on rank ``r`` (the
model goes down the ranks and comes back up, as in ZBV and DualPipeV), so the last stage sits
on rank 0 next to the first.

See Also:
    :pt:`torch.distributed.pipelining.schedules.generate_stage_to_rank_mapping`
"""

from __future__ import annotations

from typing import Literal

__all__ = ["StageStyle", "rank_to_stages", "stage_to_rank"]

StageStyle = Literal["loop", "v"]


def stage_to_rank(stage_index: int, pp_size: int, style: str = "loop") -> int:
    """The pipeline rank that runs ``stage_index``.

    Args:
        stage_index: A stage, ``>= 0``.
        pp_size: Number of pipeline ranks, ``>= 1``.
        style: ``"loop"`` (stage ``s`` on rank ``s % pp_size``) or ``"v"`` (stages ``r`` and
            ``2 * pp_size - 1 - r`` on rank ``r``; needs ``stage_index < 2 * pp_size``).

    Raises:
        ValueError: an unknown style, a negative stage, or a stage a V placement cannot hold.

    See Also:
        :pt:`torch.distributed.pipelining.schedules.generate_stage_to_rank_mapping`
    """
    if pp_size < 1:
        raise ValueError(f"pp_size must be >= 1, got {pp_size}")
    if stage_index < 0:
        raise ValueError(f"stage_index must be >= 0, got {stage_index}")
    if style == "loop":
        return stage_index % pp_size
    if style == "v":
        if stage_index >= 2 * pp_size:
            raise ValueError(
                f"the 'v' style holds exactly 2 * pp_size = {2 * pp_size} stages; "
                f"stage {stage_index} does not exist"
            )
        return stage_index if stage_index < pp_size else 2 * pp_size - 1 - stage_index
    raise ValueError(f"style must be 'loop' or 'v', got {style!r}")


def rank_to_stages(rank: int, pp_size: int, num_stages: int, style: str = "loop") -> list[int]:
    """The stages ``rank`` runs, in increasing order.

    Raises:
        ValueError: see :func:`stage_to_rank`; also a rank outside ``[0, pp_size)``.

    See Also:
        :pt:`torch.distributed.pipelining.schedules.generate_rank_to_stage_mapping`
    """
    if not 0 <= rank < pp_size:
        raise ValueError(f"rank must be in [0, {pp_size}), got {rank}")
    return [s for s in range(num_stages) if stage_to_rank(s, pp_size, style) == rank]
