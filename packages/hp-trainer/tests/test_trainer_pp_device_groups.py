"""The trainer's pipeline path hands only device tensors to device groups (issue 27, item 3).

On a GPU job the default group is NCCL-only: a host tensor in one of its collectives or
point-to-point calls raises "No backend type associated with device type cpu", and an object
collective needs a CPU side group. :func:`hp_dtensor.testing.check_device_groups` makes the CPU
behave that way: the trainer is built, then its training steps (pipeline sends and receives, the
tie check, FSDP inside the stages, the loss and grad-norm reductions, the expert-load gathering
of every MoE layer over the stages) run inside the checker. A host tensor or an object
collective on a device group would be recorded as a violation.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from hp_dtensor.testing import check_device_groups, load_test_module, run_distributed
from hp_trainer import Trainer


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _train_checked(folder: str, par: dict[str, Any]) -> tuple[list[str], list[tuple[str, str]]]:
    config = _helpers().job(
        Path(folder), par, run=f"r{dist.get_rank()}", local_bs=2, model="qwen3_moe"
    )
    trainer = Trainer(config)
    try:
        with check_device_groups(device=torch.device("cpu"), strict=False) as checker:
            trainer.train()
        return checker.violations, checker.calls
    finally:
        trainer.close()


def test_pp_fsdp_moe_training_uses_device_tensors_only(tmp_path: Path) -> None:
    par = {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 2}
    results = run_distributed(_train_checked, 4, str(tmp_path), par, timeout=240)
    for rank, (violations, calls) in enumerate(results):
        assert violations == [], f"rank {rank}: {violations}"
        names = {name for name, _ in calls}
        # the checker saw the pipeline's batched p2p and the expert-load / metric collectives
        assert "batch_isend_irecv" in names, (rank, names)
        assert "all_gather" in names, (rank, names)
        assert not names & {"all_gather_object", "broadcast_object_list", "send_object_list"}
