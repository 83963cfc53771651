"""``hp-train --lighthouse``: run torchft's lighthouse in this process."""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

__all__ = ["run_lighthouse"]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hp-train --lighthouse")
    parser.add_argument("--min_replicas", type=int, default=1)
    parser.add_argument("--bind", default="[::]:29510")
    parser.add_argument("--join_timeout_ms", type=int, default=60000)
    parser.add_argument("--quorum_tick_ms", type=int, default=100)
    parser.add_argument("--heartbeat_timeout_ms", type=int, default=5000)
    args = parser.parse_args(argv)
    if args.min_replicas < 1:
        parser.error(f"--min_replicas {args.min_replicas}: expected at least 1")
    return args


def _start_lighthouse(argv: list[str]) -> Any:
    """Start torchft's lighthouse server from ``hp-train --lighthouse`` options, in the calling
    process, and return it (``address()``, ``shutdown()``); its threads are torchft's own, so
    a test process can host it instead of starting an interpreter for it."""
    args = _parse(argv)  # a bad option fails before torchft is imported
    from torchft.coordination import LighthouseServer  # type: ignore[import-untyped]

    return LighthouseServer(
        bind=args.bind,
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )


def run_lighthouse(argv: list[str]) -> int:
    """Run torchft's lighthouse until SIGINT/SIGTERM (``hp-train --lighthouse [options]``).

    Options: ``--min_replicas N`` (default 1), ``--bind HOST:PORT`` (default ``[::]:29510``;
    port 0 picks a free one), ``--join_timeout_ms`` (default 60000: how long a quorum waits for
    stragglers that heartbeat), ``--quorum_tick_ms`` (default 100), ``--heartbeat_timeout_ms``
    (default 5000: a group silent that long is dead). The first line printed is
    ``lighthouse: http://HOST:PORT``; pass that address to every replica group as
    ``--fault_tolerance.lighthouse`` or ``$TORCHFT_LIGHTHOUSE``.

    Args:
        argv: The options after ``--lighthouse``.

    Returns:
        0 after a signal stopped it.

    See Also:
        The ``torchft_lighthouse`` command of torchft (the same server).
    """
    server = _start_lighthouse(argv)
    print(f"lighthouse: {server.address()}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0
