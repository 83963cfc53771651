"""``--moe.hot_expert_replicas``: the trainer re-plans expert replicas and trains unchanged.

Lean: the tiny Qwen 3 MoE with a skewed gate, EP 2 borrowed from FSDP 2 on two ranks, 2 steps
(the second runs with the replicas planned from the first's load), against the same job without
replicas (the EP job itself is checked against one process in ``test_trainer_ep_parity.py``).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from hp_cp_ep import MoE
from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import JobConfig, Trainer
from hp_trainer.components.expert_load import ExpertLoadTracker
from hp_trainer.config import MoEConfig
from hp_trainer.protocols.model_spec import get_model_spec

_PAR = {"data_parallel_shard_degree": 2, "expert_parallel_degree": 2}


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _train(folder: str, replicas: int) -> Any:
    cfg: JobConfig = _helpers().job(
        Path(folder), _PAR, run=f"hot{replicas}", model="qwen3_moe", steps=2
    )
    cfg.moe.hot_expert_replicas = replicas
    cfg.moe.hot_expert_update_interval = 1
    trainer = Trainer(cfg)
    for module in trainer.model.modules():  # a skewed router: expert 0 takes most tokens
        if isinstance(module, MoE):
            gate = module.router.gate.weight
            with torch.no_grad():
                full = gate.full_tensor() if isinstance(gate, DTensor) else gate.clone()
                full[0] += 0.5
                if isinstance(gate, DTensor):
                    full = distribute_tensor(full, gate.device_mesh, gate.placements)
                gate.copy_(full)
    try:
        losses = trainer.train()
        state = _helpers().full_state([trainer.model])
        plans, rows = {}, 0
        for name, module in trainer.model.named_modules():
            if isinstance(module, MoE):
                dispatcher = module.experts.token_dispatcher
                plans[name] = dispatcher.hot_expert_replicas
                rows += dispatcher.last_received_rows
        table = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(table, torch.tensor([float(rows)]))
        return losses, state, plans, [float(t) for t in table]
    finally:
        trainer.close()


def test_hot_expert_replicas_train_like_none(tmp_path: Path) -> None:
    plain = run_distributed(_train, 2, str(tmp_path), 0, timeout=180)
    replicated = run_distributed(_train, 2, str(tmp_path), 1, timeout=180)
    for (losses, state, plans, _), (ref_losses, ref_state, ref_plans, _) in zip(
        replicated, plain, strict=True
    ):
        assert all(plan == [] for plan in ref_plans.values())
        assert plans, "no MoE layer"
        assert all(len(plan) <= 1 for plan in plans.values()), plans
        assert any(plan for plan in plans.values()), plans
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=1e-6
        )
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-6, msg=name)
    rows, ref_rows = replicated[0][3], plain[0][3]
    print(f"rows per rank, last micro-batch: replicated {rows}, plain {ref_rows}")


def test_hot_expert_replicas_need_expert_parallelism() -> None:
    model = get_model_spec("qwen3_moe").build("tiny")
    with pytest.raises(ValueError, match="needs expert parallelism"):
        ExpertLoadTracker([model], None, hot_expert_replicas=1)
    with pytest.raises(ValueError, match="hot_expert_update_interval >= 1"):
        MoEConfig(hot_expert_update_interval=0)
