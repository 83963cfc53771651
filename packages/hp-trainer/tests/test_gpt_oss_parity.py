"""gpt-oss under EP x FSDP (world size 3), PP x TP, EP x TP x FSDP and CP x EP x FSDP trains
like one process."""

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
    config = _helpers().job(Path(folder), par, run=run, local_bs=local_bs, model="gpt_oss")
    trainer = Trainer(config)
    try:
        losses = trainer.train()
        state = _helpers().full_state(trainer.model_parts)
        return losses, trainer.grad_norms, state, trainer.metrics.history
    finally:
        trainer.close()


_LAYOUTS: dict[str, tuple[int, dict[str, Any], int]] = {
    # world size 3: the 6 experts over ep 3 (2 each, borrowed from dp_shard 3), FSDP over it
    "dp3xep3": (3, {"data_parallel_shard_degree": 3, "expert_parallel_degree": 3}, 3),
    # stages (embedding + sliding block | full block + head) each tensor parallel: the
    # attention's heads, biases and sinks split, the experts' hidden units over tp
    "pp2xtp2": (4, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2}, 1),
    # the ring over cp 2 (load-balanced chunks of 8: the window of 8 crosses them, the sinks
    # in every block) with the experts over ep 2 borrowed from dp_shard x cp
    "dp2xcp2xep2": (
        4,
        {
            "data_parallel_shard_degree": 2,
            "context_parallel_degree": 2,
            "expert_parallel_degree": 2,
            "context_parallel_rotate_method": "alltoall",
        },
        2,
    ),
    # experts over [ep 2, tp 2] (biases sharded with them), the rest TP x FSDP
    "dp2xtp2xep2": (
        4,
        {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2, "expert_parallel_degree": 2},
        2,
    ),
}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_gpt_oss_layouts_match_single_process(tmp_path: Path, layout: str) -> None:
    world, par, dp = _LAYOUTS[layout]
    results = run_distributed(_train, world, str(tmp_path), 2, par, layout, timeout=180)
    # one process on the same global batch (shared by the layouts of the same dp)
    ref_losses, ref_norms, ref_state = _helpers().reference(tmp_path, 2 * dp, model="gpt_oss")
    assert len(ref_losses) == 3
    assert ref_losses[-1] < ref_losses[0]
    _helpers().assert_matches_reference(
        [r[:3] for r in results],
        (ref_losses, ref_norms, ref_state),
        each_rank_whole="pipeline_parallel_degree" not in par,
        norm_rtol=1e-5,
        norm_atol=1e-5,
    )
    # the trained sinks and biases moved the same way in every layout
    assert ref_state["layers.1.attention.sinks"].abs().sum() > 0
    assert ref_state["layers.0.moe.expert_output_bias.weight"].abs().sum() > 0
    total = 2 * dp * 32 * 2  # tokens of the step x top_k, per MoE layer
    for result in results:  # every MoE layer's global load, whichever rank holds it
        layers = result[3][-1]["moe_layers"]
        assert layers == results[0][3][-1]["moe_layers"]
        assert sorted(layers) == ["layers.0.moe", "layers.1.moe"]
        assert all(sum(layer["tokens_per_expert"]) == total for layer in layers.values())
