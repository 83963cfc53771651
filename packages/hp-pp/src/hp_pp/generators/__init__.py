"""Schedule generators: every built-in pipeline schedule as a compute-only action table.

``generate(name, pp_size=..., num_stages=..., n_microbatches=...)`` returns, for each pipeline
rank, its compute actions in order (``F``, ``B``, ``I``, ``W`` and ``OVERLAP_F_B``; MPipe adds
its preprocess ``PRE_F`` / ``PRE_B``; ``None`` is an idle slot of the lock-step picture).
:func:`hp_pp.comm_lowering.add_communication` adds the sends and receives; one executor runs
the result. Names are case-insensitive and PyTorch's
class names (``"ScheduleGPipe"``, ...) are accepted.

See Also:
    :pt:`torch.distributed.pipelining.schedules.get_schedule_class`
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from hp_pp.actions import ScheduleTable
from hp_pp.generators.looped import interleaved_1f1b, interleaved_zero_bubble, looped_bfs
from hp_pp.generators.mapping import StageStyle, rank_to_stages, stage_to_rank
from hp_pp.generators.mpipe import mpipe
from hp_pp.generators.single import gpipe, one_f_one_b
from hp_pp.generators.v_shape import dualpipe_v, zbv_zero_bubble

__all__ = [
    "SCHEDULE_NAMES",
    "STYLE",
    "StageStyle",
    "canonical_schedule_name",
    "generate",
    "rank_to_stages",
    "stage_to_rank",
]

_GENERATORS: dict[str, Callable[..., ScheduleTable]] = {
    "GPipe": gpipe,
    "1F1B": one_f_one_b,
    "Interleaved1F1B": interleaved_1f1b,
    "LoopedBFS": looped_bfs,
    "InterleavedZeroBubble": interleaved_zero_bubble,
    "ZBVZeroBubble": zbv_zero_bubble,
    "DualPipeV": dualpipe_v,
    "MPipe": mpipe,
}

SCHEDULE_NAMES: tuple[str, ...] = tuple(_GENERATORS)
"""The canonical names of the built-in schedules, in the order tables and pictures list them."""

_ALIASES = {
    "mpipetranspose": "MPipe",
    "zbv": "ZBVZeroBubble",
    "zb1p": "InterleavedZeroBubble",
    "interleavedzb": "InterleavedZeroBubble",
}


def canonical_schedule_name(name: str) -> str:
    """The canonical name of a built-in schedule (``"schedulezbv..."`` -> ``"ZBVZeroBubble"``).

    Accepts any case, PyTorch's class names (``"Schedule1F1B"``) and the short ``"ZBV"``.

    Raises:
        ValueError: ``name`` is no built-in schedule; the message lists the valid names.

    See Also:
        :pt:`torch.distributed.pipelining.schedules.get_schedule_class`
    """
    if not isinstance(name, str):
        raise TypeError(f"schedule name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    if key.startswith("schedule"):
        key = key[len("schedule") :]
    by_lower = {canonical.lower(): canonical for canonical in SCHEDULE_NAMES}
    found = by_lower.get(key) or _ALIASES.get(key)
    if found is None:
        raise ValueError(f"unknown schedule {name!r}; expected one of {list(SCHEDULE_NAMES)}")
    return found


def generate(name: str, *, pp_size: int, num_stages: int, n_microbatches: int) -> ScheduleTable:
    """The compute-only action table of the built-in schedule ``name``.

    Args:
        name: A schedule name (see ``SCHEDULE_NAMES``; case-insensitive, torch class names
            accepted).
        pp_size: Number of pipeline ranks.
        num_stages: Total number of stages (``pp_size`` for single-stage schedules, a multiple
            of it for looped ones, ``2 * pp_size`` for V-shaped ones).
        n_microbatches: Micro-batches per step.

    Returns:
        ``{rank: [Action | None, ...]}`` for ranks ``0 .. pp_size - 1``; stage placement is
        ``STYLE[name]``.

    Raises:
        ValueError: unknown name, or sizes the schedule cannot run (the message names the
            values and the rule).

    See Also:
        :pt:`torch.distributed.pipelining.schedules.PipelineScheduleMulti` (its
        ``pipeline_order``).
    """
    return _GENERATORS[canonical_schedule_name(name)](
        pp_size=pp_size, num_stages=num_stages, n_microbatches=n_microbatches
    )


class _StyleByName(Mapping[str, StageStyle]):
    """Stage placement style of each built-in schedule; keys accept any spelling of a name.

    See Also:
        :pt:`torch.distributed.pipelining.schedules.generate_stage_to_rank_mapping`
    """

    def __init__(self, styles: dict[str, StageStyle]) -> None:
        self._styles = styles

    def __getitem__(self, name: str) -> StageStyle:
        return self._styles[canonical_schedule_name(name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._styles)

    def __len__(self) -> int:
        return len(self._styles)

    def __repr__(self) -> str:
        return f"STYLE({self._styles!r})"


STYLE: Mapping[str, StageStyle] = _StyleByName(
    {name: ("v" if name in ("ZBVZeroBubble", "DualPipeV") else "loop") for name in SCHEDULE_NAMES}
)
"""``STYLE[name]``: ``"loop"`` or ``"v"``, the stage-to-rank placement the schedule assumes."""
