"""Declarative sharding: the families' tables give what the imperative plans gave.

``DENSE_DECODER_SHARDING``, ``MOE_DECODER_SHARDING`` and ``DEEPSEEK_V3_SHARDING``
(:class:`~hp_trainer.protocols.sharding.ShardingConfig` tables next to the modules: TP, EP and CP
sections), applied by the generic :func:`~hp_trainer.distributed.sharding.apply_sharding`,
replaced the per-block TP and expert plan code of the four families and the RoPE table sharded
by name. The oracle is that code, kept in the tests (``_old_sharding_plans.py``): under TP (all
four families), EP, EP x TP (both MoE families), CP (llama3), PP x EP (deepseek_v3) and MoE x
CP x EP x PP, every parameter has the same placements and local shape, and 3 steps give bitwise
the same losses and gradient norms.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import Trainer
from hp_trainer.distributed.context_parallel import ContextParallelStep
from hp_trainer.protocols.model_spec import get_model_spec
from hp_trainer.protocols.sharding import ShardingConfig, ShardingRule


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _old() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_old_sharding_plans.py"), "hp_trainer_tests_old_sharding_plans"
    )


def _run(folder: str, model: str, par: dict[str, Any], imperative: bool) -> Any:
    spec = get_model_spec(model)
    originals = (spec.parallelize_fn, ContextParallelStep.sharded)
    if imperative:
        old = _old()
        moe = model in ("qwen3_moe", "deepseek_v3")
        spec.parallelize_fn = old.parallelize_moe_decoder if moe else old.parallelize_dense_decoder
        ContextParallelStep.sharded = old.sharded  # type: ignore[method-assign]
    try:
        run = f"{'old' if imperative else 'table'}-{model}-r{dist.get_rank()}"
        trainer = Trainer(_helpers().job(Path(folder), par, run=run, model=model))
        losses = trainer.train()
        trainer.close()
    finally:
        spec.parallelize_fn, ContextParallelStep.sharded = originals  # type: ignore[method-assign]
    placements = {
        name: (tuple(p.placements), tuple(p.to_local().shape))
        for part in trainer.model_parts
        for name, p in part.named_parameters()
        if isinstance(p, DTensor)
    }
    return losses, trainer.grad_norms, placements


def _both(folder: str, model: str, par: dict[str, Any]) -> Any:
    return _run(folder, model, par, imperative=False), _run(folder, model, par, imperative=True)


_DP2_TP2_EP2 = {
    "data_parallel_shard_degree": 2,
    "tensor_parallel_degree": 2,
    "expert_parallel_degree": 2,
}
_LAYOUTS = {
    # TP: the four families
    "llama3-tp2": ("llama3", 2, {"tensor_parallel_degree": 2}),
    "qwen3-tp2": ("qwen3", 2, {"tensor_parallel_degree": 2}),
    "llama3-dp2xtp2": (
        "llama3",
        4,
        {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2},
    ),
    "qwen3_moe-tp2": ("qwen3_moe", 2, {"tensor_parallel_degree": 2}),
    "deepseek_v3-tp2": ("deepseek_v3", 2, {"tensor_parallel_degree": 2}),
    # EP alone: ExpertParallel over ep 2 (borrowed from dp_shard)
    "qwen3_moe-dp2xep2": (
        "qwen3_moe",
        2,
        {"data_parallel_shard_degree": 2, "expert_parallel_degree": 2},
    ),
    "deepseek_v3-dp2xep2": (
        "deepseek_v3",
        2,
        {"data_parallel_shard_degree": 2, "expert_parallel_degree": 2},
    ),
    # EP x TP: ExpertTensorParallel on the [ep, tp] mesh
    "qwen3_moe-dp2xtp2xep2": ("qwen3_moe", 4, _DP2_TP2_EP2),
    "deepseek_v3-dp2xtp2xep2": ("deepseek_v3", 4, _DP2_TP2_EP2),
    # CP: the RoPE table from the table's cp section
    "llama3-cp2": ("llama3", 2, {"context_parallel_degree": 2}),
    # PP x EP: deepseek_v3's first stage holds dense blocks only (an ep section matching none)
    "deepseek_v3-pp2xdp2xep2": (
        "deepseek_v3",
        4,
        {"pipeline_parallel_degree": 2, "expert_parallel_degree": 2},
    ),
    # MoE x CP x EP x PP: the cp section of each stage's own table
    "qwen3_moe-pp2xcp2xep2": (
        "qwen3_moe",
        4,
        {
            "pipeline_parallel_degree": 2,
            "context_parallel_degree": 2,
            "expert_parallel_degree": 2,
            "context_parallel_rotate_method": "ring",
        },
    ),
}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_table_equals_the_imperative_plan_bitwise(tmp_path: Path, layout: str) -> None:
    model, world, par = _LAYOUTS[layout]
    for table, old in run_distributed(_both, world, str(tmp_path), model, par, timeout=240):
        assert table[2] == old[2]  # every parameter: placements and local shape
        assert len(table[2]) > 10
        assert table[0] == old[0]  # losses, bitwise
        assert table[1] == old[1]  # gradient norms, bitwise


def test_patterns_match_one_name_per_star_and_skip_absent_modules() -> None:
    rule = ShardingRule("layers.*.attention.wq", lambda o: o["style"])
    assert rule.matches("layers.0.attention.wq")
    assert not rule.matches("layers.0.attention.wqa")
    assert not rule.matches("layers.0.1.attention.wq")
    assert not rule.matches("x.layers.0.attention.wq")
    config = ShardingConfig(tp=(rule, ShardingRule("lm_head", lambda o: "head")))
    fqns = ["layers.0.attention.wq", "layers.1.attention.wq", "layers.1.attention.wk"]
    assert config.plan(fqns, {"style": "col"}) == {
        "layers.0.attention.wq": "col",
        "layers.1.attention.wq": "col",
    }  # no lm_head in this stage: not an error
    with pytest.raises(ValueError, match="dotted FQN"):
        ShardingRule("layers..wq", lambda o: None)


def test_a_table_for_another_model_is_refused() -> None:
    from hp_trainer.distributed.sharding import apply_sharding
    from hp_trainer.models.common.tensor_parallel import DENSE_DECODER_SHARDING

    with pytest.raises(ValueError, match=r"no module of Linear matches .*dense decoder"):
        apply_sharding(nn.Linear(2, 2), DENSE_DECODER_SHARDING, _MESH)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"no buffer of Linear matches the cp section"):
        apply_sharding(nn.Linear(2, 2), DENSE_DECODER_SHARDING, None, cp_mesh=_MESH)  # type: ignore[arg-type]
    wrong = ShardingConfig(cp=(ShardingRule("rope_cache", lambda o: "Shard(0)"),))
    with pytest.raises(TypeError, match=r"a cp rule places a buffer with Shard"):
        apply_sharding(_Block(), wrong, None, cp_mesh=_MESH)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"expert_layout must be one of .*'sideways'"):
        apply_sharding(nn.Linear(2, 2), DENSE_DECODER_SHARDING, None, expert_layout="sideways")


_MESH = SimpleNamespace(ndim=2)  # the recording style below never reads its mesh


class _Recorded:
    """A style (PyTorch's protocol: ``_apply``) that records what it was built with and given."""

    def __init__(self, log: list[Any], **options: Any) -> None:
        self.log, self.options = log, options

    def _apply(self, module: nn.Module, mesh: Any) -> nn.Module:
        self.log.append((type(module).__name__, mesh is _MESH, self.options))
        return module


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Linear(2, 2)
        self.register_buffer("rope_cache", torch.zeros(8, 2))


def test_ep_and_cp_sections_are_applied_with_the_dispatcher_options() -> None:
    from hp_trainer.distributed.sharding import apply_sharding, context_parallel_buffers

    log: list[Any] = []
    model = nn.Sequential(_Block(), _Block())
    config = ShardingConfig(
        ep=(ShardingRule("*.experts", lambda o: _Recorded(log, **o)),),
        cp=(ShardingRule("*.rope_cache", lambda o: Shard(0)),),
        dispatcher={"dedup": False, "capacity": 2},
    )
    applied = apply_sharding(
        model,
        config,
        None,
        expert_mesh=_MESH,  # type: ignore[arg-type]
        expert_layout="ep_tp",
        dispatcher={"dedup": True},
    )
    options = {"expert_layout": "ep_tp", "dispatcher": {"dedup": True, "capacity": 2}}
    assert log == [("Linear", True, options), ("Linear", True, options)]
    assert set(applied) == {"0.experts", "1.experts"}
    assert context_parallel_buffers(model) == {}  # no cp_mesh: no CP placements
    applied = apply_sharding(model, config, None, cp_mesh=_MESH)  # type: ignore[arg-type]
    assert applied == {"0.rope_cache": Shard(0), "1.rope_cache": Shard(0)}
    assert context_parallel_buffers(model) == applied
    assert len(log) == 2  # the ep section is skipped without an expert mesh
    # a stage of dense blocks has no experts: not an error (its tp/cp sections still check)
    dense = nn.Sequential(nn.Linear(2, 2))
    assert apply_sharding(dense, config, None, expert_mesh=_MESH) == {}  # type: ignore[arg-type]


def test_the_families_declare_ep_and_cp_and_the_dispatcher_reaches_the_styles() -> None:
    from hp_cp_ep import ExpertParallel, ExpertTensorParallel, TensorParallel
    from hp_trainer.distributed.context_parallel import supports_context_parallel
    from hp_trainer.models.common.expert_parallel import expert_style

    for name in ("llama3", "qwen3", "qwen3_moe", "deepseek_v3"):
        spec = get_model_spec(name)
        assert spec.sharding is not None
        assert spec.sharding.cp, name
        assert supports_context_parallel(spec)
        assert bool(spec.sharding.ep) == (name in ("qwen3_moe", "deepseek_v3"))
    base: dict[str, Any] = {"dispatcher": {}}
    styles = {k: expert_style({**base, "expert_layout": k}) for k in ("ep", "ep_tp", "tp")}
    assert {k: type(v) for k, v in styles.items()} == {
        "ep": ExpertParallel,
        "ep_tp": ExpertTensorParallel,
        "tp": TensorParallel,
    }
    # options the style does not take reach its constructor (not dropped on the way)
    with pytest.raises(TypeError, match=r"no_such_option|takes no arguments"):
        expert_style({"expert_layout": "ep", "dispatcher": {"no_such_option": 1}})
    with pytest.raises(ValueError, match=r"dispatcher options \['dedup'\] need expert"):
        expert_style({"expert_layout": "tp", "dispatcher": {"dedup": True}})


def test_a_context_parallel_step_refuses_a_part_without_placements() -> None:
    step = ContextParallelStep.__new__(ContextParallelStep)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    refused = pytest.raises(ValueError, match="Linear has no context-parallel placements")
    with refused, step.sharded([nn.Linear(2, 2)], tokens, tokens):
        pass
