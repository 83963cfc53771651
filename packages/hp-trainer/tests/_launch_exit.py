"""Run by test_multinode in a process forked from a forkserver (``runpy.run_path`` with
``init_globals``): how a rank and a launcher's forkserver end.

``MODE = "release"``: what torch's wrapper does around a rank stopped by SIGTERM:
``hp_trainer.cli._leave_once_returned()`` (its fallback timer pushed out of reach), then the
wrapper's ``QUEUE.put(VALUE)`` and its wait for the agent's release (``EVENT``, never set here).
``MODE = "burn"``: spend CPU, then ``QUEUE.put`` this process's CPU seconds.
"""

from __future__ import annotations

import time


def release(queue: object, event: object, value: object) -> None:
    import hp_trainer.cli as cli

    cli._RELEASE_WAIT_S = 600.0  # only the hook on put may end this process
    cli._leave_once_returned()
    queue.put(value)  # type: ignore[attr-defined]
    event.wait()  # type: ignore[attr-defined]


def burn(queue: object) -> None:
    total = 0
    while time.process_time() < 0.4:
        total += sum(range(10000))
    queue.put(time.process_time())  # type: ignore[attr-defined]


if __name__ == "__main__":
    if globals()["MODE"] == "release":
        release(globals()["QUEUE"], globals()["EVENT"], globals()["VALUE"])
    else:
        burn(globals()["QUEUE"])
