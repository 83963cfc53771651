"""The auto-parallel planner: memory model against tensor-level measurements, search, hp-plan.

The memory model is pinned on five layouts at world size 2 (FSDP 2, TP 2, PP 2 with 1F1B,
FSDP 2 with full AC of the tiny Llama; FSDP 2 with EP 2 of the tiny Qwen 3 MoE), each rank on
its own data: the predicted peak of a step
with optimizer state is within 15% of the measured one (the bytes alive at the step's start plus
the peak of the live blocks the profiler's allocator events give, replayed by address, see
``hp_trainer.planner._measure``); each block's activation term matches the tensors autograd saves
in its forward within 1% (dense, QK-norm, MoE, multi-head latent attention). The search
goes through the trainer's own layout validation (every ranked layout passes it; a refused one
carries its message), the table ranks what fits first, the overlay is a config ``hp-train``
reads, and bad input gets a useful answer: the closest candidates with their shortfall, the
available profile names.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer.planner import (
    LayoutCandidate,
    available_device_profiles,
    estimate_layout,
    load_device_profile,
    model_stats,
    plan_layouts,
    write_overlay,
)

_LAYOUTS: dict[str, tuple[dict[str, Any], LayoutCandidate]] = {
    "fsdp2": ({"data_parallel_shard_degree": 2}, LayoutCandidate(dp_shard=2)),
    # the tiny Qwen 3 MoE (8 experts, top 2), experts over 2 ranks: the MoE terms
    "fsdp2 ep2 moe": ({"data_parallel_shard_degree": 2, "expert_parallel_degree": 2},
                      LayoutCandidate(dp_shard=2, ep=2)),
    "tp2": ({"data_parallel_shard_degree": 1, "tensor_parallel_degree": 2}, LayoutCandidate(tp=2)),
    "pp2": (
        {"data_parallel_shard_degree": 1, "pipeline_parallel_degree": 2,
         "pipeline_parallel_microbatch_size": 2},
        LayoutCandidate(pp=2, microbatch_size=2),
    ),
    # full AC: the loss without a recomputed block and a block's backward with one (and FSDP's
    # reduce-scatter in flight) are two moments, not one sum
    "fsdp2 full AC": ({"data_parallel_shard_degree": 2}, LayoutCandidate(dp_shard=2, ac="full")),
}  # fmt: skip
_LOCAL_BATCH = 4


def _model(name: str) -> str:
    return "qwen3_moe" if "moe" in name else "llama3"


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _measure(folder: str) -> dict[str, int]:
    from hp_trainer import Trainer
    from hp_trainer.planner._measure import step_peak_bytes

    out = {}
    for name, (par, _) in _LAYOUTS.items():
        cfg = _helpers().job(
            Path(folder), par, run=name.replace(" ", "_"), local_bs=_LOCAL_BATCH, model=_model(name)
        )
        cfg.activation_checkpoint.mode = _LAYOUTS[name][1].ac
        trainer = Trainer(cfg)
        try:
            batches = trainer.data_iterator()
            trainer.train_step(next(batches))  # creates the optimizer state
            out[name] = step_peak_bytes(trainer, next(batches))[0]
        finally:
            trainer.close()
    return out


def test_memory_model_matches_tensor_level_peaks(tmp_path: Path) -> None:
    measured = run_distributed(_measure, 2, str(tmp_path), timeout=300)
    profile = load_device_profile("cpu")
    for name, (_, cand) in _LAYOUTS.items():
        cand = dataclasses.replace(
            cand, local_batch_size=_LOCAL_BATCH, seq_len=32, compute_dtype_bytes=4
        )
        stats = model_stats(_model(name), "tiny", 32)
        predicted = estimate_layout(stats, cand, profile).peak_memory
        peak = max(m[name] for m in measured)  # the worst rank, as the model predicts
        assert abs(predicted - peak) <= 0.15 * peak, (name, predicted, peak)
        print(f"{name}: predicted {predicted:,.0f} measured {peak:,} B "
              f"({100 * (predicted - peak) / peak:+.1f}%)")  # fmt: skip


@pytest.mark.parametrize(
    ("model", "flavor", "q_lora_rank"),
    [("llama3", "tiny", None), ("qwen3_moe", "tiny", None), ("deepseek_v3", "tiny", None),
     ("deepseek_v3", "tiny", 24)],
)  # fmt: skip
def test_block_activation_terms_match_saved_tensors(
    model: str, flavor: str, q_lora_rank: int | None
) -> None:
    """Each block's activation term (elements in the compute dtype plus the MoE router's
    float32 / int64 bytes) against the storages autograd saves in one block's forward: dense
    SwiGLU and grouped-query attention with QK-norm (Qwen 3), MoE with top-k routing and
    grouped-GEMM experts (Qwen 3 MoE: softmax scores, weights applied at the combine;
    DeepSeek-V3: sigmoid scores, group-limited routing, a shared expert, weights before the
    experts) and multi-head latent attention (with and without a query LoRA rank); and the
    input gradients the block's backward holds beside them within 10%."""
    import torch

    from hp_trainer.planner._measure import profile_peak, saved_tensor_bytes
    from hp_trainer.protocols.model_spec import get_model_spec

    spec = get_model_spec(model)
    args = spec.model_args(flavor)
    if q_lora_rank is not None:
        args = dataclasses.replace(args, q_lora_rank=q_lora_rank)
    torch.manual_seed(0)
    net: Any = spec.model_cls(args)
    net.init_weights()
    batch, seq = 4, 128  # enough tokens that the weight gradients are a small part
    stats = model_stats(model, args, seq)
    rope = net.rope_cache
    for i, block in enumerate(net.layers.values()):
        x = torch.randn(batch, seq, args.dim, requires_grad=True) * 1.0  # a block's input

        def forward(block: Any = block, x: torch.Tensor = x) -> Any:
            return block(x, rope)

        saved, _ = saved_tensor_bytes(forward, exclude=[*block.parameters(), rope])
        elems, fixed = stats.layer_act_elems[i], stats.layer_act_fixed_bytes[i]
        predicted = (4 * elems + fixed) * batch * seq
        assert abs(predicted - saved) <= 0.01 * saved, (model, i, predicted, saved)
        # the backward's input gradients beside the saved tensors: the peak of a forward +
        # backward above the saved bytes (which also holds the weight gradients made by then)
        grad = torch.randn(batch, seq, args.dim)

        def forward_backward(block: Any = block, x: torch.Tensor = x, g: Any = grad) -> None:
            block(x, rope).backward(g)

        peak = profile_peak(forward_backward).peak
        temp = 4 * stats.layer_bwd_temp_elems[i] * batch * seq
        assert abs(temp - (peak - saved)) <= 0.1 * (peak - saved), (model, i, temp, peak - saved)


