"""MoE models under context parallel (and pipeline parallel) beside EP train like one process."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import Trainer
from hp_trainer.protocols.model_spec import get_model_spec


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _train(
    folder: str, model: str, local_bs: int, par: dict[str, Any], run: str, aux: float = 0.0
) -> Any:
    config = _helpers().job(Path(folder), par, run=run, local_bs=local_bs, model=model)
    spec = get_model_spec(model)
    tiny = spec.flavors["tiny"]
    # the auxiliary load-balancing loss on (HF's router_aux_loss_coef), for this run only
    moe_args = dataclasses.replace(tiny.moe_args, aux_loss_coeff=aux)
    spec.flavors["tiny"] = dataclasses.replace(tiny, moe_args=moe_args)
    try:
        trainer = Trainer(config)
    finally:
        spec.flavors["tiny"] = tiny
    try:
        losses = trainer.train()
        state = _helpers().full_state(trainer.model_parts)
        return losses, trainer.grad_norms, state, trainer.metrics.history
    finally:
        trainer.close()


_REFS: dict[tuple[str, int, float], Any] = {}


def _reference(folder: str, model: str, local_bs: int, aux: float = 0.0) -> Any:
    """One process on the global batch, once per (model, batch, auxiliary loss) and session
    (without the auxiliary loss: the session's run shared with the other parity files)."""
    if aux == 0.0:
        return _helpers().reference_run(Path(folder), local_bs, model=model)
    if (model, local_bs, aux) not in _REFS:
        _REFS[model, local_bs, aux] = _train(folder, model, local_bs, {}, "r", aux)
    return _REFS[model, local_bs, aux]


_CP_LAYOUTS = {
    # cp 2 x dp_shard 2; ep 2 borrowed from dp_shard x cp (efsdp 2): the ring passes K/V; with
    # the auxiliary load-balancing loss (0.1): each rank routes half of two sequences, the loss
    # counts the experts' choices of all four (MoE.aux_loss_group = the dp x cp group)
    "qwen3_moe-cp2xdp2xep2-ring-aux": (
        "qwen3_moe",
        {
            "data_parallel_shard_degree": 2,
            "context_parallel_degree": 2,
            "expert_parallel_degree": 2,
            "context_parallel_rotate_method": "alltoall",
        },
        0.1,
    ),
    # HSDP: the experts' FSDP mesh is (dp_replicate, efsdp), the replicas reduce them too
    "qwen3_moe-hsdp2xcp2xep2-aux": (
        "qwen3_moe",
        {
            "data_parallel_replicate_degree": 2,
            "context_parallel_degree": 2,
            "expert_parallel_degree": 2,
        },
        0.05,
    ),
    # latent attention (query/key size 24, value size 16) through the all-gather-KV path
    "deepseek_v3-cp2xdp2xep2-allgather": (
        "deepseek_v3",
        {
            "data_parallel_shard_degree": 2,
            "context_parallel_degree": 2,
            "expert_parallel_degree": 2,
        },
        0.0,
    ),
}


@pytest.mark.parametrize("layout", list(_CP_LAYOUTS))
def test_moe_with_context_parallel_matches_single_process(tmp_path: Path, layout: str) -> None:
    model, par, aux = _CP_LAYOUTS[layout]
    results = run_distributed(_train, 4, str(tmp_path), model, 2, par, "cp", aux, timeout=180)
    ref_losses, ref_norms, ref_state, ref_history = _reference(str(tmp_path), model, 4, aux)
    _helpers().assert_matches_reference(
        [r[:3] for r in results],
        (ref_losses, ref_norms, ref_state),
        each_rank_whole=True,
        norm_rtol=1e-5,
        norm_atol=1e-5,
    )
    # the expert load (and deepseek_v3's routing-bias update) counts every token of every
    # cp shard: the same counts as one process routing the whole sequences
    record, ref_record = results[0][3][-1], ref_history[-1]
    assert record["moe_layers"] == ref_record["moe_layers"]
    for layer in record["moe_layers"].values():
        assert sum(layer["tokens_per_expert"]) == 4 * 32 * 2  # step tokens x top_k
    if model == "deepseek_v3":
        assert ref_state["layers.1.moe.expert_bias"].abs().sum() > 0
    if aux > 0:  # the auxiliary loss moved the routers: without it the gates end elsewhere
        plain = _reference(str(tmp_path), model, 4)[2]
        gate = "layers.0.moe.router.gate.weight"
        assert (plain[gate] - ref_state[gate]).abs().max() > 1e-4


_PP_LAYOUTS = {
    # two stages per rank (embedding, block 0 | block 1, head), FSDP over dp_shard 2 inside
    "qwen3_moe-pp2xdp2-interleaved": (
        "qwen3_moe",
        {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "Interleaved1F1B"},
    ),
    # experts over ep 2 (borrowed from dp_shard 2) inside each stage; the routing bias of
    # deepseek_v3's MoE block (second stage) moves from its own stage's counts
    # all four: stages of cp 2 whose experts are over ep 2 (borrowed from cp), ring attention
    "qwen3_moe-pp2xcp2xep2-ring": (
        "qwen3_moe",
        {
            "pipeline_parallel_degree": 2,
            "context_parallel_degree": 2,
            "expert_parallel_degree": 2,
            "context_parallel_rotate_method": "ring",
        },
    ),
    # TP inside stages: the top-level plan keeps the modules each stage holds
    "qwen3_moe-pp2xtp2": (
        "qwen3_moe",
        {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2},
    ),
    "deepseek_v3-pp2xdp2xep2": (
        "deepseek_v3",
        {"pipeline_parallel_degree": 2, "expert_parallel_degree": 2},
    ),
}


@pytest.mark.parametrize("layout", list(_PP_LAYOUTS))
def test_moe_with_pipeline_parallel_matches_single_process(tmp_path: Path, layout: str) -> None:
    model, par = _PP_LAYOUTS[layout]
    results = run_distributed(_train, 4, str(tmp_path), model, 2, par, "pp", timeout=180)
    model_ranks = par.get("context_parallel_degree", 1) * par.get("tensor_parallel_degree", 1)
    dp = 4 // (par["pipeline_parallel_degree"] * model_ranks)
    ref_losses, ref_norms, ref_state, ref_history = _reference(str(tmp_path), model, 2 * dp)
    _helpers().assert_matches_reference(
        [r[:3] for r in results],
        (ref_losses, ref_norms, ref_state),
        norm_rtol=1e-5,
        norm_atol=1e-5,
    )
    # every rank reports the load of every MoE layer, whichever stage holds it
    for result in results:
        assert result[3][-1]["moe_layers"] == ref_history[-1]["moe_layers"]
    if model == "deepseek_v3":
        assert ref_state["layers.1.moe.expert_bias"].abs().sum() > 0
