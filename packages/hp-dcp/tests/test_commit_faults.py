"""The commit protocol under faults: one atomic publish, leftovers inspected, one save at a time.

The SIGKILL test kills one rank of a two-process save at 20 points drawn with a fixed seed from
every Python call and C call made by hp-dcp code during the save (renames, fsyncs and writes
included), then checks that the checkpoint path holds a complete, verified checkpoint (the
previous one, or the new one if the kill came after the publish) and that the next save
recovers whatever was left.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

import hp_dcp
from hp_dcp import _commit
from hp_dcp.storage import INCOMPLETE_MARKER, staging_dir

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(version: int) -> dict[str, Any]:
    return {
        "w0": torch.full((4, 3), float(version)),
        "w1": torch.full((5,), float(version) + 0.5),
        "step": version,
    }


def _empty() -> dict[str, Any]:
    return {"w0": torch.zeros(4, 3), "w1": torch.zeros(5), "step": -1}


def _loaded_version(path: Path) -> int:
    got = _empty()
    hp_dcp.load(got, checkpoint_id=path, no_dist=True)
    version = int(got["step"])
    assert torch.equal(got["w0"], _state(version)["w0"])
    assert torch.equal(got["w1"], _state(version)["w1"])
    hp_dcp.verify_checkpoint(path)
    return version


def test_replacing_a_checkpoint_is_one_atomic_exchange(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c"
    hp_dcp.save(_state(1), checkpoint_id=path, no_dist=True)
    seen: list[tuple[bool, bool]] = []
    exchange = _commit.exchange_dirs

    def spy(a: Path, b: Path) -> bool:
        before = (b / ".metadata").is_file()
        done = exchange(a, b)
        seen.append((before, (b / ".metadata").is_file()))
        return done

    monkeypatch.setattr(_commit, "exchange_dirs", spy)
    hp_dcp.save(_state(2), checkpoint_id=path, no_dist=True)
    assert seen == [(True, True)]  # one exchange; the path held a checkpoint before and after
    assert _loaded_version(path) == 2
    leftovers = {p.name for p in tmp_path.iterdir()}
    assert leftovers == {"c"}  # staging, retired copy and lock file all gone


def test_fallback_without_exchange_still_replaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "c"
    hp_dcp.save(_state(1), checkpoint_id=path, no_dist=True)
    monkeypatch.setattr(_commit, "exchange_dirs", lambda a, b: False)
    with caplog.at_level(logging.WARNING, logger="hp_dcp.storage"):
        hp_dcp.save(_state(2), checkpoint_id=path, no_dist=True)
    assert "cannot exchange directories atomically" in caplog.text
    assert _loaded_version(path) == 2


class _CrashBeforePublish(hp_dcp.FileSystemWriter):
    def _commit(self, staging: Path) -> None:
        raise OSError("simulated crash before the publish")


class _CrashAfterExchange(hp_dcp.FileSystemWriter):
    def _commit(self, staging: Path) -> None:
        assert _commit.exchange_dirs(staging, self.path)
        raise OSError("simulated crash after the exchange")


def test_leftover_staging_is_inspected_not_deleted_blindly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "c"
    hp_dcp.save(_state(1), checkpoint_id=path, no_dist=True)
    # A complete save whose publish never happened: the next save recovers (publishes) it first.
    with pytest.raises(CheckpointException, match="before the publish"):
        hp_dcp.save(_state(2), storage_writer=_CrashBeforePublish(path), no_dist=True)
    assert _loaded_version(path) == 1  # the path still holds the previous checkpoint
    assert not (staging_dir(path) / INCOMPLETE_MARKER).exists()
    with caplog.at_level(logging.WARNING, logger="hp_dcp.storage"):
        hp_dcp.save(_state(3), checkpoint_id=path, no_dist=True)
    assert "recovered" in caplog.text
    assert _loaded_version(path) == 3
    # A crash right after the exchange: the previous checkpoint sits at the staging name.
    caplog.clear()
    with pytest.raises(CheckpointException, match="after the exchange"):
        hp_dcp.save(_state(4), storage_writer=_CrashAfterExchange(path), no_dist=True)
    assert _loaded_version(path) == 4
    with caplog.at_level(logging.WARNING, logger="hp_dcp.storage"):
        hp_dcp.save(_state(5), checkpoint_id=path, no_dist=True)
    assert "a previous checkpoint left by an interrupted replacement" in caplog.text
    assert _loaded_version(path) == 5
    # An incomplete one is removed with a log line.
    caplog.clear()
    staging_dir(path).mkdir()
    (staging_dir(path) / INCOMPLETE_MARKER).write_text("x")
    (staging_dir(path) / "__0_0.distcp").write_bytes(b"partial")
    with caplog.at_level(logging.WARNING, logger="hp_dcp.storage"):
        hp_dcp.save(_state(6), checkpoint_id=path, no_dist=True)
    assert "the incomplete directory of an interrupted save" in caplog.text
    assert _loaded_version(path) == 6
    assert {p.name for p in tmp_path.iterdir()} == {"c"}


def test_missing_target_with_complete_staging_is_recovered(tmp_path: Path) -> None:
    path = tmp_path / "c"
    with pytest.raises(CheckpointException, match="before the publish"):
        hp_dcp.save(_state(1), storage_writer=_CrashBeforePublish(path), no_dist=True)
    with pytest.raises(hp_dcp.IncompleteCheckpointError, match="That directory is complete"):
        hp_dcp.load(_empty(), checkpoint_id=path, no_dist=True)
    hp_dcp.save(_state(2), checkpoint_id=path, no_dist=True)
    assert _loaded_version(path) == 2


def test_live_lock_refuses_and_names_owner(tmp_path: Path) -> None:
    path = tmp_path / "c"
    other = _commit.SaveLock(path, "other-save")
    other.acquire()
    try:
        with pytest.raises(
            hp_dcp.ConcurrentSaveError, match=rf"pid {os.getpid()}, save other-save"
        ):
            hp_dcp.save(_state(1), checkpoint_id=path, no_dist=True)
        assert not path.exists()
        assert not staging_dir(path).exists()
    finally:
        other.release()
    hp_dcp.save(_state(1), checkpoint_id=path, no_dist=True)
    assert _loaded_version(path) == 1


def test_stale_lock_of_dead_process_is_taken_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "c"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = _commit.lock_file(path)
    lock.write_text(f'{{"host": "{os.uname().nodename}", "pid": {dead.pid}, "save_id": "x"}}')
    with caplog.at_level(logging.WARNING, logger="hp_dcp.storage"):
        hp_dcp.save(_state(1), checkpoint_id=path, no_dist=True)
    assert f"pid {dead.pid} (that process is dead)" in caplog.text
    assert _loaded_version(path) == 1
    assert not lock.exists()


class _SlowWriter(hp_dcp.FileSystemWriter):
    """Holds its save open (after taking the lock) until released."""

    def __init__(self, path: Path, started: threading.Event, go: threading.Event) -> None:
        super().__init__(path)
        self._started, self._go = started, go

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._started.set()
        assert self._go.wait(60)
        return super().write_data(plan, planner)


def test_two_concurrent_saves_one_succeeds_other_fails_clearly(tmp_path: Path) -> None:
    path = tmp_path / "c"
    started, go = threading.Event(), threading.Event()
    outcome: list[object] = []

    def first() -> None:
        try:
            outcome.append(
                hp_dcp.save(_state(1), storage_writer=_SlowWriter(path, started, go), no_dist=True)
            )
        except BaseException as exc:  # reported to the main thread
            outcome.append(exc)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert started.wait(60)
        with pytest.raises(hp_dcp.ConcurrentSaveError, match=r"another save into .* in progress"):
            hp_dcp.save(_state(2), checkpoint_id=path, no_dist=True)
    finally:
        go.set()
        thread.join(60)
    assert len(outcome) == 1
    assert isinstance(outcome[0], Metadata)
    assert _loaded_version(path) == 1


# --- SIGKILL of a rank at random points of a two-rank save --------------------------------------


class _KillAt:
    """A profile hook counting calls made from hp-dcp code; SIGKILLs the process at call N."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.count = 0

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event not in ("call", "c_call") or "hp_dcp" not in frame.f_code.co_filename:
            return
        self.count += 1
        if self.count == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def _rank_main(rank: int, store: str, path: str, version: int, kill_at: int, out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    state = _state(version)
    mine = {f"w{rank}": state[f"w{rank}"], "step": state["step"]}
    hook = _KillAt(kill_at)
    sys.setprofile(hook)
    hp_dcp.save(mine, checkpoint_id=path)
    sys.setprofile(None)
    Path(out).write_text(str(hook.count))
    dist.barrier()
    dist.destroy_process_group()


def _run_save(
    tmp: Path, tag: str, path: Path, version: int, kills: dict[int, int]
) -> tuple[list[str], bool]:
    ctx = mp.get_context("fork")
    outs = [str(tmp / f"{tag}.{r}") for r in range(2)]
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, str(tmp / f"{tag}.store"), str(path), version, kills.get(r, 0), outs[r]),
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 60
    victim: list[Any] = []
    try:
        while time.monotonic() < deadline and all(p.is_alive() for p in procs):
            time.sleep(0.01)
        victim = [p for p in procs if not p.is_alive() and p.exitcode == -signal.SIGKILL]
        if victim:  # a rank died: the job is torn down, as a launcher would
            time.sleep(0.05)
        else:
            for p in procs:
                p.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    texts = [Path(o).read_text() if Path(o).exists() else "" for o in outs]
    return texts, bool(victim)  # a rank killed itself (not one killed at the teardown)


