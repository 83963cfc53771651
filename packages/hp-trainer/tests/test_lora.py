"""LoRA (``--model.converters lora``): adapters train, the base stays frozen, in every layout.

- One process: the converted model computes exactly the base model's logits (B starts at 0);
  A is Kaiming-uniform with PEFT's bound; only adapters are trainable; bad targets are refused
  naming the linear layers that exist; a meta-built model gets its adapters initialised.
- FSDP 2 and 3, FSDP x TP 2x2, PP 2: 3 steps equal one process (losses, gradient norms, every
  parameter at 1e-6 relative / 1e-5 absolute); the frozen base is bitwise unchanged; only
  adapters have gradients and optimizer state (counted); under TP each adapter is sharded as
  its base (A replicated / B column-wise for a column-wise base, the mirror for row-wise).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import ConfigManager, JobConfig, LoRAConfig, Trainer
from hp_trainer.components.converters.lora import apply_lora, is_lora_key
from hp_trainer.components.hf_io.config import resolve_model_args
from hp_trainer.protocols.model_spec import get_model_spec

RANK, ALPHA = 4, 8.0
# every linear of the blocks; 2 blocks x 7 linears x (A, B)
N_ADAPTER_PARAMS = 2 * 7 * 2


def _h() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def lora_job(
    folder: Path, par: dict[str, Any], *, run: str, local_bs: int = 2, **kw: Any
) -> JobConfig:
    cfg: JobConfig = _h().job(folder, par, run=run, local_bs=local_bs, **kw)
    cfg.model.converters = ["lora"]
    cfg.lora = LoRAConfig(rank=RANK, alpha=ALPHA)
    return cfg


def _tiny_model() -> torch.nn.Module:
    cfg = ConfigManager().from_dict({"model": {"flavor": "tiny"}, "training": {"seq_len": 32}})
    spec = get_model_spec("llama3")
    torch.manual_seed(0)
    model = spec.model_cls(resolve_model_args(spec, cfg))
    model.init_weights()  # type: ignore[operator]
    return model


def test_converted_model_starts_as_the_base_and_trains_adapters_only() -> None:
    model = _tiny_model()
    x = torch.randint(0, 2048, (2, 16))
    ref = model(x)
    targets = apply_lora(model, ["wq", "wk", "wv", "wo", "w1", "w2", "w3"], rank=RANK, alpha=ALPHA)
    assert len(targets) == 14
    torch.testing.assert_close(model(x), ref, rtol=0, atol=0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == N_ADAPTER_PARAMS
    assert all(is_lora_key(n) for n in trainable)
    adapter: Any = model.get_submodule("layers.0.attention.wq_lora")
    assert adapter.scaling == ALPHA / RANK
    assert torch.count_nonzero(adapter.lora_b.weight) == 0
    bound = 1.0 / math.sqrt(64)  # kaiming_uniform(a=sqrt(5)) on fan_in 64
    a = adapter.lora_a.weight
    assert a.abs().max() <= bound
    assert a.abs().max() > 0.8 * bound
    model(x).sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if not is_lora_key(n))
    assert adapter.lora_a.weight.grad is not None


def test_bad_targets_are_refused() -> None:
    with pytest.raises(ValueError, match=r"'q_proj' matches no linear layer of Decoder; its linear "
                       r"layers are layers\.\*\.attention\.wk, .*, lm_head"):  # fmt: skip
        apply_lora(_tiny_model(), ["wq", "q_proj"])
    with pytest.raises(ValueError, match="'attention' matches no linear layer"):
        apply_lora(_tiny_model(), ["attention"])
    bad: dict[str, Any]
    for bad in ({"rank": 0}, {"alpha": 0}, {"dropout": 1.0}, {"target_modules": []}):
        with pytest.raises(ValueError, match="invalid config value lora"):
            ConfigManager().from_dict({"lora": bad})


def test_meta_init_initialises_the_adapters(tmp_path: Path) -> None:
    cfg = lora_job(tmp_path, {}, run="meta", steps=2)
    cfg.model.init_device = "meta"
    trainer = Trainer(cfg)
    adapter: Any = trainer.model.get_submodule("layers.1.feed_forward.w2_lora")
    assert not adapter.lora_a.weight.is_meta
    assert torch.count_nonzero(adapter.lora_b.weight) == 0
    bound = 1.0 / math.sqrt(adapter.lora_a.in_features)
    assert 0.8 * bound < adapter.lora_a.weight.abs().max() <= bound
    losses = trainer.train()
    trainer.close()
    assert len(losses) == 2
    assert torch.count_nonzero(adapter.lora_b.weight) > 0


# -- parity ------------------------------------------------------------------------------------

_REF: dict[int, Any] = {}


def _reference(folder: Path, local_bs: int) -> Any:
    if local_bs not in _REF:
        trainer = Trainer(lora_job(folder, {}, run="ref", local_bs=local_bs))
        losses = trainer.train()
        trainer.close()
        _REF[local_bs] = (losses, trainer.grad_norms, _h().full_state(trainer.model_parts))
    return _REF[local_bs]


def _placements(part: torch.nn.Module, fqn: str) -> tuple[Any, ...]:
    p = part.get_parameter(fqn)
    return tuple(p.placements) if isinstance(p, DTensor) else ()


def _train(folder: str, par: dict[str, Any], local_bs: int) -> Any:
    trainer = Trainer(lora_job(Path(folder), par, run=f"r{dist.get_rank()}", local_bs=local_bs))
    try:
        init = _h().full_state(trainer.model_parts)
        losses = trainer.train()
        final = _h().full_state(trainer.model_parts)
        frozen_same = all(torch.equal(init[k], final[k]) for k in init if not is_lora_key(k))
        grads = sorted(
            n for part in trainer.model_parts for n, p in part.named_parameters()
            if p.grad is not None
        )  # fmt: skip
        opt_states = sum(len(opt.state) for opt in trainer.optimizers)
        opt_params = sum(len(g["params"]) for opt in trainer.optimizers for g in opt.param_groups)
        part = trainer.model_parts[0]
        names = [n for n, _ in part.named_parameters()]
        tp = {
            n: _placements(part, n)
            for n in names
            if "layers.0.attention.wq" in n or "layers.0.feed_forward.w2" in n
        }
        if "tensor_parallel_degree" in par:  # the merged + PEFT export from FSDP x TP shards
            trainer.checkpointer.export_hf(Path(folder) / "hf")
        return losses, trainer.grad_norms, final, frozen_same, grads, opt_states, opt_params, tp
    finally:
        trainer.close()


_CASES = {
    "fsdp2": (2, {"data_parallel_shard_degree": 2}, 2),
    "fsdp3": (3, {"data_parallel_shard_degree": 3}, 3),
    "fsdp2xtp2": (4, {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}, 2),
    "pp2": (2, {"pipeline_parallel_degree": 2}, 1),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_lora_layouts_match_one_process(tmp_path: Path, case: str) -> None:
    ws, par, dp = _CASES[case]
    local_bs = 2
    results = run_distributed(_train, ws, str(tmp_path), par, local_bs, timeout=150)
    ref_losses, ref_norms, ref_state = _reference(tmp_path, local_bs * dp)
    assert all(torch.count_nonzero(v) > 0 for k, v in ref_state.items() if "lora_b" in k)  # trained
    seen: set[str] = set()
    pp = par.get("pipeline_parallel_degree", 1)
    for losses, norms, state, frozen_same, grads, opt_states, opt_params, tp in results:
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-6
        )
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-4, atol=0)
        for key, value in state.items():
            torch.testing.assert_close(
                value, ref_state[key], rtol=1e-6, atol=1e-5, msg=f"{key} differs"
            )
        seen |= set(state)
        assert frozen_same  # the base never moves
        assert grads
        assert all(is_lora_key(g) for g in grads)
        # optimizer state: one entry per adapter parameter of this rank's stage(s), nothing else
        assert opt_states == opt_params == len(grads)
        if pp == 1:
            assert opt_states == N_ADAPTER_PARAMS
        if par.get("tensor_parallel_degree", 1) > 1:
            tp_dim = -1  # the TP mesh dimension is the last of FSDP's 2-D (dp, tp) layout
            wq = tp["layers.0.attention.wq.weight"]
            assert wq[tp_dim] == Shard(0)
            assert tp["layers.0.attention.wq_lora.lora_a.weight"][tp_dim] == Replicate()
            assert tp["layers.0.attention.wq_lora.lora_b.weight"][tp_dim] == Shard(0)
            assert tp["layers.0.feed_forward.w2.weight"][tp_dim] == Shard(1)
            assert tp["layers.0.feed_forward.w2_lora.lora_a.weight"][tp_dim] == Shard(1)
            assert tp["layers.0.feed_forward.w2_lora.lora_b.weight"][tp_dim] == Replicate()
    if pp > 1:
        assert sum(r[5] for r in results) == N_ADAPTER_PARAMS  # the stages hold all, once
    if "tensor_parallel_degree" in par:
        _check_export(tmp_path / "hf", ref_state)
    assert seen == set(ref_state)


def _check_export(folder: Path, ref_state: dict[str, torch.Tensor]) -> None:
    """The export written from FSDP x TP shards: merged weights == the one-process model's
    base + scaling * B A; the PEFT adapter holds its A and B (B's rows in HF's rotary order)."""
    from safetensors.torch import load_file

    import hp_dcp
    from hp_trainer import Llama3StateDictAdapter
    from hp_trainer.components.converters.lora import (
        merge_lora_state_dict,
        peft_adapter_state_dict,
    )

    adapter = Llama3StateDictAdapter(_tiny_model().args)  # type: ignore[arg-type]
    expected = adapter.to_hf(merge_lora_state_dict(ref_state, ALPHA / RANK))
    exported = hp_dcp.load_hf_safetensors(folder)
    assert set(exported) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(exported[key], value, rtol=1e-6, atol=1e-5)
    peft_tensors = load_file(str(folder / "adapter" / "adapter_model.safetensors"))
    expected_peft = peft_adapter_state_dict(ref_state, adapter)
    assert len(peft_tensors) == N_ADAPTER_PARAMS
    assert set(peft_tensors) == set(expected_peft)
    for key, value in expected_peft.items():
        torch.testing.assert_close(peft_tensors[key], value, rtol=1e-6, atol=1e-5)
