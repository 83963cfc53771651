"""Run by ``_launch_fork`` in a process forked from the forkserver, through ``runpy.run_path``
with ``init_globals`` ``ARGV``, ``ENV``, ``LOG``, ``CPU``: ``hp-train ARGV`` with environment
``ENV``, stdout and stderr appended to ``LOG``, the process's exit status ``main``'s. Before it
exits, the process writes to ``CPU`` its CPU seconds with those of the children it waited for
(a launcher's forkserver and, through it, the ranks), which a sampler of ``/proc`` can miss: the
launcher waits for its forkserver just before it exits."""

from __future__ import annotations

import os
import sys


def _write_cpu(path: str) -> None:
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    with open(path, "w") as f:
        f.write(f"{total}\n")


def run(argv: list[str], env: dict[str, str], log: str, cpu: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.argv = ["hp-train", *argv]
    import torch

    # torch sized its intra-op pool when the forkserver imported it (from that environment);
    # an interpreter started with ENV reads OMP_NUM_THREADS from ENV
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    from hp_trainer.cli import main

    try:
        status = main(argv)
    finally:
        _write_cpu(cpu)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(status)


if __name__ == "__main__":
    run(globals()["ARGV"], globals()["ENV"], globals()["LOG"], globals()["CPU"])
