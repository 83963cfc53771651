"""Layouts that cannot work fail up front (parse/preflight time, no process group), naming the
values; every layout the trainer runs passes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from hp_trainer import ConfigManager, JobConfig
from hp_trainer.distributed.layout_validation import validate_parallel_layout
from hp_trainer.preflight import preflight


def _cfg(
    par: dict[str, Any], model: str = "llama3", flavor: str = "tiny", **sections: Any
) -> JobConfig:
    values: dict[str, Any] = {
        "model": {"name": model, "flavor": flavor},
        "training": {"local_batch_size": 2, "seq_len": 32},
        "parallelism": par,
    }
    values.update(sections)
    return ConfigManager().from_dict(values)


_BAD = [
    # (world size, parallelism, model, flavor, words the message must contain)
    (4, {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 3}, "llama3", "tiny",
     ["tp(3)", "= 6 != world_size(4)"]),
    (3, {"tensor_parallel_degree": 3}, "llama3", "tiny",
     ["tensor_parallel_degree = 3", "n_heads = 4"]),
    (2, {"tensor_parallel_degree": 2}, "llama3", "3.2-1B",
     ["tensor_parallel_degree = 2", "ties its embedding"]),
    (2, {"pipeline_parallel_degree": 2}, "qwen3", "0.6B",
     ["pipeline_parallel_degree = 2", "ties its embedding"]),
    # 2 ranks x 2 stages each = 4 stages but the tiny model has 2 blocks + 2 ends: fine; 4 x 2 not
    (4, {"pipeline_parallel_degree": 4, "pipeline_parallel_schedule": "Interleaved1F1B"},
     "llama3", "tiny", ["needs 8 stages", "only 2 blocks"]),
    (2, {"pipeline_parallel_degree": 2, "pipeline_parallel_microbatch_size": 3}, "llama3", "tiny",
     ["pipeline_parallel_microbatch_size = 3", "local_batch_size = 2"]),
    (3, {"context_parallel_degree": 3}, "llama3", "tiny", ["seq_len = 32", "multiple of 6"]),
    (2, {"context_parallel_degree": 2, "context_parallel_ulysses_degree": 2}, "llama3", "tiny",
     ["context_parallel_ulysses_degree = 2", "'hybrid'"]),
    (4, {"context_parallel_degree": 4, "context_parallel_rotate_method": "hybrid",
         "context_parallel_ulysses_degree": 3}, "llama3", "tiny",
     ["context_parallel_ulysses_degree = 3", "must divide context_parallel_degree = 4"]),
    (2, {"expert_parallel_degree": 2}, "llama3", "tiny",
     ["expert_parallel_degree = 2", "has no experts"]),
    (2, {"enable_async_tensor_parallel": True}, "llama3", "tiny",
     ["enable_async_tensor_parallel"]),
]  # fmt: skip


@pytest.mark.parametrize(("ws", "par", "model", "flavor", "words"), _BAD)
def test_impossible_layouts_fail_up_front_naming_the_values(
    ws: int, par: dict[str, Any], model: str, flavor: str, words: list[str]
) -> None:
    assert not dist.is_initialized()  # nothing distributed is needed to find out
    with pytest.raises(ValueError, match=r"invalid parallel layout|world_size") as info:
        validate_parallel_layout(_cfg(par, model, flavor), ws)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_pipeline_validation_batch_must_be_a_multiple_of_the_local_batch() -> None:
    def cfg(validation_batch: int) -> JobConfig:
        validation = {"enable": True, "dataset": "tiny_stories_synth"}
        return _cfg(
            {"pipeline_parallel_degree": 2},
            validation={**validation, "local_batch_size": validation_batch},
        )

    validate_parallel_layout(cfg(4), 2)  # the validation loop runs under PP
    with pytest.raises(ValueError, match=r"validation\.local_batch_size = 3 with pipeline") as e:
        validate_parallel_layout(cfg(3), 2)
    assert "training.local_batch_size = 2" in str(e.value)


def test_cp_with_a_model_without_a_cp_path_fails_up_front(monkeypatch: Any) -> None:
    import dataclasses

    import hp_trainer.protocols.model_spec as model_spec

    spec = model_spec.get_model_spec("deepseek_v3")
    # an attention without a CP path: no cp section (no table) and no context_parallel flag
    plain = dataclasses.replace(spec, context_parallel=False, sharding=None)
    monkeypatch.setattr(model_spec, "get_model_spec", lambda name: plain)
    with pytest.raises(ValueError, match="deepseek_v3/tiny's attention has no context-parallel"):
        validate_parallel_layout(_cfg({"context_parallel_degree": 2}, "deepseek_v3"), 2)


def test_pp_with_a_model_without_a_splitter_fails_up_front(monkeypatch: Any) -> None:
    import dataclasses

    import hp_trainer.protocols.model_spec as model_spec

    spec = model_spec.get_model_spec("qwen3_moe")
    plain = dataclasses.replace(spec, pipelining_fn=None)
    monkeypatch.setattr(model_spec, "get_model_spec", lambda name: plain)
    with pytest.raises(ValueError, match="pipeline_parallel_degree = 2") as info:
        validate_parallel_layout(_cfg({"pipeline_parallel_degree": 2}, "qwen3_moe"), 8)
    assert "'qwen3_moe'" in str(info.value)
    assert "no pipeline splitter" in str(info.value)


def test_moe_models_with_cp_pp_and_ep_are_accepted() -> None:
    for model in ("qwen3_moe", "deepseek_v3"):
        for par in (
            {"context_parallel_degree": 2, "expert_parallel_degree": 2},
            {"pipeline_parallel_degree": 2, "expert_parallel_degree": 2},
            {"pipeline_parallel_degree": 2, "context_parallel_degree": 2},
        ):
            validate_parallel_layout(_cfg(par, model), 4)


def test_ulysses_degree_must_divide_the_heads() -> None:
    cfg = _cfg({"context_parallel_degree": 3, "context_parallel_rotate_method": "ulysses"},
               training={"local_batch_size": 2, "seq_len": 48})  # fmt: skip
    with pytest.raises(ValueError, match=r"splits the 4 query heads .* over 3 ranks"):
        validate_parallel_layout(cfg, 3)


def test_activation_checkpointing_with_cp_is_accepted() -> None:
    # the recomputation is context-parallel (test_cp_activation_checkpoint.py trains them)
    for ac in ({"mode": "full"}, {"mode": "selective", "selective_ac_option": "op"},
               {"mode": "selective"}, {"mode": "swap"}):  # fmt: skip
        validate_parallel_layout(_cfg({"context_parallel_degree": 2}, activation_checkpoint=ac), 2)


def test_fullgraph_compile_with_cp_fails_up_front() -> None:
    cfg = _cfg({"context_parallel_degree": 2}, compile={"enable": True})
    with pytest.raises(ValueError, match=r"compile\.fullgraph = true with context_parallel_deg"):
        validate_parallel_layout(cfg, 2)
    # the attention as a graph break between compiled pieces is accepted
    cfg = _cfg({"context_parallel_degree": 2}, compile={"enable": True, "fullgraph": False})
    validate_parallel_layout(cfg, 2)


def test_global_batch_not_a_multiple_fails_up_front() -> None:
    training = {"local_batch_size": 2, "global_batch_size": 6, "seq_len": 32}
    cfg = _cfg({"data_parallel_shard_degree": 2}, training=training)
    with pytest.raises(ValueError, match="global_batch_size = 6 must be a multiple of"):
        validate_parallel_layout(cfg, 2)


def test_schedule_options_are_checked_at_parse_time(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_schedule = 'Zigzag'"):
        ConfigManager().parse_args(["--parallelism.pipeline_parallel_schedule", "Zigzag"])
    missing = str(tmp_path / "none.csv")
    with pytest.raises(ValueError, match="pipeline_parallel_schedule_csv"):
        ConfigManager().parse_args(["--parallelism.pipeline_parallel_schedule_csv", missing])
    with pytest.raises(ValueError, match="context_parallel_rotate_method = 'spiral'"):
        ConfigManager().parse_args(["--parallelism.context_parallel_rotate_method", "spiral"])
    with pytest.raises(ValueError, match="pipeline_parallel_microbatch_size = 0"):
        ConfigManager().parse_args(["--parallelism.pipeline_parallel_microbatch_size", "0"])


_GOOD = [
    (4, {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 2}),
    (4, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2,
         "pipeline_parallel_schedule": "ZBVZeroBubble"}),
    (4, {"context_parallel_degree": 2, "data_parallel_shard_degree": 2}),
    (4, {"context_parallel_degree": 2, "tensor_parallel_degree": 2,
         "context_parallel_rotate_method": "ulysses"}),
    (4, {"context_parallel_degree": 4, "context_parallel_rotate_method": "hybrid",
         "context_parallel_ulysses_degree": 2}),
    (8, {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 2,
         "tensor_parallel_degree": 2}),
]  # fmt: skip


@pytest.mark.parametrize(("ws", "par"), _GOOD)
def test_composable_layouts_pass(ws: int, par: dict[str, Any]) -> None:
    seq = 64 if par.get("context_parallel_degree", 1) == 4 else 32
    cfg = _cfg(par, training={"local_batch_size": 2, "seq_len": seq})
    validate_parallel_layout(cfg, ws)


def test_preflight_runs_the_layout_check() -> None:
    # hp-train calls preflight before it starts any rank
    with pytest.raises(ValueError, match="tensor_parallel_degree = 3 must divide"):
        preflight(_cfg({"tensor_parallel_degree": 3}, model="deepseek_v3"), 3)


def test_fullgraph_compile_of_an_moe_with_ep_or_fp32_fails_up_front() -> None:
    fp32 = {"mixed_precision_param": "float32"}
    for par, training in (({"expert_parallel_degree": 2}, {}), ({}, fp32)):
        cfg = _cfg(
            {"data_parallel_shard_degree": 2, **par}, "qwen3_moe", compile={"enable": True},
            training={"local_batch_size": 2, "seq_len": 32, **training},
        )  # fmt: skip
        with pytest.raises(ValueError, match=r"compile\.fullgraph = true with model qwen3_moe"):
            validate_parallel_layout(cfg, 2)
    # bf16 without EP compiles as one graph; fullgraph = false accepts the graph breaks
    validate_parallel_layout(_cfg({"data_parallel_shard_degree": 2}, "qwen3_moe",
                                  compile={"enable": True}), 2)  # fmt: skip
    cfg = _cfg({"expert_parallel_degree": 2, "data_parallel_shard_degree": 2}, "qwen3_moe",
               compile={"enable": True, "fullgraph": False})  # fmt: skip
    validate_parallel_layout(cfg, 2)
