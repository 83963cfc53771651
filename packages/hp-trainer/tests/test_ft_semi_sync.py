"""LocalSGD and DiLoCo through torchft: 2 replica groups x FSDP 2 (real hp-train processes).

Each rank of a group is an ``hp-train`` process forked from the test process's forkserver with
the environment a launcher gives it (``_launch_fork.ForkedRanks``: env://, no agent, no second
forkserver importing the stack per group). The launcher with fault tolerance is covered by the
one-rank groups of test_ft_recovery / test_ft_loss_curve, the refused-at-quorum test here and
test_multinode / test_trainer_resume. The lighthouse is hosted by the test process, except in
the refused-at-quorum test, which runs ``hp-train --lighthouse``.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from hp_dtensor.testing import run_distributed

pytest.importorskip("torchft")

_spec = importlib.util.spec_from_file_location(
    "hp_trainer_tests_ft_procs", Path(__file__).with_name("test_ft_recovery.py")
)
assert _spec is not None
assert _spec.loader is not None
_procs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_procs)
_cleanup, _env, _lighthouse, _wait = _procs._cleanup, _procs._env, _procs._lighthouse, _procs._wait
# each group's hp-train forks from the test process's forkserver
_hp_train = _procs._hp_train


def _fsdp2_group(argv: list[str], log: Path) -> Any:
    """The 2 ranks of one replica group (FSDP 2), forked with a launcher's environment."""
    return _procs.fork_helpers().ForkedRanks(2, argv, _env(), log)


def _traces(tmp: Path, replica: int, rank: int) -> list[dict[str, Any]]:
    path = tmp / f"g{replica}" / f"ft_trace_rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("method", ["local_sgd", "diloco"])
def test_replicas_equal_after_each_sync(tmp_path: Path, method: str) -> None:
    steps, sync = 4, 2  # two syncs, and a step between syncs before each
    procs: list[Any] = []
    try:
        lighthouse = _lighthouse(procs, min_replicas=2)
        groups = []
        for replica in (0, 1):
            cmd = [
                sys.executable, "-m", "hp_trainer.cli", "--config", "debug_ft",
                "--parallelism.data_parallel_shard_degree", "2",
                "--training.steps", str(steps), "--metrics.log_freq", "1000",
                "--metrics.enable_plot", "false",
                "--fault_tolerance.group_size", "2", "--fault_tolerance.min_replica_size", "2",
                "--fault_tolerance.replica_id", str(replica),
                "--fault_tolerance.lighthouse", lighthouse,
                "--fault_tolerance.trace", "true",
                "--fault_tolerance.semi_sync_method", method,
                "--fault_tolerance.sync_steps", str(sync),
                "--job.dump_folder", str(tmp_path), "--job.run_name", f"g{replica}",
            ]  # fmt: skip
            proc = _fsdp2_group(cmd[3:], tmp_path / f"g{replica}.log")
            procs.append(proc)
            groups.append(proc)
        for replica, proc in enumerate(groups):
            assert _wait(proc, 240, tmp_path, replica) == 0
    finally:
        _cleanup(procs)
    for rank in (0, 1):  # FSDP rank r of group 0 against FSDP rank r of group 1
        a, b = _traces(tmp_path, 0, rank), _traces(tmp_path, 1, rank)
        assert [r["step"] for r in a] == list(range(1, steps + 1))
        for ra, rb in zip(a, b, strict=True):
            if ra["step"] % sync == 0:  # after a sync: bitwise equal
                assert ra["params"] == rb["params"], (rank, ra["step"])
            else:  # between syncs each group trains on its own data
                assert ra["params"] != rb["params"], (rank, ra["step"])
        assert a[-1]["manager_step"] == steps // sync  # one committed sync each
    # the two FSDP ranks of one group hold different shards
    assert _traces(tmp_path, 0, 0)[-1]["params"] != _traces(tmp_path, 0, 1)[-1]["params"]


