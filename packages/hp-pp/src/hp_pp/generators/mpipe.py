"""HyperParallel's MPipe transpose schedule: Interleaved 1F1B with a transposed preprocess.

The first layers of stage 0 (the *preprocess* block: embeddings, a vision tower) would run
serially on stage 0's rank for every micro-batch while the other ranks wait for the pipeline
to fill. MPipe transposes them: for the first ``NT = min(pp_size, n_microbatches)``
micro-batches, rank ``r`` runs the preprocess forward of micro-batch ``r`` (``0PRE_F<r>``) in
its warm-up idle time and ships its output and input to stage 0's rank, whose forwards of
those micro-batches then start from the shipped output. After stage 0's backward of such a
micro-batch, stage 0's rank recomputes the preprocess forward from the shipped input and runs
its backward (``0PRE_B<mb>``), so the preprocess gradients accumulate on stage 0 only. The
other micro-batches run the preprocess inline in stage 0's forward, as plain Interleaved 1F1B.
Before the step the executor broadcasts the preprocess parameters from stage 0's rank. A
frozen preprocess (``trainable_preprocess=False``) has no ``PRE_B``: only the forward moves.

See Also:
    :pt:`torch.distributed.pipelining.ScheduleInterleaved1F1B` (the body schedule) and
    HyperParallel's ``ScheduleMPipeTranspose``.
"""

from __future__ import annotations

from hp_pp.actions import Action, ActionType, ScheduleTable
from hp_pp.generators.looped import interleaved_1f1b_named

__all__ = ["mpipe", "transposed_microbatches"]


def transposed_microbatches(pp_size: int, n_microbatches: int) -> int:
    """``NT = min(pp_size, n_microbatches)``: how many micro-batches MPipe transposes."""
    return min(pp_size, n_microbatches)


def mpipe(
    *, pp_size: int, num_stages: int, n_microbatches: int, trainable_preprocess: bool = True
) -> ScheduleTable:
    """The MPipe transpose schedule on the loop placement.

    Args:
        pp_size: Number of pipeline ranks.
        num_stages: Total stages (a multiple of ``pp_size``).
        n_microbatches: Micro-batches per step.
        trainable_preprocess: Whether the preprocess block has trainable parameters. ``False``
            (a frozen vision tower, or only the data loading transposed) drops the ``PRE_B``
            recompute: the transposed forward's work leaves stage 0's rank entirely.

    Raises:
        ValueError: as Interleaved 1F1B (``num_stages`` a multiple of ``pp_size``,
            ``n_microbatches`` a multiple of the rounds), naming MPipe.
    """
    table = interleaved_1f1b_named(
        "MPipe", pp_size=pp_size, num_stages=num_stages, n_microbatches=n_microbatches
    )
    transposed = transposed_microbatches(pp_size, n_microbatches)
    for rank in range(transposed):
        table[rank] = [Action(0, ActionType.PREPROCESS_F, rank), *table[rank]]
    rank0: list[Action | None] = []
    for action in table[0]:
        rank0.append(action)
        if (
            action is not None
            and action.stage_index == 0
            and action.type in (ActionType.FULL_BACKWARD, ActionType.BACKWARD_INPUT)
            and action.microbatch_index is not None
            and action.microbatch_index < transposed
        ):
            rank0.append(Action(0, ActionType.PREPROCESS_B, action.microbatch_index))
    if trainable_preprocess:
        table[0] = rank0
    return table
