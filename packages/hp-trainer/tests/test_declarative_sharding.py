"""Declarative sharding: the families' tables give what the imperative plans gave.

``DENSE_DECODER_SHARDING``, ``MOE_DECODER_SHARDING`` and ``DEEPSEEK_V3_SHARDING``
(:class:`~hp_trainer.protocols.sharding.ShardingConfig` tables next to the modules), applied by
the generic :func:`~hp_trainer.distributed.sharding.apply_sharding`, replaced the per-block TP
plan code of the four families. The oracle is that code, kept in the tests (here and
``_old_moe_tp_plan.py``): under tp 2 (all four families), dp_shard 2 x tp 2 (llama3) and
dp_shard 2 x tp 2 x ep 2 (both MoE families), every parameter has the same placements and local
shape, and 3 steps give bitwise the same losses and gradient norms.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import Trainer
from hp_trainer.protocols.sharding import ShardingConfig, ShardingRule


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _imperative_apply_tp(model: nn.Module, tp_mesh: Any, loss_parallel: bool, **_: Any) -> None:
    """The dense plan as it was written before the table (the oracle)."""
    from hp_trainer._parallel_api import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    parallelize_module(model, tp_mesh, {k: v for k, v in top.items() if getattr(model, k, None)})
    for block in model.get_submodule("layers").children():
        plan: dict[str, Any] = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        if getattr(block.get_submodule("attention"), "q_norm", None) is not None:
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)


def _run(folder: str, model: str, par: dict[str, Any], imperative: bool) -> Any:
    import hp_trainer.models.common.expert_parallel as moe_recipe
    import hp_trainer.models.common.parallelize as recipe

    old_moe = load_test_module(
        Path(__file__).with_name("_old_moe_tp_plan.py"), "hp_trainer_tests_old_moe_tp_plan"
    )
    originals = (recipe.apply_tp, moe_recipe.apply_tp_to_moe_decoder)
    if imperative:
        recipe.apply_tp = _imperative_apply_tp  # type: ignore[assignment]
        moe_recipe.apply_tp_to_moe_decoder = old_moe.apply_tp_to_moe_decoder
    try:
        run = f"{'old' if imperative else 'table'}-{model}-r{dist.get_rank()}"
        trainer = Trainer(_helpers().job(Path(folder), par, run=run, model=model))
        losses = trainer.train()
        trainer.close()
    finally:
        recipe.apply_tp, moe_recipe.apply_tp_to_moe_decoder = originals  # type: ignore[assignment]
    placements = {
        name: (tuple(p.placements), tuple(p.to_local().shape))
        for name, p in trainer.model.named_parameters()
        if isinstance(p, DTensor)
    }
    return losses, trainer.grad_norms, placements


def _both(folder: str, model: str, par: dict[str, Any]) -> Any:
    return _run(folder, model, par, imperative=False), _run(folder, model, par, imperative=True)


@pytest.mark.parametrize(
    ("model", "world", "par"),
    [
        ("llama3", 2, {"tensor_parallel_degree": 2}),
        ("qwen3", 2, {"tensor_parallel_degree": 2}),
        ("llama3", 4, {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}),
        ("qwen3_moe", 2, {"tensor_parallel_degree": 2}),
        ("deepseek_v3", 2, {"tensor_parallel_degree": 2}),
        (
            "qwen3_moe",
            4,
            {
                "data_parallel_shard_degree": 2,
                "tensor_parallel_degree": 2,
                "expert_parallel_degree": 2,
            },
        ),
        (
            "deepseek_v3",
            4,
            {
                "data_parallel_shard_degree": 2,
                "tensor_parallel_degree": 2,
                "expert_parallel_degree": 2,
            },
        ),
    ],
    ids=[
        "llama3-tp2",
        "qwen3-tp2",
        "llama3-dp2xtp2",
        "qwen3_moe-tp2",
        "deepseek_v3-tp2",
        "qwen3_moe-dp2xtp2xep2",
        "deepseek_v3-dp2xtp2xep2",
    ],
)
def test_table_equals_the_imperative_plan_bitwise(
    tmp_path: Path, model: str, world: int, par: dict[str, Any]
) -> None:
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
        apply_sharding(nn.Linear(2, 2), DENSE_DECODER_SHARDING, None)  # type: ignore[arg-type]