def test_mismatched_config_refused_at_quorum(tmp_path: Path) -> None:
    """Group 1 runs another sequence length: refused at the first quorum, the field named.

    The lighthouse here is the real ``hp-train --lighthouse`` command (the other tests host it
    in the test process): it serves the quorum, then stops with status 0 on SIGTERM.
    """
    procs: list[Any] = []
    try:
        lighthouse = _lighthouse(procs, min_replicas=2, command=True)
        groups = []
        for replica, seq_len in ((0, "32"), (1, "64")):
            cmd = [
                sys.executable, "-m", "hp_trainer.cli", "--config", "debug_ft",
                "--training.steps", "3", "--training.seq_len", seq_len,
                "--fault_tolerance.group_size", "2", "--fault_tolerance.min_replica_size", "2",
                "--fault_tolerance.replica_id", str(replica),
                "--fault_tolerance.lighthouse", lighthouse,
                "--fault_tolerance.quorum_timeout_ms", "20000",
                "--job.dump_folder", str(tmp_path), "--job.run_name", f"g{replica}",
            ]  # fmt: skip
            proc = _hp_train(cmd[3:], _env(), tmp_path / f"g{replica}.log")
            procs.append(proc)
            groups.append(proc)
        assert _wait(groups[1], 240, tmp_path, 1) != 0
        log = (tmp_path / "g1.log").read_text()
        assert "replica group 1 was refused at the quorum" in log
        assert "differs from replica group at quorum rank 0 in training.seq_len" in log
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=60) == 0  # the lighthouse stops cleanly
    finally:
        _cleanup(procs)


def _losses(tmp: Path, run: str) -> list[float]:
    rows = [json.loads(line) for line in (tmp / run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _train_in_pool(argv: list[str]) -> list[float]:
    from hp_trainer import ConfigManager, Trainer

    trainer = Trainer(ConfigManager().parse_args(argv))
    try:
        return trainer.train()
    finally:
        trainer.close()


def test_two_groups_of_fsdp2_equal_one_fsdp4_job(tmp_path: Path) -> None:
    """The oracle of the synchronous mode: 2 groups x FSDP 2 = a plain FSDP 4 job (same data)."""
    steps = 4
    common = [
        sys.executable, "-m", "hp_trainer.cli", "--config", "debug_ft",
        "--training.steps", str(steps), "--metrics.log_freq", "1",
        "--metrics.enable_plot", "false", "--job.dump_folder", str(tmp_path),
    ]  # fmt: skip
    procs: list[Any] = []
    try:
        lighthouse = _lighthouse(procs, min_replicas=2)
        runs = []
        for replica in (0, 1):
            ft = [
                "--parallelism.data_parallel_shard_degree", "2",
                "--fault_tolerance.group_size", "2", "--fault_tolerance.min_replica_size", "2",
                "--fault_tolerance.replica_id", str(replica),
                "--fault_tolerance.lighthouse", lighthouse, "--job.run_name", f"g{replica}",
            ]  # fmt: skip
            proc = _fsdp2_group([*common[3:], *ft], tmp_path / f"g{replica}.log")
            procs.append(proc)
            runs.append(proc)
        # the plain FSDP 4 job runs on the warm 4-rank pool meanwhile (no launcher, no 4 new
        # interpreters): the same options as the groups', without fault tolerance
        plain = [
            *common[3:], "--parallelism.data_parallel_shard_degree", "4",
            "--fault_tolerance.enable", "false", "--job.run_name", "g2",
        ]  # fmt: skip
        single = run_distributed(_train_in_pool, 4, plain, timeout=400)[0]
        for i, proc in enumerate(runs):
            assert _wait(proc, 400, tmp_path, i) == 0
    finally:
        _cleanup(procs)
    g0, g1 = _losses(tmp_path, "g0"), _losses(tmp_path, "g1")
    assert single == _losses(tmp_path, "g2")  # what train() returned is what it logged
    assert len(single) == steps
    # each group logs the mean over its own samples (equal token counts): their average is
    # the job's loss
    mean = [(a + b) / 2 for a, b in zip(g0, g1, strict=True)]
    assert mean == pytest.approx(single, rel=1e-5, abs=1e-6)
    assert g0 != g1  # the groups read different samples
