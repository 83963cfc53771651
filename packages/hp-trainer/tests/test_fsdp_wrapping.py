"""apply_fsdp_to_decoder: unit boundaries, reshard decisions, tying, MoE expert sharding."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

import hp_trainer.distributed.fsdp as fsdp_mod
from hp_dtensor.testing import distributed
from hp_trainer import (
    Decoder,
    DecoderArgs,
    apply_fsdp_to_decoder,
    disable_fsdp_gradient_division,
    enable_fsdp_symm_mem,
    get_fsdp_reshard_after_forward_policy,
)
from hp_trainer._parallel_api import FSDPModule


class _FakeMesh:
    def __init__(self, size: int, name: str) -> None:
        self._size = size
        self.name = name

    def size(self) -> int:
        return self._size


class _Recorder:
    """Stands in for fully_shard: records each call and gives modules prefetch recorders."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[nn.Module], dict[str, Any]]] = []
        self.forward: dict[int, list[nn.Module]] = {}
        self.backward: dict[int, list[nn.Module]] = {}

    def __call__(self, module: Any, **kwargs: Any) -> Any:
        modules = module if isinstance(module, list) else [module]
        self.calls.append((modules, kwargs))
        for m in modules:
            object.__setattr__(
                m,
                "set_modules_to_forward_prefetch",
                lambda mods, m=m: self.forward.__setitem__(id(m), list(mods)),
            )
            object.__setattr__(
                m,
                "set_modules_to_backward_prefetch",
                lambda mods, m=m: self.backward.__setitem__(id(m), list(mods)),
            )
        return module

    def call_for(self, module: nn.Module) -> dict[str, Any]:
        for modules, kwargs in self.calls:
            if any(m is module for m in modules):
                return kwargs
        raise AssertionError(f"{type(module).__name__} was not wrapped")


class _Experts(nn.Module):
    def __init__(self, num_experts: int, dim: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, dim, 2 * dim))
        self.w2 = nn.Parameter(torch.randn(num_experts, 2 * dim, dim))


