"""Warm pools of gloo worker processes, one pool alive at a time."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import socket
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from hp_dtensor.testing import _fork_server
from hp_dtensor.testing._worker import worker_main

#: Seconds a pool may take to start (imports and rendezvous of every rank).
START_TIMEOUT_S = 180.0
#: Seconds the other ranks get to answer once one rank has failed, before the pool is rebuilt.
FAILURE_GRACE_S = 5.0


class DistributedTestError(AssertionError):
    """A test function failed on some rank; the message names each rank and its traceback."""


class DistributedTestTimeoutError(DistributedTestError):
    """A test function did not finish on every rank within its timeout (e.g. a hung collective)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class PoolStats:
    """What the pools of this process cost: start-ups and jobs run."""

    starts: list[tuple[int, float]] = field(default_factory=list)
    jobs: int = 0
    rebuilds: int = 0
    #: pools replaced because a worker had leaked threads of destroyed gloo groups
    renewals: int = 0
    #: CPU seconds the workers spent in successful jobs, all ranks together (the load-independent
    #: cost of the distributed tests; wall time on a loaded machine is not)
    worker_cpu_s: float = 0.0
    #: successful jobs after which the workers kept DTensor's sharding caches (and meshes) for
    #: the next job, and after which they cleared them (a group destroyed, a rule registered...)
    caches_kept: int = 0
    caches_cleared: int = 0
    #: why they were cleared, and how often
    clear_reasons: dict[str, int] = field(default_factory=dict)
    #: sharding propagations rank 0 computed in those jobs (misses of DTensor's cache): a count
    #: of what the kept caches save that the machine's load does not move
    sharding_propagations: int = 0


class WorkerPool:
    """``world_size`` worker processes, each one rank of a gloo default process group.

    Jobs are module-level functions, sent by reference (module name, file and qualified name) and
    run on every rank. A failing or hung job kills the pool; the next job starts a fresh one.
    """

    def __init__(self, world_size: int, stats: PoolStats) -> None:
        ctx = mp.get_context("forkserver")
        # The fork server imports torch, the stack and what the session asked for once (the
        # pytest plugin starts it after collection): a replaced pool starts warm.
        _fork_server.start()
        start = time.perf_counter()
        port = _free_port()
        self.world_size = world_size
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._stats = stats
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(rank, world_size, port, child_conn, list(sys.path)),
                name=f"hp-testing-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        self.alive = True
        #: closed because a worker wore out (leaked threads), not because a job failed
        self.renewed = False
        replies = self._collect(START_TIMEOUT_S, "pool start-up")
        for rank, (kind, payload) in enumerate(replies):
            if kind != "ready":
                self.close()
                raise DistributedTestError(f"rank {rank} failed to start:\n{payload}")
        stats.starts.append((world_size, time.perf_counter() - start))

    def _collect(self, timeout: float, what: str) -> list[tuple[Any, ...]]:
        replies: dict[int, tuple[Any, ...]] = {}
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self._conns))
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while pending:
            if any(reply[0] == "err" for reply in replies.values()):
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = wait([*pending.values(), *sentinels], timeout=remaining)
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels.pop(obj)
                    if rank in pending:
                        conn = pending[rank]
                        if conn.poll():
                            replies[rank] = conn.recv()
                        else:
                            code = self._procs[rank].exitcode
                            replies[rank] = ("err", f"worker process died (exit code {code})")
                        del pending[rank]
                    continue
                rank = next(r for r, c in pending.items() if c is obj)
                try:
                    replies[rank] = pending.pop(rank).recv()
                except EOFError:
                    replies[rank] = ("err", "worker process closed its pipe (it died)")
        if pending:
            errors = {r: v for r, v in replies.items() if v[0] == "err"}
            self.close()
            if errors:
                raise DistributedTestError(_format_errors(errors, hung=sorted(pending)))
            raise DistributedTestTimeoutError(
                f"{what} timed out after {timeout:.1f} s: rank(s) {sorted(pending)} of "
                f"{self.world_size} did not finish (a hung collective?); "
                f"rank(s) {sorted(replies)} finished. The pool was killed and will be rebuilt."
            )
        return [replies[r] for r in range(self.world_size)]

    def run(
        self,
        module: str,
        file: str | None,
        qualname: str,
        args: Any,
        kwargs: Any,
        timeout: float,
        options: dict[str, Any] | None = None,
    ) -> list[Any]:
        payload = pickle.dumps((args, kwargs))
        for conn in self._conns:
            conn.send((module, file, qualname, payload, options or {}))
        replies = self._collect(timeout, f"{qualname} on {self.world_size} ranks")
        errors = {r: v for r, v in enumerate(replies) if v[0] == "err"}
        if errors:
            # A failed rank may leave collectives half-done on the others: start afresh next time.
            self.close()
            raise DistributedTestError(_format_errors(errors, hung=[]))
        self._stats.worker_cpu_s += sum(reply[3] for reply in replies)
        self._stats.sharding_propagations += replies[0][5]
        if replies[0][4]:
            self._stats.caches_cleared += 1
            reasons = self._stats.clear_reasons
            reasons[replies[0][4]] = reasons.get(replies[0][4], 0) + 1
        else:
            self._stats.caches_kept += 1
        if any(reply[2] for reply in replies):  # a worn worker: the next job gets a fresh pool
            self._stats.renewals += 1
            self.renewed = True
            self.close()
        return [pickle.loads(reply[1]) for reply in replies]

    def close(self) -> None:
        """Stop the workers: politely when idle, by SIGKILL when they do not exit at once."""
        if not self.alive:
            return
        self.alive = False
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self._procs:
            proc.join(timeout=2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self._conns:
            conn.close()


def _format_errors(errors: dict[int, tuple[str, Any]], hung: list[int]) -> str:
    lines = [f"failed on rank(s) {sorted(errors)}" + (f"; rank(s) {hung} hung" if hung else "")]
    for rank in sorted(errors):
        lines.append(f"--- rank {rank} ---\n{errors[rank][1]}")
    return "\n".join(lines)


class PoolManager:
    """Owns the single live pool of this process and its statistics."""

    def __init__(self) -> None:
        self.pool: WorkerPool | None = None
        self.stats = PoolStats()

    def get(self, world_size: int) -> WorkerPool:
        if self.pool is not None and (not self.pool.alive or self.pool.world_size != world_size):
            if not self.pool.alive and not self.pool.renewed:
                self.stats.rebuilds += 1
            self.pool.close()
            self.pool = None
        if self.pool is None:
            self.pool = WorkerPool(world_size, self.stats)
        return self.pool

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


MANAGER = PoolManager()


def in_worker() -> bool:
    """Whether this process is a worker of a pool."""
    return os.environ.get("HP_DTENSOR_TESTING_WORKER") == "1"
