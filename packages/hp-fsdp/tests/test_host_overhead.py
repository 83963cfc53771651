"""Host work of an hp-fsdp training step against torch FSDP2's (counts, not times).

On an accelerator the host issues kernels ahead of the device; every Python call and every op
dispatched by the FSDP hooks is time the host is not issuing compute. These tests count, over
one forward and backward at world size 3 (same model, mesh and data for both engines):

- ops dispatched (a ``TorchDispatchMode``): hp-fsdp dispatches fewer than torch's FSDP2;
- profiler ranges: none while no profiler records (``record_function`` dispatches an enter
  and an exit op even then; hp-fsdp opens its ``FSDP::`` ranges only under a profiler, which
  ``test_profiler_ranges`` checks);
- Python calls in the FSDP engine (``sys.setprofile``): well under torch's.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed.fsdp as torch_fsdp
from torch.utils._python_dispatch import TorchDispatchMode

import hp_fsdp
from hp_dtensor.testing import distributed, load_test_module


def _helpers() -> ModuleType:
    return load_test_module(Path(__file__).with_name("_fsdp_helpers.py"), "hp_fsdp_tests_helpers")


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.total = 0
        self.ranges = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.total += 1
        if str(func).startswith("profiler._record_function_enter"):
            self.ranges += 1
        return func(*args, **(kwargs or {}))


def _engine_calls(run: Callable[[], None], markers: tuple[str, ...]) -> int:
    count = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event == "call" and any(m in frame.f_code.co_filename for m in markers):
            count += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return count


@distributed(world_size=3, timeout=120)
def test_step_host_work_below_torch() -> None:
    h = _helpers()
    cfg = h.Config(mesh_shape=(3,))
    mesh = h.build_mesh(cfg.mesh_shape)
    torch.manual_seed(0)
    base = h.TinyLM()
    figures: dict[str, dict[str, int]] = {}
    for name, api, markers in (
        ("hp", hp_fsdp, ("hp_fsdp", "hp_kernels", "hp_dtensor")),
        ("torch", torch_fsdp, ("_fully_shard", "_composable")),
    ):
        model = copy.deepcopy(base)
        h.apply_sharding(model, api, cfg, mesh)
        batch = h.make_batch(torch.distributed.get_rank())

        def step(model: torch.nn.Module = model, batch: Any = batch) -> None:
            h.loss_fn(model, batch).backward()
            model.zero_grad(set_to_none=True)

        step()  # lazy init and the prefetch orders
        ops = _Ops()
        with ops:
            step()
        figures[name] = {
            "ops": ops.total,
            "ranges": ops.ranges,
            "engine_calls": _engine_calls(step, markers),
        }
    hp, theirs = figures["hp"], figures["torch"]
    assert hp["ranges"] == 0, figures
    assert theirs["ranges"] > 0, figures  # the counter sees torch's ranges
    assert hp["ops"] < theirs["ops"], figures
    assert hp["engine_calls"] < 0.75 * theirs["engine_calls"], figures