def test_plan_llama3_8b_on_64_h100_is_ranked_and_valid(tmp_path: Path) -> None:
    from hp_trainer import ConfigManager
    from hp_trainer.distributed.layout_validation import validate_parallel_layout

    result = plan_layouts("llama3", "8B", 64, "h100")
    assert result.feasible
    assert result.best is result.estimates[0]
    speeds = [e.tokens_per_second for e in result.feasible]
    assert speeds == sorted(speeds, reverse=True)
    assert all(e.peak_memory <= result.memory_limit for e in result.feasible)
    assert all(e.candidate.world_size == 64 for e in result.estimates)
    # TP beyond a node, and TP not dividing the 8 KV heads, are never proposed
    assert all(e.candidate.tp <= 8 for e in result.estimates)
    table = result.table(5)
    assert "tok/s/dev" in table
    assert len(table.splitlines()) == 7
    # the overlay is a config hp-train reads, and its layout passes the trainer's validation
    best = result.best
    assert best is not None
    path = write_overlay(tmp_path / "plan.toml", "llama3", "8B", best, header="test")
    cfg = ConfigManager().parse_args(["--job.config_file", str(path)])
    c = best.candidate
    par = cfg.parallelism
    assert (par.data_parallel_shard_degree, par.tensor_parallel_degree,
            par.pipeline_parallel_degree, par.context_parallel_degree) == (
            c.dp_shard, c.tp, c.pp, c.cp)  # fmt: skip
    assert cfg.activation_checkpoint.mode == c.ac
    validate_parallel_layout(cfg, 64)


def test_plan_refusals_carry_the_validation_message() -> None:
    # seq 66: CP 2 needs a multiple of 4 (load balancing), refused by the trainer's validation
    result = plan_layouts("llama3", "debugmodel", 4, "cpu", seq_len=66, global_batch_size=6)
    reasons = " | ".join(r.why for r in result.rejected)
    assert "training.seq_len = 66 must be a multiple of 4" in reasons
    assert "global batch 6 is not a multiple of the data-parallel degree 4" in reasons
    assert result.feasible
    assert all(e.candidate.cp == 1 for e in result.estimates)


def test_pipeline_time_comes_from_the_simulator() -> None:
    stats = model_stats("llama3", "debugmodel", 256)
    prof = load_device_profile("h100")
    kw: dict[str, Any] = {"pp": 4, "dp_shard": 1, "local_batch_size": 8, "seq_len": 256}
    one = estimate_layout(stats, LayoutCandidate(schedule="1F1B", **kw), prof)
    inter = estimate_layout(stats, LayoutCandidate(schedule="Interleaved1F1B", **kw), prof)
    # 1F1B's bubble is (p - 1) / (m + p - 1) of the pipeline; interleaving with 2 stages per
    # rank halves it
    share = one.time["bubble"] / one.time["pipeline"]
    assert share == pytest.approx(3 / 11, rel=0.1)
    assert inter.time["bubble"] < 0.6 * one.time["bubble"]


