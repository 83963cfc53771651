"""One fresh interpreter answers the import questions of two tests (loaded with
``hp_dtensor.testing.load_test_module``; the answer is computed once per test process).

With every device query of torch spied on, the interpreter imports ``hp_trainer`` and
``hp_trainer.cli`` (what every rank and launcher imports), notes which heavy modules that pulled
in (test_hp_trainer_package: none of torch._dynamo, torch._inductor, pipelining, hp-pp), then
imports the rest of ``hp-train``'s forkserver preload list, torchft and what the test workers'
fork server preloads (``WORKER_PRELOAD``, given to ``preload_in_workers`` by conftest.py)
(test_multinode: no device query, which a CUDA or NPU runtime initialised in the server would
make every forked rank inherit, broken).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

#: What the test ranks import beyond the stack, once in the fork server instead of in every
#: worker of every pool (and in every hp-train process ``_launch_fork`` forks): the pipeline
#: schedules a ParallelismConfig looks up, the pieces the first aot_eager compile loads (~0.9 s
#: per process otherwise), HF datasets for streamed data, the CLI and torchft for forked runs.
WORKER_PRELOAD = (
    "hp_pp", "hp_trainer.cli", "torch._dynamo", "torch._dynamo.backends.common",
    "torch._inductor.pattern_matcher", "datasets", "torchft",
)  # fmt: skip

_CODE = """
import json
import sys
import torch

calls = []


def spy(owner, name):
    real = getattr(owner, name, None)
    if real is None:
        return

    def wrapper(*args, **kwargs):
        calls.append(f"{owner.__name__}.{name}")
        return real(*args, **kwargs)

    setattr(owner, name, wrapper)


queries = {
    torch.cuda: ["init", "_lazy_init", "is_available", "device_count", "current_device",
                 "set_device", "is_initialized"],
    torch.accelerator: ["is_available", "device_count", "current_accelerator",
                        "current_device_index", "set_device_index"],
    torch._C: ["_cuda_init", "_cuda_getDeviceCount"],
}
for owner, names in queries.items():
    for name in names:
        spy(owner, name)
import hp_trainer, hp_trainer.cli
heavy = ("torch._dynamo", "torch._inductor", "torch.distributed.pipelining", "hp_pp")
after_hp_trainer = sorted(m for m in heavy if m in sys.modules)
for module in sys.argv[1:]:
    __import__(module)
print(json.dumps({
    "heavy_after_import": after_hp_trainer,
    "imported": [m for m in sys.argv[1:] if m in sys.modules],
    "calls": calls,
}))
"""


_RUN: list[subprocess.Popen[str]] = []  # the interpreter, once started


def start() -> None:
    """Start the interpreter now, in the background (conftest.py does at collection, when a
    test that asks is selected: it runs on the core the single-process tests leave idle)."""
    if _RUN:
        return
    from hp_trainer.cli import _PRELOAD

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    wanted = [*_PRELOAD, *WORKER_PRELOAD]
    modules = [m for m in dict.fromkeys(wanted) if importlib.util.find_spec(m.split(".")[0])]
    _RUN.append(
        subprocess.Popen(
            [sys.executable, "-c", _CODE, *modules],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    )


@functools.cache
def report() -> dict[str, Any]:
    """``heavy_after_import``, ``imported`` (both preload lists, what is installed of them) and
    ``calls`` (the device queries made by all of it)."""
    start()
    try:
        out, err = _RUN[0].communicate(timeout=180)
    except subprocess.TimeoutExpired:
        _RUN[0].kill()
        raise
    assert _RUN[0].returncode == 0, err[-4000:]
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result
