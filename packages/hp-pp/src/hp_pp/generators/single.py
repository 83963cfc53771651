"""One stage per rank: GPipe (all forwards, then all backwards) and 1F1B.

The slots (``None`` = idle) follow PyTorch's lock-step picture of these schedules, so a table
printed here lines up with ``torch.distributed.pipelining``'s for the same sizes.

See Also:
    :pt:`torch.distributed.pipelining.ScheduleGPipe`,
    :pt:`torch.distributed.pipelining.Schedule1F1B`
"""

from __future__ import annotations

from hp_pp.actions import Action, ActionType, ScheduleTable
from hp_pp.generators._checks import check_sizes, require_one_stage_per_rank

__all__ = ["gpipe", "one_f_one_b"]

_F = ActionType.FORWARD
_B = ActionType.FULL_BACKWARD


def gpipe(*, pp_size: int, num_stages: int, n_microbatches: int) -> ScheduleTable:
    """Fill then drain: each rank runs every forward, then every backward, micro-batch order.

    Raises:
        ValueError: ``num_stages != pp_size`` or a size below 1.
    """
    check_sizes("GPipe", pp_size, num_stages, n_microbatches)
    require_one_stage_per_rank("GPipe", pp_size, num_stages)
    table: ScheduleTable = {}
    for rank in range(pp_size):
        # A forward reaches rank r after r slots; the first backward comes back after the
        # remaining forwards reach the last rank and return (3 slots per hop in the picture).
        slots: list[Action | None] = [None] * rank
        slots += [Action(rank, _F, mb) for mb in range(n_microbatches)]
        slots += [None] * (3 * (pp_size - 1 - rank))
        slots += [Action(rank, _B, mb) for mb in range(n_microbatches)]
        table[rank] = slots
    return table


def one_f_one_b(*, pp_size: int, num_stages: int, n_microbatches: int) -> ScheduleTable:
    """Warm up with ``pp_size - 1 - rank`` forwards, then alternate one forward, one backward.

    Raises:
        ValueError: ``num_stages != pp_size``, or fewer micro-batches than stages (the warm-up
            would not fit).
    """
    check_sizes("1F1B", pp_size, num_stages, n_microbatches)
    require_one_stage_per_rank("1F1B", pp_size, num_stages)
    if n_microbatches < num_stages:
        raise ValueError(
            f"1F1B needs n_microbatches >= num_stages, got n_microbatches={n_microbatches}, "
            f"num_stages={num_stages}"
        )
    table: ScheduleTable = {}
    for rank in range(pp_size):
        warmup = pp_size - 1 - rank
        slots: list[Action | None] = [None] * rank
        slots += [Action(rank, _F, mb) for mb in range(warmup)]
        # Wait for the first backward to travel down and back up (2 slots per hop).
        slots += [None] * (2 * warmup)
        next_fwd, next_bwd = warmup, 0
        while next_fwd < n_microbatches:
            slots += [Action(rank, _F, next_fwd), Action(rank, _B, next_bwd)]
            next_fwd += 1
            next_bwd += 1
        # Cool-down: each remaining backward waits one slot for its gradient.
        while next_bwd < n_microbatches:
            slots += [None, Action(rank, _B, next_bwd)]
            next_bwd += 1
        table[rank] = slots
    return table
