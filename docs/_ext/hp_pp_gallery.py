"""Sphinx directive ``hp-pp-gallery``: hp-pp's simulator draws every built-in schedule.

The pictures are made at build time, offline, into ``<srcdir>/packages/generated/pp_gallery``
(ignored by git, cleaned by ``scripts/build_docs.py``), so the gallery always shows what the
current generators and simulator produce. Options: ``:ranks:`` (default 4) and
``:microbatches:`` (default 8); every schedule runs on those ranks with the same model cost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util.docutils import SphinxDirective


class ScheduleGallery(SphinxDirective):
    """One figure per built-in schedule, with its simulated step time and bubble."""

    option_spec: ClassVar[dict[str, Any]] = {
        "ranks": directives.positive_int,
        "microbatches": directives.positive_int,
    }

    def run(self) -> list[nodes.Node]:
        from hp_pp.generators import SCHEDULE_NAMES, generate
        from hp_pp.simulate import PipelineCosts, simulate_schedule
        from hp_pp.timeline import write_timeline_png

        ranks = self.options.get("ranks", 4)
        microbatches = self.options.get("microbatches", 8)
        relative = Path("packages", "generated", "pp_gallery")
        folder = Path(self.env.srcdir) / relative
        folder.mkdir(parents=True, exist_ok=True)
        # F = I = W = 1 for a cut into `ranks` stages; a quarter of the first stage's forward
        # and backward is its preprocess block (only MPipe treats it differently).
        model = PipelineCosts(preprocess_forward=0.125, preprocess_backward=0.125)
        out: list[nodes.Node] = []
        for name in SCHEDULE_NAMES:
            stages = ranks if name in ("GPipe", "1F1B") else 2 * ranks
            table = generate(name, pp_size=ranks, num_stages=stages, n_microbatches=microbatches)
            result = simulate_schedule(table, model.split_evenly(stages, ranks))
            file_name = f"{name}_{ranks}x{microbatches}.png"
            title = f"{name}: {stages} stages on {ranks} ranks, {microbatches} micro-batches"
            write_timeline_png(result, folder / file_name, title=title, dpi=90)
            figure = nodes.figure()
            figure += nodes.image(uri="/" + (relative / file_name).as_posix(), alt=title)
            peak = max(result.peak_activation_memory.values())
            caption = (
                f"{name}: step {result.step_time:g}, bubble {result.bubble_fraction:.1%}, "
                f"peak activation memory {peak:g} (1 = one micro-batch through 1/{ranks} "
                "of the model)"
            )
            figure += nodes.caption(text=caption)
            out.append(figure)
        return out


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("hp-pp-gallery", ScheduleGallery)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