def test_sigkill_of_a_rank_at_20_points_never_loses_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    hp_dcp.save(_state(0), checkpoint_id=path, no_dist=True)
    # Calibrate: how many hp-dcp calls each rank makes in one full save.
    texts, killed = _run_save(tmp_path, "calib", path, 1, {})
    assert not killed
    counts = [int(c) for c in texts]
    assert min(counts) > 50  # the hook sees the save's calls
    assert _loaded_version(path) == 1
    rng = random.Random(19)
    outcomes = []
    for point in range(20):
        rank = rng.randrange(2)
        at = rng.randint(1, counts[rank])
        previous = _loaded_version(path)
        _, killed = _run_save(tmp_path, f"p{point}", path, previous + 1, {rank: at})
        assert killed, (point, rank, at)
        got = _loaded_version(path)  # loads and verifies: never a partial checkpoint
        assert got in (previous, previous + 1), (point, rank, at)
        outcomes.append(got - previous)
        # The next save (another job) recovers what was left: stale lock, staging, old copy.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hp_dcp.save(_state(got + 1), checkpoint_id=path, no_dist=True)
        assert _loaded_version(path) == got + 1
        assert {p.name for p in tmp_path.iterdir() if p.name.startswith(".")} == set()
    assert 0 in outcomes  # most kills land before the publish: the previous checkpoint stays