def test_offload_and_ac_are_modelled() -> None:
    stats = model_stats("llama3", "8B", 8192)
    prof = load_device_profile("h100")
    base = LayoutCandidate(dp_shard=8, local_batch_size=2, seq_len=8192)
    none = estimate_layout(stats, base, prof)
    full = estimate_layout(stats, dataclasses.replace(base, ac="full"), prof)
    off = estimate_layout(stats, dataclasses.replace(base, offload_optimizer=True), prof)
    assert full.memory["activations"] < 0.2 * none.memory["activations"]
    assert full.step_time > none.step_time  # the recomputed forward
    assert off.memory["optimizer"] == 0
    assert none.memory["optimizer"] == pytest.approx(8 * stats.total_params / 8)
    # moments, master weights and gradient buffers (test_offload.py measures 16 bytes)
    assert off.host_memory == pytest.approx(16 * stats.total_params / 8)
    assert off.step_time > none.step_time  # the copies and the host step


def test_no_feasible_layout_lists_the_closest() -> None:
    result = plan_layouts("llama3", "3.1-405B", 8, "h100")
    assert not result.feasible
    closest = result.closest(5)
    assert len(closest) == 5
    assert all("memory short by" in why for _, why, _ in closest)
    assert "no layout of llama3/3.1-405B fits 8 x h100" in result.table()
    # memory and divisibility together: the nearest estimates (with their offload tier) and the
    # distinct reasons of the structures refused before estimation
    tight = plan_layouts("llama3", "8B", 6, "h100", global_batch_size=4, memory_limit=16 * 2**30)
    assert not tight.feasible
    table = tight.table()
    assert "memory short by" in table
    assert " opt " in table
    assert "refused before estimation" in table
    assert "global batch 4 is not a multiple of the data-parallel degree 6" in table
    assert "training.seq_len = 8192 must be a multiple of 12" in table


def test_bad_input() -> None:
    with pytest.raises(ValueError, match=r"unknown device profile 'tpu9'.*h100, h200"):
        plan_layouts("llama3", "8B", 8, "tpu9")
    assert {"h100", "h200", "ascend910b", "cpu"} <= set(available_device_profiles())
    with pytest.raises(ValueError, match="world_size must be an integer >= 1, got 0"):
        plan_layouts("llama3", "8B", 0, "h100")


def test_hp_plan_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hp_trainer.planner.cli import main

    out = tmp_path / "plan.toml"
    assert main(["--model", "llama3", "--flavor", "debugmodel", "--world-size", "4",
                 "--device", "cpu", "--seq-len", "128", "--top", "3",
                 "--out", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "layouts estimated" in text
    assert out.read_text().startswith("# hp-plan --model llama3")
    assert main(["--world-size", "8", "--flavor", "3.1-405B"]) == 1
    assert "the closest" in capsys.readouterr().out
    assert main(["--world-size", "8", "--device", "nope"]) == 2
    assert "unknown device profile 'nope': expected one of" in capsys.readouterr().err


def test_parallelism_auto_resolves_a_valid_layout(tmp_path: Path) -> None:
    from hp_trainer.distributed.layout_validation import validate_parallel_layout
    from hp_trainer.planner.auto import resolve_auto_layout

    cfg = _helpers().job(tmp_path, {"auto": True, "auto_device": "cpu"}, run="auto")
    resolved = resolve_auto_layout(cfg, 4)
    par = resolved.parallelism
    degrees = (par.data_parallel_replicate_degree * par.data_parallel_shard_degree
               * par.tensor_parallel_degree * par.pipeline_parallel_degree
               * par.context_parallel_degree)  # fmt: skip
    assert degrees == 4
    assert resolved.training.global_batch_size == 2 * 4  # the job's global batch is kept
    validate_parallel_layout(resolved, 4)
    plain = _helpers().job(tmp_path, {}, run="plain")
    assert resolve_auto_layout(plain, 4) is plain


def test_parameter_offload_is_searched_on_one_rank(tmp_path: Path) -> None:
    from hp_trainer import ConfigManager

    gib = 1024**3
    # llama3 8B on one 40 GiB device: 8 bytes per parameter (fp32 weights and gradients) do not
    # fit even with the optimizer offloaded; with the parameters on the host they do
    result = plan_layouts("llama3", "8B", 1, "h100", seq_len=2048, memory_limit=40 * gib)
    best = result.best
    assert best is not None
    assert best.fits
    assert best.candidate.offload_params
    assert best.candidate.ac != "swap"
    assert not any(e.fits for e in result.estimates if not e.candidate.offload_params)
    assert "params" in result.table(3)
    path = write_overlay(tmp_path / "plan.toml", "llama3", "8B", best, header="test")
    cfg = ConfigManager().parse_args(["--job.config_file", str(path)])
    assert cfg.offload.params
    assert not cfg.offload.optimizer
    # on two ranks parameter offload is never proposed (it runs without FSDP)
    two = plan_layouts("llama3", "8B", 2, "h100", seq_len=2048, memory_limit=40 * gib)
    assert not any(e.candidate.offload_params for e in two.estimates)
