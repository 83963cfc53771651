"""Test helper for ``hp-train`` launches: which process is which rank.

``--job.callbacks _launch_ranks:RankPid`` makes each rank write its pid to
``<run folder>/rank<R>.pid`` before its first step. The launcher forks its ranks from a
forkserver, which sets ``RANK`` in the rank's ``os.environ`` after the fork: unlike a
``torchrun --module`` rank, it is not in ``/proc/<pid>/environ``.

``HP_TEST_IDLE_AFTER=<n>``: after step ``n`` each step waits (up to 1 s, polling every 10 ms)
for a SIGTERM before it starts, so a job that waits for its signal idles instead of training.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


class RankPid:
    def __init__(self) -> None:
        self.idle_after = int(os.environ.get("HP_TEST_IDLE_AFTER", "0"))

    def on_train_begin(self, trainer: Any) -> None:
        path = Path(trainer.run_folder) / f"rank{os.environ['RANK']}.pid"
        path.parent.mkdir(parents=True, exist_ok=True)  # rank 0 may not have made it yet
        path.write_text(str(os.getpid()))

    def on_step_begin(self, trainer: Any, step: int) -> None:
        if not self.idle_after or step <= self.idle_after:
            return
        deadline = time.monotonic() + 1.0
        while not trainer._stop_requested and time.monotonic() < deadline:
            time.sleep(0.01)


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def descendants(root: int) -> list[int]:
    """Every live process under ``root`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(parent_of(int(entry.name)), []).append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def rank_pids(run_folder: Path, launcher: int) -> dict[int, int]:
    """rank -> pid of the ranks of the job under ``launcher`` that wrote their pid files."""
    under = set(descendants(launcher))
    out = {}
    for path in run_folder.glob("rank*.pid"):
        pid = int(path.read_text())
        assert pid in under, f"rank pid {pid} from {path} is not a process under {launcher}"
        out[int(path.stem.removeprefix("rank"))] = pid
    return out
