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
(until the forkserver has reaped it: a zombie's reading is its final one) and, once the process
has ended, adds the last reading to ``pool_stats().worker_cpu_s``, which the test-time plugin
adds to each test's CPU seconds. The forkserver's own start (an interpreter importing the
stack, ~3 CPU s) is paid once per pytest session, by whichever starts it first (this or a pool).
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hp_dtensor.testing import pool_stats

# What a group process imports, once, in the forkserver, when this call starts it (else the
# server hp_dtensor.testing's pools started serves, with the stack preloaded): a superset of
# the pools' list, since the pools fork from the same server.
_PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.tensor", "hp_dtensor", "hp_trainer",
    "hp_trainer.cli", "torchft",
]  # fmt: skip
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
        from multiprocessing import forkserver

        if getattr(forkserver, "_forkserver", None) is None or not getattr(
            forkserver._forkserver, "_forkserver_pid", None
        ):
            loaded = [name for name in _PRELOAD if name in sys.modules or name == "hp_trainer.cli"]
            ctx.set_forkserver_preload(loaded)
        values = {"ARGV": list(argv), "ENV": dict(env), "LOG": str(log)}
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
