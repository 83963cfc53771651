"""One fresh interpreter answers the import questions of two tests (loaded with
``hp_dtensor.testing.load_test_module``; the answer is computed once per test process).

With every device query of torch spied on, the interpreter imports ``hp_trainer`` and
``hp_trainer.cli`` (what every rank and launcher imports), notes which heavy modules that pulled
in (test_hp_trainer_package: none of torch._dynamo, torch._inductor, pipelining, hp-pp), then
imports the rest of ``hp-train``'s forkserver preload list and torchft (test_multinode: no device
query, which a CUDA or NPU runtime initialised in the server would make every forked rank
inherit, broken).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

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


@functools.cache
def report() -> dict[str, Any]:
    """``heavy_after_import``, ``imported`` (the preload list and torchft) and ``calls`` (the
    device queries made by all of it)."""
    from hp_trainer.cli import _PRELOAD

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    modules = [*_PRELOAD, *(["torchft"] if importlib.util.find_spec("torchft") else [])]
    done = subprocess.run(
        [sys.executable, "-c", _CODE, *modules],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
