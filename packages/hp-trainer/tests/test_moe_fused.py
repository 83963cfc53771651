"""``--moe.fused true``: the MoE experts through ``hp_kernels.mega_moe``, training unchanged.

One process on the CPU, qwen3_moe tiny (dim 64, expert hidden 32: ``torch._grouped_mm``
applies, so the fused reference kernel runs the same ops): three steps' losses, gradient norms
and final weights are bitwise equal to the unfused run, and every MoE layer ran the one fused
op (counted). A model without MoE layers refuses the switch at parse time.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import hp_cp_ep.ep.experts as experts_module
from hp_cp_ep import GroupedExperts
from hp_dtensor.testing import load_test_module
from hp_trainer import Trainer
from hp_trainer.config import ConfigManager


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _train(folder: Path, fused: bool) -> tuple[Any, ...]:
    config = _helpers().job(folder, {}, run=f"fused{fused}", model="qwen3_moe", steps=3)
    config.moe.fused = fused
    trainer = Trainer(config)
    real = experts_module.mega_moe
    calls = [0]

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        out: torch.Tensor = real(*args, **kwargs)
        return out

    experts_module.mega_moe = counting  # the module that calls the fused op
    try:
        experts = [m for m in trainer.model_parts[0].modules() if isinstance(m, GroupedExperts)]
        assert experts
        assert all(e.fuses_routing() == fused for e in experts)
        losses = trainer.train()
        state = _helpers().full_state(trainer.model_parts)
        return losses, trainer.grad_norms, state, calls[0], len(experts)
    finally:
        experts_module.mega_moe = real
        trainer.close()


def test_fused_moe_trains_bitwise_like_unfused(tmp_path: Path) -> None:
    losses, norms, state, calls, _ = _train(tmp_path, False)
    assert calls == 0
    f_losses, f_norms, f_state, f_calls, layers = _train(tmp_path, True)
    assert f_calls == 3 * layers  # one fused op per MoE layer per step
    assert f_losses == losses
    assert f_norms == norms
    assert f_state.keys() == state.keys()
    for name, value in state.items():
        assert torch.equal(f_state[name], value), name


def test_fused_needs_a_moe_model(tmp_path: Path) -> None:
    config = ConfigManager().parse_args(
        ["--model.name", "llama3", "--model.flavor", "tiny", "--moe.fused", "true"]
    )
    assert config.moe.fused is True
    from hp_trainer.components.hf_io.config import resolve_model_args
    from hp_trainer.protocols.model_spec import get_model_spec

    with pytest.raises(ValueError, match=r"moe\.fused = true with model llama3"):
        resolve_model_args(get_model_spec("llama3"), config)
