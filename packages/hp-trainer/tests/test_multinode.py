"""Multi-node launch: two hp-train "nodes" of 2 ranks on 127.0.0.1 form one 4-rank job.

Each node is ``hp-train`` (``hp_trainer.cli.main``: the launcher, its rendezvous and its own
forkserver) in a process forked from the test process's forkserver (``_launch_fork``), not a new
interpreter; the console script from a fresh interpreter is run by ``scripts/check_install.py``
(CI's install-check) and ``python -m hp_trainer.cli --lighthouse`` by test_ft_semi_sync.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from hp_dtensor.testing import load_test_module
from hp_trainer import ConfigManager, Trainer, load_documents
from hp_trainer.cli import LaunchOptions, main, split_launch_options

_ARGS = [
    "--config", "debug", "--model.flavor", "tiny", "--training.steps", "5",
    "--training.seq_len", "32", "--training.local_batch_size", "2",
    "--training.mixed_precision_param", "float32", "--parallelism.tensor_parallel_degree", "1",
    "--metrics.log_freq", "1", "--metrics.enable_plot", "false",
    "--metrics.enable_progress_bar", "false", "--training.seed", "0",
]  # fmt: skip


def _hp_train(folder: Path, run: str, log: Path, *extra: str) -> Any:
    """``hp-train`` forked from the test process's forkserver, its output in ``log``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    argv = [
        *_ARGS, "--parallelism.data_parallel_shard_degree", "4", "--data.dataset",
        str(folder / "corpus.txt"), "--job.dump_folder", str(folder), "--job.run_name", run,
        *extra,
    ]  # fmt: skip
    fork = load_test_module(
        Path(__file__).with_name("_launch_fork.py"), "hp_trainer_tests_launch_fork"
    )
    return fork.ForkedHpTrain(argv, env, log)


def _fresh_imports() -> Any:
    return load_test_module(Path(__file__).with_name("_fresh_imports.py"), "hp_trainer_tests_fresh")


