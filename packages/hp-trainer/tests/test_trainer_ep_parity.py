"""MoE models under expert parallel x FSDP train like one process; expert-load metrics are exact."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_cp_ep import MoE
from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import JobConfig, Trainer
from hp_trainer.components.expert_load import ExpertLoadTracker, format_expert_load
from hp_trainer.protocols.model_spec import get_model_spec


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _config(folder: Path, model: str, local_bs: int, par: dict[str, Any], run: str) -> JobConfig:
    return _helpers().job(folder, par, run=run, local_bs=local_bs, model=model)


def _train(folder: str, model: str, local_bs: int, par: dict[str, Any], run: str) -> Any:
    trainer = Trainer(_config(Path(folder), model, local_bs, par, run))
    try:
        losses = trainer.train()
        state = _helpers().full_state([trainer.model])
        return losses, trainer.grad_norms, state, trainer.metrics.history
    finally:
        trainer.close()


_LAYOUTS = [
    # ep 2 borrowed from dp_shard 4 (efsdp 2): experts over ep, then FSDP over efsdp
    ("qwen3_moe", {"data_parallel_shard_degree": 4, "expert_parallel_degree": 2}, 4),
    ("deepseek_v3", {"data_parallel_shard_degree": 4, "expert_parallel_degree": 2}, 4),
    # ep 2 x tp 2: experts over [ep, tp] (ep borrowed from dp_shard 2), the rest TP x FSDP
    (
        "qwen3_moe",
        {
            "data_parallel_shard_degree": 2,
            "tensor_parallel_degree": 2,
            "expert_parallel_degree": 2,
        },
        2,
    ),
]


@pytest.mark.parametrize(
    ("model", "par", "dp"), _LAYOUTS, ids=["qwen3_moe-ep2xdp", "deepseek_v3-ep2xdp", "ep2xtp2"]
)
def test_moe_layouts_match_single_process(
    tmp_path: Path, model: str, par: dict[str, Any], dp: int
) -> None:
    results = run_distributed(_train, 4, str(tmp_path), model, 2, par, "ep", timeout=180)
    # one process on the same global batch (the session's shared run)
    ref_losses, ref_norms, ref_state, ref_history = _helpers().reference_run(
        tmp_path, 2 * dp, model=model
    )
    assert len(ref_losses) == 3
    _helpers().assert_matches_reference(
        [r[:3] for r in results],
        (ref_losses, ref_norms, ref_state),
        each_rank_whole=True,
        norm_rtol=1e-5,
        norm_atol=1e-5,
    )
    # the routing bias moved (deepseek_v3) identically; load metrics are the global counts
    if model == "deepseek_v3":
        assert ref_state["layers.1.moe.expert_bias"].abs().sum() > 0
    record = results[0][3][-1]
    ref_record = ref_history[-1]
    assert record["moe_layers"] == ref_record["moe_layers"]
    total = 2 * dp * 32 * 2  # tokens of the step x top_k, per MoE layer
    for layer in record["moe_layers"].values():
        assert sum(layer["tokens_per_expert"]) == total
    lines = (tmp_path / "ep" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["moe_imbalance"] == record["moe_imbalance"]


def _known_routing(rank_tokens: list[int]) -> Any:
    """deepseek_v3 tiny with a zero gate and a bias that sends every token to experts 6 and 7."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    model = get_model_spec("deepseek_v3").build("tiny")
    model.init_weights()  # type: ignore[operator]
    moe = model.layers["1"].moe
    assert isinstance(moe, MoE)
    assert moe.expert_bias is not None
    with torch.no_grad():
        moe.router.gate.weight.zero_()  # every score 0.5: the bias decides
        moe.expert_bias.copy_(torch.tensor([0, 0, 0.1, 0, 0, 0, 0.3, 0.2]))
    bias_before = moe.expert_bias.clone()
    tracker = ExpertLoadTracker([model], None)
    model(torch.randint(0, 2048, (1, rank_tokens[rank])))
    loads = tracker.step()
    return loads["layers.1.moe"], tracker.metrics(), bias_before, moe.expert_bias.clone()


def test_expert_load_of_a_known_routing_equals_hand_counts() -> None:
    rank_tokens = [5, 11]  # different batches on the two ranks
    results = run_distributed(_known_routing, 2, rank_tokens, timeout=60)
    # group limit: group 1 (experts 4..7) scores 0.8 + 0.7 > group 0's 0.6 + 0.5; top 2: 6, 7
    counts = [0, 0, 0, 0, 0, 0, 16, 16]
    for load, metrics, before, after in results:
        assert load.tokens_per_expert.tolist() == counts
        assert (load.min, load.max, load.mean) == (0.0, 16.0, 4.0)
        assert load.imbalance == 4.0
        assert metrics["moe_tokens_per_expert_min"] == 0.0
        assert metrics["moe_tokens_per_expert_max"] == 16.0
        assert metrics["moe_imbalance"] == 4.0
        assert format_expert_load(metrics) == "  experts min 0 max 16 imbalance 4.00"
        # overloaded experts lose 1e-3, the others gain it (centred): the update is over dp
        step = torch.tensor([1, 1, 1, 1, 1, 1, -1, -1], dtype=torch.float32) * 1e-3
        torch.testing.assert_close(after - before, step - step.mean())


@pytest.mark.parametrize(
    ("model", "par", "world", "match"),
    [
        ("deepseek_v3", {"tensor_parallel_degree": 3}, 3, "tensor_parallel_degree = 3 must divide"),
        ("qwen3_moe", {"expert_parallel_degree": 3}, 3, "divide the model's 8 experts"),
        (
            "qwen3_moe",
            {"tensor_parallel_degree": 2, "expert_parallel_degree": 2},
            2,
            "divide data_parallel_shard_degree = 1",
        ),
    ],
)
def test_moe_layouts_that_cannot_work_fail_up_front(
    tmp_path: Path, model: str, par: dict[str, Any], world: int, match: str
) -> None:
    from hp_trainer.distributed.layout_validation import validate_parallel_layout

    cfg = _config(tmp_path, model, 2, par, "bad")
    with pytest.raises(ValueError, match=match):
        validate_parallel_layout(cfg, world)
