"""Fault tolerance: config checks, the data rule, config fingerprints, an absent lighthouse."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from hp_dtensor.testing import load_test_module
from hp_trainer.components.ft import (
    check_fault_tolerance_layout,
    config_fingerprint,
    replica_sample_indices,
)
from hp_trainer.config import ConfigManager

FT = ["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "3"]


def test_config_values_refused_with_field_names() -> None:
    with pytest.raises(ValueError, match=r"fault_tolerance\.replica_id = 3"):
        ConfigManager().parse_args([*FT, "--fault_tolerance.replica_id", "3"])
    with pytest.raises(ValueError, match=r"fault_tolerance\.min_replica_size = 4"):
        ConfigManager().parse_args([*FT, "--fault_tolerance.min_replica_size", "4"])
    with pytest.raises(ValueError, match=r"fault_tolerance\.fragment_sync_delay = 5"):
        ConfigManager().parse_args([*FT, "--fault_tolerance.fragment_sync_delay", "5"])
    with pytest.raises(ValueError, match=r"semi_sync_method"):
        ConfigManager().parse_args([*FT, "--fault_tolerance.semi_sync_method", "sgd"])


def test_replicate_degree_inside_a_group_refused() -> None:
    cfg = ConfigManager().parse_args([*FT, "--parallelism.data_parallel_replicate_degree", "2"])
    with pytest.raises(ValueError, match="data_parallel_replicate_degree = 2"):
        check_fault_tolerance_layout(cfg)


def test_data_rule_tiles_the_stream_for_any_participants() -> None:
    # 3 groups x dp 2 x batch 2 x 2 micro-batches, then 2 groups, then 3 again
    cursor, seen = 0, []
    for n in (3, 2, 3):
        step = []
        for r in range(n):
            for d in range(2):
                step += [p for m in replica_sample_indices(cursor, r, n, d, 2, 2, 2) for p in m]
        assert sorted(step) == list(range(cursor, cursor + n * 2 * 2 * 2))
        seen += step
        cursor += n * 2 * 2 * 2
    assert sorted(seen) == list(range(cursor))  # nothing twice, nothing skipped


def test_fingerprint_names_the_differing_field() -> None:
    a = ConfigManager().parse_args([*FT, "--fault_tolerance.replica_id", "0"])
    b = ConfigManager().parse_args([*FT, "--fault_tolerance.replica_id", "1"])
    c = ConfigManager().parse_args([*FT, "--training.seq_len", "64", "--job.run_name", "x"])
    fa, fb, fc = config_fingerprint(a), config_fingerprint(b), config_fingerprint(c)
    assert fa == fb  # the replica id and per-group sections may differ
    diff = [n for n, x, y in zip(fa[0], fa[1], fc[1], strict=True) if x != y]
    assert diff == ["training.seq_len"]


def test_lighthouse_that_does_not_answer(tmp_path: Path) -> None:
    pytest.importorskip("torchft")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"http://127.0.0.1:{port}"
    # torchft's client retries a refused connection until its connect timeout: 500 ms is that
    # wait (the test's idle time), and the message must name it
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    argv = [
        "--config", "debug_ft", "--fault_tolerance.lighthouse", address,
        "--fault_tolerance.process_group_timeout_ms", "500", "--job.dump_folder", str(tmp_path),
    ]  # fmt: skip
    # hp-train in a process forked from the test process's forkserver (no interpreter start)
    fork = load_test_module(
        Path(__file__).with_name("_launch_fork.py"), "hp_trainer_tests_launch_fork"
    )
    log = tmp_path / "hp-train.log"
    proc = fork.ForkedHpTrain(argv, env, log)
    try:
        assert proc.wait(timeout=120) != 0
    finally:
        proc.kill()
    assert f"the torchft lighthouse at {address} did not answer within 500 ms" in log.read_text()
