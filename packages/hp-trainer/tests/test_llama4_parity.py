"""Llama 4 tiny trains like one process under EP x FSDP, EP x TP x FSDP, FSDP at 3 ranks and
PP x TP: losses, gradient norms and every parameter within 1e-5 over 3 steps, and the global
expert load of every MoE block equal to the single process's counts.

The tiny model's three blocks hold a dense chunked-RoPE block, an MoE chunked-RoPE block and a
dense NoPE block with temperature tuning (chunks of 8 over 32 positions); each rank reads
different data. Under TP the attention gets the whole sequence while the residual stream holds
a slice of it (sequence parallel), so the masks are built at the attention's length.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import Trainer


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _train(folder: str, local_bs: int, par: dict[str, Any], run: str) -> Any:
    helpers = _helpers()
    trainer = Trainer(helpers.job(Path(folder), par, run=run, local_bs=local_bs, model="llama4"))
    try:
        losses = trainer.train()
        state = helpers.full_state(trainer.model_parts)
        return losses, trainer.grad_norms, state, trainer.metrics.history[-1]["moe_layers"]
    finally:
        trainer.close()


_LAYOUTS = {
    # experts over ep 2 borrowed from dp_shard 4 (efsdp 2), the rest FSDP over 4
    "ep2xdp4": (4, {"data_parallel_shard_degree": 4, "expert_parallel_degree": 2}, 4),
    # experts over [ep 2, tp 2] (ep borrowed from dp_shard 2), attention/dense TP x FSDP
    "ep2xtp2xdp2": (
        4,
        {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2, "expert_parallel_degree": 2},
        2,
    ),
    # a non-power-of-two world: FSDP over 3 (3 ranks divide neither the heads nor the experts)
    "dp3": (3, {"data_parallel_shard_degree": 3}, 3),
    # two stages (embedding, blocks 0-1 | block 2, head), TP 2 inside each
    "pp2xtp2": (4, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2}, 1),
}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_llama4_layouts_match_single_process(tmp_path: Path, layout: str) -> None:
    world, par, dp = _LAYOUTS[layout]
    results = run_distributed(_train, world, str(tmp_path), 2, par, "par", timeout=240)
    ref = _train(str(tmp_path), 2 * dp, {}, "ref")
    assert len(ref[0]) == 3
    _helpers().assert_matches_reference(
        [r[:3] for r in results],
        ref[:3],
        each_rank_whole="pipeline_parallel_degree" not in par,
        norm_rtol=1e-5,
        norm_atol=1e-5,
    )
    # the MoE block's load: the step's global counts, whichever rank (or stage) holds it
    for result in results:
        assert result[3] == ref[3]
    (moe_layer,) = ref[3].values()
    assert sum(moe_layer["tokens_per_expert"]) == 2 * dp * 32  # top 1