class _MoE(nn.Module):
    def __init__(self, num_experts: int, dim: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = _Experts(num_experts, dim)


class _MoEBlock(nn.Module):
    moe_enabled = True

    def __init__(self, num_experts: int, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.moe = _MoE(num_experts, dim)


class _ToyMoEDecoder(nn.Module):
    """A stand-in with the decoder's attribute layout and MoE blocks."""

    def __init__(self, num_experts: int = 4, dim: int = 8, tied: bool = False) -> None:
        super().__init__()
        self.enable_weight_tying = tied
        self.tok_embeddings = nn.Embedding(32, dim)
        self.layers = nn.ModuleDict({str(i): _MoEBlock(num_experts, dim) for i in range(3)})
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, 32, bias=False)
        if tied:
            self.lm_head.weight = self.tok_embeddings.weight


def _run(model: nn.Module, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> _Recorder:
    rec = _Recorder()
    monkeypatch.setattr(fsdp_mod, "fully_shard", rec)
    args: dict[str, Any] = {
        "dp_mesh": _FakeMesh(kwargs.pop("dp", 2), "dp"),
        "param_dtype": torch.bfloat16,
        "reduce_dtype": torch.float32,
        "pp_enabled": False,
    }
    args.update(kwargs)
    apply_fsdp_to_decoder(model, **args)
    return rec


def test_reshard_policy() -> None:
    assert get_fsdp_reshard_after_forward_policy("always", True) is True
    assert get_fsdp_reshard_after_forward_policy("never", False) is False
    assert get_fsdp_reshard_after_forward_policy("default", False) is True
    assert get_fsdp_reshard_after_forward_policy("default", True) is False
    with pytest.raises(ValueError, match="'sometimes'"):
        get_fsdp_reshard_after_forward_policy("sometimes", False)


def test_dense_units_order_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Decoder(DecoderArgs(dim=16, n_layers=3, n_heads=2, vocab_size=64, multiple_of=16))
    rec = _run(model, monkeypatch)
    units = [[type(m).__name__ for m in mods] for mods, _ in rec.calls]
    assert units == [
        ["Embedding"],
        ["RMSNorm", "Linear"],
        ["TransformerBlock"],
        ["TransformerBlock"],
        ["TransformerBlock"],
        ["Decoder"],
    ]
    assert rec.call_for(model.tok_embeddings)["reshard_after_forward"] is True
    assert rec.call_for(model.norm)["reshard_after_forward"] is False  # needed first in backward
    assert all(rec.call_for(b)["reshard_after_forward"] is True for b in model.layers.values())
    mp = rec.call_for(model)["mp_policy"]
    assert mp.cast_forward_inputs is False
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert "offload_policy" not in rec.call_for(model)
    rec = _run(model, monkeypatch, reshard_after_forward_policy="always", cpu_offload=True)
    assert rec.call_for(model.norm)["reshard_after_forward"] is True
    assert "offload_policy" in rec.call_for(model)
    rec = _run(model, monkeypatch, pp_enabled=True)
    assert rec.call_for(model.layers["0"])["reshard_after_forward"] is False


def test_tied_embeddings_form_one_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _ToyMoEDecoder(tied=True)
    rec = _run(model, monkeypatch, dp=2)
    first_modules, first_kwargs = rec.calls[0]
    assert first_modules == [model.tok_embeddings, model.norm, model.lm_head]
    assert first_kwargs["reshard_after_forward"] is False


def test_experts_shard_dim0_when_enough_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _ToyMoEDecoder(num_experts=4)
    rec = _run(model, monkeypatch, dp=4)
    assert "shard_placement_fn" not in rec.call_for(model.layers["0"])


def test_experts_shard_dim1_when_fsdp_exceeds_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _ToyMoEDecoder(num_experts=4)
    rec = _run(model, monkeypatch, dp=8)
    fn = rec.call_for(model.layers["0"])["shard_placement_fn"]
    experts = model.layers["0"].moe.experts
    assert fn(experts.w1) == Shard(1)
    assert fn(model.layers["0"].moe.router.weight) is None  # the default Shard(0)


def test_expert_parallel_gets_own_unit_mesh_and_prefetch(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _ToyMoEDecoder(num_experts=4)
    edp = _FakeMesh(4, "efsdp")
    rec = _run(model, monkeypatch, dp=8, ep_degree=2, edp_mesh=edp)
    blocks = list(model.layers.values())
    for block in blocks:
        kwargs = rec.call_for(block.moe.experts)
        assert kwargs["mesh"] is edp
        assert kwargs["shard_placement_fn"](block.moe.experts.w2) == Shard(1)  # 4*2 > 4
        assert rec.call_for(block)["mesh"].name == "dp"
    # forward chain: embeddings -> block0 (+experts) -> block1 -> block2 -> [norm, lm_head]
    assert rec.forward[id(model.tok_embeddings)] == [blocks[0], blocks[0].moe.experts]
    assert rec.forward[id(blocks[0])] == [blocks[1], blocks[1].moe.experts]
    assert rec.forward[id(blocks[2])] == [model.norm]
    # backward chain: [norm, lm_head] -> block2 -> block1 -> block0 -> embeddings
    assert rec.backward[id(model.norm)] == [blocks[2], blocks[2].moe.experts]
    assert rec.backward[id(blocks[2])] == [blocks[1], blocks[1].moe.experts]
    assert rec.backward[id(blocks[0])] == [model.tok_embeddings]
    with pytest.raises(ValueError, match="edp_mesh"):
        _run(_ToyMoEDecoder(), monkeypatch, ep_degree=2)


def test_symm_mem_needs_a_gpu() -> None:
    with pytest.raises(RuntimeError, match=r"SM >= 9\.0"):
        enable_fsdp_symm_mem(nn.Linear(2, 2))


@distributed(world_size=2)
def test_real_wrapping_sums_gradients() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = Decoder(DecoderArgs(dim=16, n_layers=2, n_heads=2, vocab_size=64, multiple_of=16))
    model.init_weights()
    reference = Decoder(DecoderArgs(dim=16, n_layers=2, n_heads=2, vocab_size=64, multiple_of=16))
    reference.load_state_dict(model.state_dict())
    apply_fsdp_to_decoder(model, mesh, torch.float32, torch.float32, pp_enabled=False)
    disable_fsdp_gradient_division(model)
    assert isinstance(model, FSDPModule)
    assert isinstance(model.layers["0"], FSDPModule)
    torch.manual_seed(100 + dist.get_rank())  # different data per rank
    tokens = torch.randint(0, 64, (2, 8))
    model(tokens).sum().backward()
    all_tokens = [torch.empty_like(tokens) for _ in range(2)]
    dist.all_gather(all_tokens, tokens)
    for t in all_tokens:
        reference(t).sum().backward()  # gradient SUM over ranks (no division)
    grad = model.layers["1"].feed_forward.w2.weight.grad.full_tensor()
    torch.testing.assert_close(grad, reference.layers["1"].feed_forward.w2.weight.grad)


@distributed(world_size=2)
def test_real_expert_sharding_on_dim1() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = _ToyMoEDecoder(num_experts=1, dim=8)  # FSDP degree 2 > 1 expert: Shard(1)
    apply_fsdp_to_decoder(model, mesh, torch.float32, torch.float32, pp_enabled=False)
    w1 = model.layers["0"].moe.experts.w1
    assert w1.placements == (Shard(1),)
    assert w1.to_local().shape == (1, 4, 16)
    assert model.layers["0"].moe.router.weight.placements == (Shard(0),)
