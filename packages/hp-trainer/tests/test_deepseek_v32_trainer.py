"""``--model.name deepseek_v32`` in the trainer: EP x TP x FSDP, CP x EP x FSDP, FSDP at 3 ranks
and PP train like one process over 3 steps (losses, gradient norms, weights and the indexers'
losses at 1e-5), in the sparse stage and in the dense warm-up (where only the indexers move)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import Trainer
from hp_trainer.config import DSAConfig


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _train(folder: str, local_bs: int, par: dict[str, Any], run: str, stage: str) -> Any:
    torch.set_num_threads(1)
    job = _helpers().job(Path(folder), par, run=run, local_bs=local_bs, model="deepseek_v32")
    job.dsa = DSAConfig(indexer_stage=stage)  # type: ignore[arg-type]
    trainer = Trainer(job)
    # this rank's share of every layer's indexer loss, one row per forward (micro-batch)
    shares: list[list[float]] = []
    for part in trainer.model_parts:
        for name, module in part.named_modules():
            if name.endswith("attention") and hasattr(module, "indexer_loss"):
                module.register_forward_hook(
                    lambda m, _a, _o, n=name: shares.append(
                        [float(n.split(".")[1]), float(m.indexer_loss)]
                    )
                )
    try:
        initial = _helpers().full_state(trainer.model_parts)
        losses = trainer.train()
        state = _helpers().full_state(trainer.model_parts)
        return losses, trainer.grad_norms, state, shares, initial
    finally:
        trainer.close()


def _per_step(shares: list[list[float]], layers: int = 2) -> torch.Tensor:
    """Indexer loss summed over this rank's forwards of each step: (steps, layers), 0 for the
    layers this rank does not hold (pipeline stages)."""
    table = torch.tensor(shares).view(-1, 2)
    out = torch.zeros(3, layers)
    for layer in range(layers):
        rows = table[table[:, 0] == layer, 1]
        if rows.numel():
            out[:, layer] = rows.view(3, -1).sum(dim=1)
    return out


_REFS: dict[tuple[int, str], Any] = {}


def _reference(folder: Path, local_bs: int, stage: str) -> Any:
    if (local_bs, stage) not in _REFS:
        _REFS[local_bs, stage] = _train(str(folder), local_bs, {}, "ref", stage)
    return _REFS[local_bs, stage]


_LAYOUTS = {
    # experts over [ep, tp] (ep borrowed from dp_shard 2), attention heads over tp, FSDP over dp
    "sparse-ep2xtp2xdp2": (
        4,
        {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2, "expert_parallel_degree": 2},
        2,
        "sparse",
    ),
    # the sequence over cp (head-tail shards): hp-cp-ep's DSA styles on every attention
    "sparse-cp2xep2xdp2": (
        4,
        {
            "data_parallel_shard_degree": 2,
            "context_parallel_degree": 2,
            "expert_parallel_degree": 2,
        },
        2,
        "sparse",
    ),
    "warmup-dp3": (3, {"data_parallel_shard_degree": 3}, 3, "dense_warmup"),
    "sparse-pp2": (
        2,
        {"pipeline_parallel_degree": 2, "pipeline_parallel_microbatch_size": 1},
        1,
        "sparse",
    ),
}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_deepseek_v32_layouts_match_single_process(tmp_path: Path, layout: str) -> None:
    world, par, dp, stage = _LAYOUTS[layout]
    results = run_distributed(_train, world, str(tmp_path), 2, par, "dsa", stage, timeout=240)
    ref = _reference(tmp_path, 2 * dp, stage)
    pipelined = "pipeline_parallel_degree" in par
    _helpers().assert_matches_reference(
        [r[:3] for r in results],
        ref[:3],
        each_rank_whole=not pipelined,
        norm_rtol=1e-5,
        norm_atol=1e-5,
    )
    # the indexer losses: every data-parallel rank's shares add up to one process's mean
    ref_losses = _per_step(ref[3])
    assert (ref_losses > 0).all()
    # TP ranks compute the same shares: each data-parallel rank (or stage) is counted once
    tp = par.get("tensor_parallel_degree", 1)
    ours = sum(_per_step(r[3]) for r in results[::tp])
    torch.testing.assert_close(ours, ref_losses, rtol=1e-5, atol=1e-6)
    if stage == "dense_warmup":  # only the indexers moved; they learn the attention
        state, initial = ref[2], ref[4]
        for key, value in state.items():
            moved = not torch.equal(value, initial[key])
            assert moved == (".indexer." in key), key
        assert (ref_losses[-1] < ref_losses[0]).all()
