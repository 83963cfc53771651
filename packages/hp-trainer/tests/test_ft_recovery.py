"""Fault tolerance with real kills: torchft lighthouse + replica groups as hp-train processes.

Two replica groups of one rank each (CPU, gloo, lighthouse on this machine). Group 1 is
SIGKILLed at seeded points (forward, backward, after the commit vote, during its recovery) and
restarted each time; group 0 trains on. Every process runs under a timeout and is killed in
``finally``. Each group is an ``hp-train`` process (``hp_trainer.cli.main``) forked from the test
process's forkserver rather than a new interpreter (``_launch_fork``: no interpreter start and
import, ~2.5 CPU s each), and the lighthouse runs in the test process (``_lighthouse``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hp_dtensor.testing import load_test_module

pytest.importorskip("torchft")

TESTS = Path(__file__).resolve().parent
BATCH = 2  # local_batch_size x dp 1 x 1 micro-batch: samples per group per step


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


class _InProcessLighthouse:
    """torchft's lighthouse hosted by this test process (no interpreter started for it), with
    the ``Popen`` methods ``_cleanup`` calls."""

    def __init__(self, server: Any) -> None:
        self.server: Any = server

    def poll(self) -> int | None:
        return None if self.server is not None else 0

    def send_signal(self, sig: int) -> None:
        self.server.shutdown()
        self.server = None

    def wait(self, timeout: float | None = None) -> int:
        return 0


def _lighthouse(procs: list[Any], min_replicas: int = 1, *, command: bool = False) -> str:
    """Start a lighthouse; ``command``: as ``hp-train --lighthouse`` in its own process (one
    test keeps that path), else in this process through the same option parsing."""
    # With min_replicas > 1 the lighthouse forms a quorum without a group whose heartbeat is
    # late (a loaded CI machine): those tests compare full quorums, so they allow 5 s. With
    # min_replicas = 1 (the kill/restart test) a late heartbeat only makes a live group join a
    # later quorum (and heal), which that test allows; each kill stalls the survivor for this
    # long (torchft heartbeats every 100 ms).
    heartbeat_ms = 1000 if min_replicas == 1 else 5000
    options = [
        "--bind", "[::]:0", "--min_replicas", str(min_replicas),
        "--join_timeout_ms", "10000", "--heartbeat_timeout_ms", str(heartbeat_ms),
    ]  # fmt: skip
    if not command:
        from hp_trainer.components.ft.lighthouse import _start_lighthouse

        server = _InProcessLighthouse(_start_lighthouse(options))
        procs.append(server)
        port = server.server.address().rsplit(":", 1)[1]
        return f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "hp_trainer.cli", "--lighthouse", *options]
    proc = subprocess.Popen(
        cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    procs.append(proc)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready, "the lighthouse printed no address within 60 s"
    line = proc.stdout.readline()
    assert line.startswith("lighthouse: "), line
    port = line.strip().rsplit(":", 1)[1]
    return f"http://127.0.0.1:{port}"


def _group(
    tmp: Path,
    replica: int,
    lighthouse: str,
    steps: int,
    procs: list[Any],
    *,
    kill: str = "",
    sleep: float = 0.0,
    extra: tuple[str, ...] = (),
    groups: int = 2,
    env: dict[str, str] | None = None,
) -> Any:
    cmd = [
        sys.executable, "-m", "hp_trainer.cli", "--config", "debug_ft",
        "--training.steps", str(steps), "--metrics.log_freq", "1",
        "--metrics.enable_plot", "false",
        "--fault_tolerance.group_size", str(groups),
        "--fault_tolerance.replica_id", str(replica),
        "--fault_tolerance.lighthouse", lighthouse,
        "--fault_tolerance.trace", "true",
        "--fault_tolerance.process_group_timeout_ms", "5000",
        "--job.callbacks", "_ft_kill:KillAt",
        "--job.dump_folder", str(tmp), "--job.run_name", f"g{replica}", *extra,
    ]  # fmt: skip
    env = _env({"HP_FT_KILL": kill, "HP_FT_STEP_SLEEP": str(sleep), **(env or {})})
    proc = _hp_train(cmd[3:], env, tmp / f"g{replica}.log")
    procs.append(proc)
    return proc


def _hp_train(argv: list[str], env: dict[str, str], log: Path) -> Any:
    """``hp-train argv`` (stdout and stderr appended to ``log``) in a process forked from the
    test process's forkserver, not a new interpreter: see ``_launch_fork``."""
    return fork_helpers().ForkedHpTrain(argv, env, log)


