"""Context parallel with activation checkpointing in the trainer.

Each layout trains 2 steps on the tiny llama3 with every activation-checkpointing mode that
composes with CP: the losses, gradient norms, last step's gradients and final parameters equal
the same layout without checkpointing bitwise (the recomputation runs the same ops on the same
shards), and one process at the parity tolerance. The context-parallel engine is counted: under
``full`` and selective per-op AC every block's attention runs twice per step (forward and
recomputation), every second block's under ``selective`` ``"2"``, once under ``swap``, so a
checkpoint silently off (or recomputed outside CP) fails here. Ring at cp 2, all-gather at cp 3
(non-power-of-two, sequence 24), Ulysses at cp 2.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hp_cp_ep.cp import ContextParallelAttention
from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import ConfigManager, JobConfig, Trainer

STEPS, LOCAL_BS, N_LAYERS = 2, 2, 2  # tiny llama3: 2 blocks

#: activation_checkpoint sections, and the engine calls per block and step they cause
_AC: dict[str, tuple[dict[str, Any], float]] = {
    "none": ({"mode": "none"}, 1),
    "full": ({"mode": "full"}, 2),
    "selective-op": ({"mode": "selective", "selective_ac_option": "op"}, 2),
    "selective-2": ({"mode": "selective", "selective_ac_option": "2"}, 1.5),
    "swap": ({"mode": "swap"}, 1),
}


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _job(folder: Path, par: dict[str, Any], ac: str, seq_len: int, run: str) -> JobConfig:
    job = _helpers().job(folder, par, run=run, local_bs=LOCAL_BS, steps=STEPS)
    raw = job.to_dict()
    raw["activation_checkpoint"] = _AC[ac][0]
    raw["training"]["seq_len"] = seq_len
    return ConfigManager().from_dict(raw)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


@contextmanager
def _engine_calls() -> Iterator[list[str]]:
    calls: list[str] = []
    original = ContextParallelAttention.__call__

    def counted(self: ContextParallelAttention, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(self.mode)
        return original(self, *args, **kwargs)

    ContextParallelAttention.__call__ = counted  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        ContextParallelAttention.__call__ = original  # type: ignore[method-assign]


def _train_each(folder: str, par: dict[str, Any], acs: list[str], seq_len: int) -> list[Any]:
    """Per AC mode: losses, grad norms, final params, last gradients, engine calls."""
    out = []
    for ac in acs:
        job = _job(Path(folder), par, ac, seq_len, run=f"{ac}-r{dist.get_rank()}")
        trainer = Trainer(job)
        try:
            with _engine_calls() as calls:
                losses = trainer.train()
            grads = {}
            for name, p in trainer.model.named_parameters():
                assert p.grad is not None, name
                grads[name.replace("_checkpoint_wrapped_module.", "")] = _whole(p.grad)
            params = _helpers().full_state(trainer.model_parts)
            out.append((losses, trainer.grad_norms, params, grads, len(calls)))
        finally:
            trainer.close()
    return out


def _reference(folder: Path, seq_len: int) -> tuple[list[float], list[float], Any]:
    trainer = Trainer(_job(folder, {}, "none", seq_len, run="ref"))
    try:
        losses = trainer.train()
        return losses, trainer.grad_norms, _helpers().full_state(trainer.model_parts)
    finally:
        trainer.close()


_CASES = {
    # (world size, parallelism, sequence length, AC modes besides none)
    "cp2-ring": (
        2,
        {"context_parallel_degree": 2, "context_parallel_rotate_method": "ring"},
        32,
        ["full", "selective-op", "swap"],
    ),
    "cp3-allgather": (
        3,
        {"context_parallel_degree": 3, "context_parallel_rotate_method": "allgather"},
        24,
        ["full", "selective-2"],
    ),
    "cp2-ulysses": (
        2,
        {"context_parallel_degree": 2, "context_parallel_rotate_method": "ulysses"},
        32,
        ["full"],
    ),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_context_parallel_with_activation_checkpointing(tmp_path: Path, case: str) -> None:
    ws, par, seq_len, acs = _CASES[case]
    results = run_distributed(
        _train_each, ws, str(tmp_path), par, ["none", *acs], seq_len, timeout=150
    )
    ref = _reference(tmp_path, seq_len)
    h = _helpers()
    h.assert_matches_reference([r[0][:3] for r in results], ref, each_rank_whole=True)
    for rank_results in results:
        base = rank_results[0]
        calls_per_block_step = STEPS * N_LAYERS
        assert base[4] == calls_per_block_step
        for ac, (losses, norms, params, grads, calls) in zip(acs, rank_results[1:], strict=True):
            assert calls == _AC[ac][1] * calls_per_block_step, ac
            assert losses == base[0], ac
            assert norms == base[1], ac
            assert grads.keys() == base[3].keys(), ac
            for name, g in grads.items():
                assert torch.equal(g, base[3][name]), f"{ac}: grad {name}"
            for name, p in params.items():
                assert torch.equal(p, base[2][name]), f"{ac}: param {name}"
