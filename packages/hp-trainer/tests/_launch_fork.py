"""Test helper: ``hp-train`` processes forked from the test process's forkserver.

``ForkedHpTrain(argv, env, log)`` runs ``hp_trainer.cli.main(argv)`` in a process of its own,
as ``python -m hp_trainer.cli`` does, without starting an interpreter: it forks from the
multiprocessing forkserver of the test process (the one ``hp_dtensor.testing``'s pools fork
from), which imported torch and the training stack once. The process has its own environment,
stdout and stderr appended to ``log``, a real exit status (``sys.exit(main(argv))``; ``-9``
when SIGKILLed) and the ``Popen`` methods the fault-tolerance tests use. The interpreter start
of ``python -m hp_trainer.cli`` stays covered by the tests that still run it (test_multinode,
test_trainer_resume, test_ft_semi_sync's refused-at-quorum test).

CPU seconds: the process is the forkserver's child, not this one's, so its CPU time is not in
this process's ``RUSAGE_CHILDREN``. A sampler thread reads ``/proc/<pid>/stat`` every 20 ms
(until the forkserver has reaped it: a zombie's reading is its final one); the process also
writes its final figure (with its waited-for children: a launcher reaps its forkserver, and
through it the ranks, just before it exits, which the sampler can miss) to ``<log>.cpu``. Once
the process has ended, the larger of the two is added to ``pool_stats().worker_cpu_s``, which
the test-time plugin adds to each test's CPU seconds. The forkserver's own start (an
interpreter importing the stack, ~3 CPU s) is paid once per pytest session, by whichever
starts it first (this or a pool).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import runpy
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from hp_dtensor.testing import pool_stats, start_fork_server

_TICKS = os.sysconf("SC_CLK_TCK")
_CHILD = Path(__file__).with_name("_launch_child.py")
_SAMPLE_S = 0.02
_CHARGE = threading.Lock()  # tests may wait for several processes from several threads


def _cpu_seconds(pid: int) -> tuple[float, str] | None:
    """CPU seconds of ``pid`` (with its waited-for children) and its start time, if it exists."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # stat fields 14-17: utime, stime, cutime, cstime; 22: starttime (fields[0] is field 3)
    return sum(int(v) for v in fields[11:15]) / _TICKS, fields[19]


class ForkedHpTrain:
    """``hp-train <argv>`` in a process forked from the forkserver (see the module doc)."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        ctx = multiprocessing.get_context("forkserver")
        # the server the pools fork from, with the session's preload (conftest.py adds the CLI,
        # torchft, torch._dynamo and the tokenized corpus, which each process would build)
        start_fork_server()
        self._cpu_file = log.with_name(f"{log.name}.cpu")
        self._cpu_file.unlink(missing_ok=True)
        values = {"ARGV": list(argv), "ENV": dict(env), "LOG": str(log), "CPU": str(self._cpu_file)}
        self._proc: Any = ctx.Process(
            target=runpy.run_path,
            args=(str(_CHILD),),
            kwargs={"init_globals": values, "run_name": "__main__"},
        )
        self._proc.start()
        self.pid: int = self._proc.pid
        self._cpu = 0.0
        self._charged = False
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        # until /proc/<pid> is gone (reaped by the forkserver); a zombie's reading is its last
        started = None
        while (reading := _cpu_seconds(self.pid)) is not None:
            cpu, start = reading
            if started is None:
                started = start
            elif start != started:  # the pid was reused after the process was reaped
                return
            self._cpu = max(self._cpu, cpu)
            time.sleep(_SAMPLE_S)

    def _ended(self) -> int:
        code: int = self._proc.exitcode
        if not self._charged:
            self._sampler.join()
            # what the process counted at its end (absent when it was killed)
            with contextlib.suppress(OSError, ValueError):
                self._cpu = max(self._cpu, float(self._cpu_file.read_text()))
            with _CHARGE:
                if not self._charged:
                    pool_stats().worker_cpu_s += self._cpu
                    self._charged = True
        return code

    def poll(self) -> int | None:
        if self._proc.exitcode is None:
            return None
        return self._ended()

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"hp-train (pid {self.pid})", timeout or 0.0)
        return self._ended()

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedRanks:
    """The ``nranks`` ranks of one ``hp-train <argv>`` job as a launcher would start them
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``: env://), each a
    :class:`ForkedHpTrain`, without the launcher: no agent, no rendezvous and no second
    forkserver (an interpreter importing the stack, ~2.8 CPU s per job). For tests whose
    subject is not the launcher; rank 0 writes ``log``, rank ``r`` ``<log>.rank<r>``.

    The ``Popen`` methods act on every rank: ``wait``/``poll`` give rank 0's status once every
    rank has ended (the first non-zero status if rank 0's is zero).
    """

    def __init__(self, nranks: int, argv: list[str], env: dict[str, str], log: Path) -> None:
        import socket

        with socket.socket() as s:  # rank 0's store binds it again at once
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.ranks = []
        for rank in range(nranks):
            rank_env = dict(
                env,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(nranks),
                LOCAL_WORLD_SIZE=str(nranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            path = log if rank == 0 else log.with_name(f"{log.name}.rank{rank}")
            self.ranks.append(ForkedHpTrain(argv, rank_env, path))
        self.pid = self.ranks[0].pid

    def _status(self, codes: list[int]) -> int:
        return codes[0] or next((code for code in codes if code), 0)

    def poll(self) -> int | None:
        codes = [rank.poll() for rank in self.ranks]
        if any(code is None for code in codes):
            return None
        return self._status([code for code in codes if code is not None])

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        codes = []
        for rank in self.ranks:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            codes.append(rank.wait(left))
        return self._status(codes)

    def send_signal(self, sig: int) -> None:
        for rank in self.ranks:
            rank.send_signal(sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