def fork_helpers() -> Any:
    """``_launch_fork``, loaded once per process (load it before threads start groups)."""
    return load_test_module(TESTS / "_launch_fork.py", "hp_trainer_tests_launch_fork")


def _records(path: Path) -> list[dict[str, Any]]:
    """One JSON record per line; a last line cut by a kill (no newline yet) is dropped."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        lines.pop()
    return [json.loads(line) for line in lines if line.strip()]


def _trace(tmp: Path, replica: int) -> list[dict[str, Any]]:
    return _records(tmp / f"g{replica}" / "ft_trace_rank0.jsonl")


def _wait(proc: Any, timeout: float, tmp: Path, replica: int) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log = (tmp / f"g{replica}.log").read_text()[-3000:]
        raise AssertionError(
            f"replica group {replica} did not finish in {timeout} s:\n{log}"
        ) from None


def _cleanup(procs: list[Any]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()


def _until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_kill_restart_recover_bitwise(tmp_path: Path) -> None:
    """Group 1 dies four times (forward, recovery, backward, optimizer); group 0 never stops."""
    procs: list[Any] = []
    steps = 100000  # both run until stopped with SIGTERM once the last life trained in step
    lives = ["forward:3", "recovery:0", "backward:2", "optimizer:2", ""]  # every kill point
    try:
        lighthouse = _lighthouse(procs)
        survivor = _group(tmp_path, 0, lighthouse, steps, procs, sleep=0.3)
        _until(lambda: len(_trace(tmp_path, 0)) > 0, 120, "the survivor's first step")
        for kill in lives:
            victim = _group(tmp_path, 1, lighthouse, steps, procs, kill=kill)
            if kill:
                code = _wait(victim, 120, tmp_path, 1)
                assert code == -signal.SIGKILL, f"group 1 ({kill}) exited {code}, not killed"
            assert survivor.poll() is None, "the survivor stopped while group 1 was down"

        def together() -> bool:
            other = _trace(tmp_path, 1)
            heals = [i for i, r in enumerate(other) if r["healed"]]
            return bool(heals) and sum(r["committed"] for r in other[heals[-1] :]) >= 5

        _until(together, 120, "5 steps of the restarted group after its recovery")
        for proc in (victim, survivor):
            proc.send_signal(signal.SIGTERM)  # a clean stop at the next step
        assert _wait(victim, 60, tmp_path, 1) == 143
        assert _wait(survivor, 60, tmp_path, 0) == 143
    finally:
        _cleanup(procs)
    ref = _trace(tmp_path, 0)
    other = _trace(tmp_path, 1)
    committed = [r for r in ref if r["committed"]]
    # the survivor never goes back: its committed steps are 1..steps, each exactly once
    assert [r["step"] for r in committed] == list(range(1, len(committed) + 1))
    assert all(r["participants"] >= 1 for r in committed)  # min_replica_size = 1
    # the restarted group recovered from a live peer (the last life healed once)
    assert any(r["healed"] for r in other)
    # after its last recovery, group 1's parameters equal the survivor's bitwise, every step
    last_heal = max(i for i, r in enumerate(other) if r["healed"])
    mine = {r["step"]: r["params"] for r in other[last_heal:] if r["committed"]}
    theirs = {r["step"]: r["params"] for r in committed}
    # the SIGTERM may stop one group after the other group's last step: compare common steps
    common = sorted(set(mine) & set(theirs))
    assert len(common) >= 3, (sorted(mine), sorted(theirs)[-5:])
    for step in common:
        assert mine[step] == theirs[step], f"step {step}: parameters differ after recovery"
    # the data rule: committed steps tile the stream, no sample twice, none skipped
    cursor = 0
    by_step_1 = {r["step"]: r for r in other if r["committed"]}
    for r in committed:
        n = r["participants"]
        slab = set(range(cursor, cursor + n * BATCH))
        read = set(r["positions"])
        if n == 2 and r["step"] in by_step_1:
            read_1 = set(by_step_1[r["step"]]["positions"])
            assert not read & read_1
            read |= read_1
            assert read == slab, f"step {r['step']}"
        else:
            assert read <= slab
            assert len(read) == BATCH
        cursor += n * BATCH
    assert any(r["participants"] == 1 for r in committed)  # steps while group 1 was down
    assert sum(r["participants"] == 2 for r in committed) >= 3
