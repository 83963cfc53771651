"""Context parallel in the trainer: cp x dp and cp x tp train like one process (losses, gradient
norms, final parameters), for each way attention reaches the other shards (all-gather K/V,
ring, Ulysses, and the ring x Ulysses hybrid)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch.distributed as dist

from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import Trainer


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _train(folder: str, par: dict[str, Any], local_bs: int) -> Any:
    h = _helpers()
    trainer = Trainer(h.job(Path(folder), par, run=f"r{dist.get_rank()}", local_bs=local_bs))
    try:
        losses = trainer.train()
        # the RoPE table is whole again after the steps (the CP context restores it)
        rope_len = trainer.model.get_buffer("rope_cache").shape[0]
        return losses, trainer.grad_norms, h.full_state(trainer.model_parts), rope_len
    finally:
        trainer.close()


_CASES = {
    # (world size, parallelism, data-parallel degree)
    "cp2xdp2-allgather": (4, {"context_parallel_degree": 2, "data_parallel_shard_degree": 2}, 2),
    "cp2xtp2-ulysses": (
        4,
        {
            "context_parallel_degree": 2,
            "tensor_parallel_degree": 2,
            "context_parallel_rotate_method": "ulysses",
        },
        1,
    ),
    # Ulysses inside pairs of ranks, ring across the pairs
    "cp4-hybrid": (
        4,
        {
            "context_parallel_degree": 4,
            "context_parallel_rotate_method": "hybrid",
            "context_parallel_ulysses_degree": 2,
        },
        1,
    ),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_context_parallel_training_matches_one_process(tmp_path: Path, case: str) -> None:
    ws, par, dp = _CASES[case]
    local_bs = 2
    results = run_distributed(_train, ws, str(tmp_path), par, local_bs, timeout=150)
    ref = _helpers().reference(tmp_path, local_bs * dp)
    assert ref[0][-1] < ref[0][0]  # it learns
    _helpers().assert_matches_reference([r[:3] for r in results], ref, each_rank_whole=True)
    for *_, rope_len in results:
        assert rope_len == 512  # tiny's max_seq_len: restored whole
