"""Test helper for the fault-tolerance tests: SIGKILL this process at a chosen point.

``HP_FT_KILL=<point>:<k>`` kills the process at ``point`` of its ``k``-th step (counted from
the start of this process): ``forward`` (the model's forward pre-hook), ``backward`` (a
gradient hook, mid-backward), ``optimizer`` (after the commit vote, before the update),
``recovery`` (while loading the state received from a peer; ``k`` ignored).
``HP_FT_STEP_SLEEP`` seconds are slept after each step with fewer than ``group_size``
participants (a survivor trains on slowly while the victim restarts).
``HP_FT_BARRIER=<folder>:<n>``: before the first step, wait until ``n`` processes have started
their torchft managers (each leaves a file in ``folder``), so every group is heartbeating when
the first quorum forms and all of them join it.
Every committed step's loss is appended to ``<run folder>/losses.jsonl``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillAt:
    def __init__(self) -> None:
        point, _, k = os.environ.get("HP_FT_KILL", ":").partition(":")
        self.point = point
        self.k = int(k or 0)
        self.local_step = 0
        self.sleep = float(os.environ.get("HP_FT_STEP_SLEEP", "0"))

    def on_train_begin(self, trainer: Any) -> None:
        folder, _, count = os.environ.get("HP_FT_BARRIER", ":").partition(":")
        if folder:
            Path(folder, str(os.getpid())).touch()
            deadline = time.monotonic() + 120
            while len(list(Path(folder).iterdir())) < int(count):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"HP_FT_BARRIER: fewer than {count} groups in 120 s")
                time.sleep(0.05)
        if self.point == "forward":
            trainer.model.register_forward_pre_hook(lambda *_: self._maybe())
        elif self.point == "backward":
            param = next(trainer.model.parameters())
            param.register_hook(lambda g: self._maybe() or g)
        elif self.point == "optimizer":
            trainer.optimizers.optimizers[0].register_step_pre_hook(lambda *_: self._maybe())
        elif self.point == "recovery":
            fns = trainer.ft.manager._load_state_dict_fns
            fns["hp"] = lambda state: _die()

    def _maybe(self) -> None:
        if self.local_step == self.k:
            _die()

    def on_step_begin(self, trainer: Any, step: int) -> None:
        self.local_step += 1

    def on_step_values(self, trainer: Any, step: int, loss: float, grad_norm: float) -> None:
        with (Path(trainer.run_folder) / "losses.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "loss": loss}) + "\n")

    def on_step_end(self, trainer: Any, step: int) -> None:
        ft = trainer.ft
        if self.sleep and ft.num_replicas < ft.config.group_size:  # alone: wait for the others
            time.sleep(self.sleep)