def _losses(folder: Path, run: str) -> list[float]:
    lines = (folder / run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


@pytest.mark.slow
def test_two_nodes_on_localhost_train_like_one(tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_text(
        "\n".join(load_documents("tiny_stories_synth")[:200]) + "\n"
    )
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rdzv = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "t"]
    # node 1 names its ranks with --nproc (it reaches the ranks, not torchrun's own parser)
    nproc = {0: (), 1: ("--nproc", "2")}
    logs = [tmp_path / f"node{r}.log" for r in (0, 1)]
    nodes = [
        _hp_train(tmp_path, "two", logs[r], *rdzv, "--node-rank", str(r), *nproc[r]) for r in (0, 1)
    ]
    try:
        codes = [node.wait(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait(timeout=60)
    outputs = [log.read_text() for log in logs]
    for code, out in zip(codes, outputs, strict=True):
        assert code == 0, out[-4000:]
        assert "starting 2 local ranks" in out
        assert "rendezvous at 127.0.0.1" in out
    assert any("world 4 on cpu" in out for out in outputs)  # one job of 4 ranks
    # the oracle: one process with the whole global batch (a one-node 4-rank run equals it to
    # float rounding, see test_trainer_parity), built from the same options
    config = ConfigManager().parse_args(
        [*_ARGS, "--data.dataset", str(tmp_path / "corpus.txt"), "--job.dump_folder",
         str(tmp_path), "--job.run_name", "one", "--training.local_batch_size", "8",
         "--parallelism.data_parallel_shard_degree", "1"]
    )  # fmt: skip
    trainer = Trainer(config)
    try:
        one = trainer.train()
    finally:
        trainer.close()
    two = _losses(tmp_path, "two")
    assert len(two) == 5
    torch.testing.assert_close(two, one, rtol=1e-5, atol=0)


def test_rendezvous_options_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    options, rest = split_launch_options(
        ["--nnodes=2", "--config", "debug", "--rdzv-endpoint", "h:29500", "--node-rank", "1"]
    )
    assert options == LaunchOptions(2, 1, "h:29500", "hp-train")
    assert rest == ["--config", "debug"]
    assert main(["--config", "debug", "--nnodes", "2"]) == 2
    assert "--nnodes 2 needs --rdzv-endpoint HOST:PORT" in capsys.readouterr().err
    assert main(["--config", "debug", "--nnodes", "3", "--rdzv-endpoint", "h:1"]) == 2
    assert "4 ranks, which 3 nodes cannot share equally" in capsys.readouterr().err
    assert main(["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"]) == 2
    assert "expected 0 <= rank < nnodes" in capsys.readouterr().err


def test_forkserver_preload_queries_no_device() -> None:
    """What ``hp-train``'s forkserver imports before it forks the ranks asks nothing of a device.

    A CUDA (or NPU) runtime initialised in the server would be inherited, broken, by every rank
    forked from it; the ranks pick their devices after the fork, as under torchrun. A fresh
    interpreter imports hp_trainer, then the preload list, with every device query of torch
    spied on (``_fresh_imports``, shared with test_hp_trainer_package). The same holds for what
    the test workers' fork server preloads (``_fresh_imports.WORKER_PRELOAD``).
    """
    fresh = _fresh_imports()
    report = fresh.report()
    assert report["calls"] == [], report
    from hp_trainer.cli import _PRELOAD

    assert set(_PRELOAD) <= set(report["imported"]), report
    installed = [m for m in fresh.WORKER_PRELOAD if importlib.util.find_spec(m.split(".")[0])]
    assert set(installed) <= set(report["imported"]), report


def test_a_rank_sees_a_local_peer_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose collective failed checks whether a local peer ended first (then it waits
    for the agent, which reports that peer): the peers are its parent's (the forkserver's)
    other children. Here the "forkserver" is a shell with two sleeping children."""
    import time

    from hp_trainer.cli import _local_rank_gone

    shell = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"])
    try:
        deadline = time.monotonic() + 30
        while len(_children(shell.pid)) < 2:
            assert time.monotonic() < deadline, "the shell started no children"
            time.sleep(0.01)
        monkeypatch.setattr(os, "getppid", lambda: shell.pid)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert not _local_rank_gone()  # both "ranks" alive
        os.kill(_children(shell.pid)[0], signal.SIGKILL)
        while len(_children(shell.pid)) > 1:  # reaped by the shell (a zombie counts as gone)
            if _local_rank_gone():
                break
            assert time.monotonic() < deadline, "the killed child stayed"
            time.sleep(0.01)
        assert _local_rank_gone()
    finally:
        for pid in _children(shell.pid):
            os.kill(pid, signal.SIGKILL)
        shell.kill()
        shell.wait()


def _children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent and fields[0] != "Z":
                found.append(int(entry.name))
    return sorted(found)


def _run_exit_helper(ctx: Any, **values: Any) -> Any:
    """``_launch_exit.py`` in a process of ``ctx`` (a forkserver context)."""
    import runpy

    helper = str(Path(__file__).with_name("_launch_exit.py"))
    proc = ctx.Process(
        target=runpy.run_path,
        args=(helper,),
        kwargs={"init_globals": values, "run_name": "__main__"},
    )
    proc.start()
    return proc


def test_a_rank_stopped_by_sigterm_leaves_once_its_value_is_written() -> None:
    """A rank stopped by SIGTERM ends as soon as torch's wrapper has put its return value in the
    agent's pipe, not when the agent releases it (a stopping agent never does) nor after a
    fixed wait: the value is readable after the process ended, with exit status 0."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")  # the test process's (stack preloaded)
    queue, never = ctx.SimpleQueue(), ctx.Event()
    proc = _run_exit_helper(ctx, MODE="release", QUEUE=queue, EVENT=never, VALUE={"rank": 3})
    try:
        proc.join(60)
        assert proc.exitcode == 0, f"still waiting for the agent's release: {proc.exitcode}"
        assert not queue.empty()
        assert queue.get() == {"rank": 3}  # left after the write, not before
    finally:
        if proc.exitcode is None:
            proc.kill()
            proc.join(10)


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended and been reaped (a zombie still has its /proc entry)."""
    return not Path(f"/proc/{pid}").exists()


def test_the_launcher_kills_its_idle_forkserver_and_keeps_the_ranks_cpu_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The launcher's forkserver, once the agent joined every rank, is killed and reaped rather
    than left to tear its interpreter down; the ranks' CPU seconds (reaped by the server) still
    count as the launcher's children's. A server that still has a child is not killed."""
    import multiprocessing
    import resource
    import time
    from multiprocessing import forkserver

    from hp_trainer import cli

    server = forkserver.ForkServer()  # a server of its own: the test process's stays untouched
    monkeypatch.setattr(forkserver, "_forkserver", server)
    for name in ("ensure_running", "get_inherited_fds", "connect_to_new_process"):
        monkeypatch.setattr(forkserver, name, getattr(server, name))
    ctx = multiprocessing.get_context("forkserver")
    sent: list[tuple[int, int]] = []
    real_kill = os.kill

    def spy(pid: int, sig: int) -> None:
        sent.append((pid, sig))
        real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", spy)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    queue = ctx.SimpleQueue()
    rank = _run_exit_helper(ctx, MODE="burn", QUEUE=queue)
    rank.join(120)
    assert rank.exitcode == 0
    rank_cpu = queue.get()
    pid = server._forkserver_pid
    assert pid is not None
    cli._reap_forkserver()
    assert sent == [(pid, signal.SIGKILL)]
    assert _gone(pid)  # reaped: no zombie left
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    spent = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert spent >= rank_cpu * 0.9, (spent, rank_cpu)

    # a server with a child still running (a rank the agent gave up on) is not killed: it is
    # left after the timeout, and ends by itself once its last child is gone
    sent.clear()
    sleeper = ctx.Process(target=time.sleep, args=(60,))
    sleeper.start()
    pid = server._forkserver_pid
    assert pid is not None
    try:
        cli._reap_forkserver(timeout=0.2)
        assert (pid, signal.SIGKILL) not in sent
        assert not _gone(pid)
    finally:
        real_kill(sleeper.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not os.waitpid(pid, os.WNOHANG)[0]:
        assert time.monotonic() < deadline, "the forkserver did not end after its last child"
        time.sleep(0.02)
