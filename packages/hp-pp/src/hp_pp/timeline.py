"""Pictures of a simulated step: a timeline PNG and a Chrome-trace JSON.

The PNG has one row per rank and one colour per action kind (forward, full backward,
backward-input, backward-weight, overlapped forward+backward, data-parallel work); each bar
is labelled with its micro-batch when it is wide enough, and bars of a rank's later stages
(stage index ``>= pp_size``: the second loop, or the way back up a V) are hatched. It needs
matplotlib (``pip install 'hp-pp[plot]'``), imported only when a picture is drawn, with the
Agg backend (no display). The Chrome trace (open it in ``chrome://tracing`` or Perfetto)
needs nothing.

See Also:
    :pt:`torch.distributed.pipelining.schedules._dump_chrometrace`
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hp_pp.actions import ActionType
from hp_pp.simulate import SimulationResult

__all__ = ["ACTION_COLORS", "write_chrome_trace", "write_timeline_png"]

ACTION_COLORS: dict[ActionType, str] = {
    ActionType.FORWARD: "#4c72b0",
    ActionType.FULL_BACKWARD: "#55a868",
    ActionType.BACKWARD_INPUT: "#8fd18f",
    ActionType.BACKWARD_WEIGHT: "#dd8452",
    ActionType.OVERLAP_F_B: "#8172b3",
    ActionType.UNSHARD: "#937860",
    ActionType.RESHARD: "#c0a080",
    ActionType.REDUCE_GRAD: "#da8bc3",
    ActionType.PREPROCESS_F: "#64b5cd",
    ActionType.PREPROCESS_B: "#c44e52",
}
"""The colour of each action kind in the timeline picture."""

_LABELS = {
    ActionType.FORWARD: "forward (F)",
    ActionType.FULL_BACKWARD: "backward (B)",
    ActionType.BACKWARD_INPUT: "backward input (I)",
    ActionType.BACKWARD_WEIGHT: "backward weight (W)",
    ActionType.OVERLAP_F_B: "overlapped F+B",
    ActionType.UNSHARD: "unshard",
    ActionType.RESHARD: "reshard",
    ActionType.REDUCE_GRAD: "reduce grad",
    ActionType.PREPROCESS_F: "preprocess forward (MPipe)",
    ActionType.PREPROCESS_B: "preprocess backward (MPipe)",
}


def write_chrome_trace(
    result: SimulationResult, path: str | Path, *, name: str = "pipeline"
) -> None:
    """Write the simulated step as a Chrome trace: one thread per rank, costs read as ms.

    See Also:
        :pt:`torch.distributed.pipelining.schedules._dump_chrometrace`
    """
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": name}},
    ]
    for rank in sorted(result.busy_time):
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": 0,
                "tid": rank,
                "args": {"name": f"rank {rank}"},
            }
        )
    for timed in result.timeline:
        events.append(
            {
                "name": str(timed.action),
                "cat": timed.action.type.value,
                "ph": "X",
                "pid": 0,
                "tid": timed.rank,
                "ts": timed.start * 1000.0,
                "dur": (timed.end - timed.start) * 1000.0,
            }
        )
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, indent=1))


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "drawing a pipeline timeline needs matplotlib: pip install 'hp-pp[plot]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_timeline_png(
    result: SimulationResult, path: str | Path, *, title: str | None = None, dpi: int = 110
) -> None:
    """Draw the simulated step: one row per rank, one colour per action kind.

    Raises:
        ImportError: matplotlib is missing (the message names the pip command).

    See Also:
        :pt:`torch.distributed.pipelining.schedules._dump_chrometrace` (PyTorch draws no picture)
    """
    plt = _pyplot()
    ranks = sorted(result.busy_time)
    width = min(16.0, max(6.0, 0.35 * len(result.timeline) / max(1, len(ranks)) + 3.0))
    fig, ax = plt.subplots(figsize=(width, 0.55 * len(ranks) + 1.4))
    try:
        used: set[ActionType] = set()
        for timed in result.timeline:
            kind = timed.action.type
            used.add(kind)
            row = len(ranks) - 1 - ranks.index(timed.rank)
            duration = timed.end - timed.start
            ax.broken_barh(
                [(timed.start, duration)],
                (row - 0.4, 0.8),
                facecolors=ACTION_COLORS.get(kind, "#999999"),
                edgecolors="white",
                linewidth=0.6,
                hatch="///" if timed.action.stage_index >= len(ranks) else None,
            )
            label = _bar_label(timed.action)
            if label and duration >= 0.015 * max(result.step_time, 1e-12):
                ax.text(
                    timed.start + duration / 2,
                    row,
                    label,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
        ax.set_yticks(range(len(ranks)))
        ax.set_yticklabels([f"rank {r}" for r in reversed(ranks)])
        ax.set_xlim(0, max(result.step_time, 1e-12))
        ax.set_xlabel("time")
        heading = title or "pipeline schedule"
        ax.set_title(
            f"{heading}: step {result.step_time:g}, bubble {result.bubble_fraction:.1%}",
            fontsize=10,
        )
        handles = [
            plt.Rectangle((0, 0), 1, 1, color=ACTION_COLORS[kind])
            for kind in ACTION_COLORS
            if kind in used
        ]
        ax.legend(
            handles,
            [_LABELS[kind] for kind in ACTION_COLORS if kind in used],
            loc="upper center",
            bbox_to_anchor=(0.5, -0.25),
            ncol=len(handles),
            fontsize=7,
            frameon=False,
        )
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def _bar_label(action: Any) -> str:
    """``stage:micro-batch`` for a bar (both halves for an overlapped pair)."""
    if action.sub_actions is not None:
        return "/".join(f"{a.microbatch_index}" for a in action.sub_actions)
    if action.microbatch_index is None:
        return ""
    return str(action.microbatch_index)
