"""Host-sync budget of an hp-fsdp training step (counts, not times).

``hp_dtensor.testing.count_host_syncs`` counts what would stop the host on an accelerator
(``.item()``, ``nonzero``, device-to-host copies, tensors built from Python data, ...). FSDP's
forward and backward must have none: the host then runs ahead and the all-gathers and
reduce-scatters overlap compute. The optimizer step is outside the budget (torch's eager AdamW
reads its step counters on the host).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

from hp_dtensor.testing import count_host_syncs, distributed, load_test_module


def _helpers() -> ModuleType:
    return load_test_module(Path(__file__).with_name("_fsdp_helpers.py"), "hp_fsdp_tests_helpers")


@pytest.mark.parametrize(
    "config",
    [
        {"mesh_shape": (3,)},
        {"mesh_shape": (3,), "mp": "bf16", "reshard": 3},
        {"mesh_shape": (3,), "micro_batches": 2},
        {"mesh_shape": (3,), "list_unit": True},
    ],
    ids=["fp32", "bf16", "accumulation", "list_unit"],
)
@distributed(world_size=3, timeout=120)
def test_forward_backward_has_no_host_sync(config: dict[str, object]) -> None:
    h = _helpers()
    cfg = h.Config(**config)
    ours, _, _, _ = h.build_pair(cfg)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    rank = dist.get_rank()
    h.train_step(ours, opt, cfg, 0, rank)  # lazy init (first-step checks) outside the budget
    opt.step()
    opt.zero_grad()
    batches = [h.make_batch(h.data_seed(1, m, rank)) for m in range(cfg.micro_batches)]
    with count_host_syncs() as syncs:
        for m, batch in enumerate(batches):
            if cfg.micro_batches > 1:
                ours.set_requires_gradient_sync(m == cfg.micro_batches - 1)
            h.loss_fn(ours, batch).backward()
    syncs.assert_at_most(0, what=f"an hp-fsdp forward and backward ({config})")
