"""Qwen3.5 under TP (both attention kinds), FSDP, PP and EP trains like one process (3 steps)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import Trainer


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _train(folder: str, model: str, local_bs: int, par: dict[str, Any], mask: str) -> Any:
    h = _helpers()
    run = f"r{dist.get_rank()}" if dist.is_initialized() else "ref"
    cfg = h.job(Path(folder), par, run=run, local_bs=local_bs, model=model)
    cfg.model.attn_mask_type = mask  # block_causal: packed documents (both kinds of block)
    trainer = Trainer(cfg)
    try:
        losses = trainer.train()
        layout = {}
        for part in trainer.model_parts:  # how the Gated DeltaNet's own parameters are laid out
            for name, param in part.named_parameters():
                if "linear_attention.conv_q" in name or "linear_attention.A_log" in name:
                    local = param.to_local() if isinstance(param, DTensor) else param
                    placements = param.placements if isinstance(param, DTensor) else ()
                    layout[name] = (tuple(local.shape), placements)
        return losses, trainer.grad_norms, h.full_state(trainer.model_parts), layout
    finally:
        trainer.close()


_CASES = {
    # name: (world size, model, parallelism, data-parallel degree, attention mask)
    "tp2xdp2-documents": (
        4,
        "qwen3_5",
        {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2},
        2,
        "block_causal",
    ),
    "fsdp3": (3, "qwen3_5", {"data_parallel_shard_degree": 3}, 3, "causal"),
    "pp2": (2, "qwen3_5", {"pipeline_parallel_degree": 2}, 1, "causal"),
    # experts over [ep 2, tp 2] (ep borrowed from dp_shard 2), attention of both kinds TP 2
    "moe-ep2xtp2": (
        4,
        "qwen3_5_moe",
        {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2, "expert_parallel_degree": 2},
        2,
        "causal",
    ),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_layouts_match_single_process(tmp_path: Path, case: str) -> None:
    ws, model, par, dp, mask = _CASES[case]
    results = run_distributed(_train, ws, str(tmp_path), model, 2, par, mask, timeout=240)
    if mask == "causal":  # the session's shared one-process run
        ref = _helpers().reference(tmp_path, 2 * dp, model=model)
    else:
        ref = _train(str(tmp_path), model, 2 * dp, {}, mask)[:3]
    pp = par.get("pipeline_parallel_degree", 1) > 1
    _helpers().assert_matches_reference(
        [r[:3] for r in results], ref, each_rank_whole=not pp, norm_rtol=1e-5, norm_atol=1e-5
    )
    assert len(ref[0]) == 3
    tp = par.get("tensor_parallel_degree", 1)
    if tp > 1:  # conv channels and decays split with the heads (then FSDP over dp)
        layout = results[0][3]
        conv = layout["layers.0.linear_attention.conv_q"]
        assert Shard(0) in conv[1]
        assert conv[0][0] <= 2 * 16 // tp
        assert layout["layers.0.linear_attention.A_log"][0][0] <= 4 // tp
