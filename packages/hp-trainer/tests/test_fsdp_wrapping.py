"""apply_fsdp_to_decoder: unit boundaries, reshard decisions, tying, MoE expert sharding."""

from __future__ import annotations

import copy
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
from hp_trainer._parallel_api import FSDPModule, ShardPlacementResult


class _FakeMesh:
    """A 1-D mesh stand-in: enough for apply_fsdp_to_decoder's decisions and mesh infos."""

    ndim = 1

    def __init__(self, size: int, name: str) -> None:
        self._size = size
        self.name = name

    def size(self, dim: int | None = None) -> int:
        return self._size

    def get_group(self, dim: int = 0) -> str:
        return f"group of {self.name}"

    def get_local_rank(self, dim: int = 0) -> int:
        return 0


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        gates = torch.softmax(self.moe.router(h), dim=-1)  # dense mixture over the experts
        hidden = torch.relu(torch.einsum("bsd,edh->bseh", h, self.moe.experts.w1))
        out = torch.einsum("bseh,ehd->bsed", hidden, self.moe.experts.w2)
        return x + (gates.unsqueeze(-1) * out).sum(2)


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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for block in self.layers.values():
            x = block(x)
        return self.lm_head(self.norm(x))


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


def test_expert_parallel_uses_a_per_parameter_mesh_and_prefetch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TorchTitan's layout: experts stay in the block's unit, on edp_mesh via
    ShardPlacementResult (one mesh-info object for all blocks); prefetch chains over blocks."""
    model = _ToyMoEDecoder(num_experts=4)
    edp = _FakeMesh(4, "efsdp")
    rec = _run(model, monkeypatch, dp=8, ep_degree=2, edp_mesh=edp)
    blocks = list(model.layers.values())
    infos = []
    for block in blocks:
        kwargs = rec.call_for(block)
        assert kwargs["mesh"].name == "dp"
        result = kwargs["shard_placement_fn"](block.moe.experts.w2)
        assert isinstance(result, ShardPlacementResult)
        assert result.placement == Shard(1)  # efsdp 4 x ep 2 > 4 experts
        assert result.mesh_info.mesh is edp
        infos.append(result.mesh_info)
        assert kwargs["shard_placement_fn"](block.moe.router.weight) is None  # dense: dp_mesh
        assert not any(block.moe.experts is m for mods, _ in rec.calls for m in mods)
    assert all(info is infos[0] for info in infos)
    # forward chain: embeddings -> block0 -> block1 -> block2 -> [norm, lm_head]
    assert rec.forward[id(model.tok_embeddings)] == [blocks[0]]
    assert rec.forward[id(blocks[0])] == [blocks[1]]
    assert rec.forward[id(blocks[2])] == [model.norm]
    # backward chain: [norm, lm_head] -> block2 -> block1 -> block0 -> embeddings
    assert rec.backward[id(model.norm)] == [blocks[2]]
    assert rec.backward[id(blocks[2])] == [blocks[1]]
    assert rec.backward[id(blocks[0])] == [model.tok_embeddings]
    many = _ToyMoEDecoder(num_experts=16)
    rec = _run(many, monkeypatch, dp=8, ep_degree=2, edp_mesh=edp)
    fn = rec.call_for(many.layers["0"])["shard_placement_fn"]
    assert fn(many.layers["0"].moe.experts.w1).placement == Shard(0)  # 4 x 2 <= 16 experts
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


@distributed(world_size=4)
def test_real_expert_parallel_block_holds_two_groups() -> None:
    """Dense parameters over 4 ranks, experts over the 2-rank "efsdp" axis, in one unit."""
    from torch.distributed.device_mesh import init_device_mesh

    import hp_fsdp

    dp_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    moe_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    torch.manual_seed(0)
    model = _ToyMoEDecoder(num_experts=4, dim=8)
    reference = copy.deepcopy(model)
    apply_fsdp_to_decoder(
        model,
        dp_mesh,
        torch.float32,
        torch.float32,
        pp_enabled=False,
        ep_degree=2,
        edp_mesh=moe_mesh["efsdp"],
    )
    block = model.layers["0"]
    state = hp_fsdp.get_hsdp_state(block)
    assert state is not None
    assert [len(g.params) for g in state.groups] == [3, 2]  # norm, router; then w1, w2
    w1 = block.moe.experts.w1
    assert w1.device_mesh.mesh_dim_names == ("efsdp",)
    assert w1.placements == (Shard(0),)  # efsdp 2 x ep 2 = 4 experts: no padding on dim 0
    assert w1.to_local().shape == (2, 8, 16)
    assert block.moe.router.weight.device_mesh.mesh_dim_names == ("dp",)
    torch.manual_seed(100 + dist.get_rank())  # different data per rank
    tokens = torch.randint(0, 32, (2, 8))
    model(tokens).sum().backward()
    grad = block.moe.experts.w1.grad
    assert grad is not None
    assert grad.device_mesh.mesh_dim_names == ("efsdp",)
    assert grad.to_local().shape == (2, 8, 16)
    # Oracle, one process: dense gradients average all 4 ranks' batches; expert gradients
    # average the batches of this rank's "efsdp" peers (ranks r and r +- 2) only.
    batches = [torch.empty_like(tokens) for _ in range(4)]
    dist.all_gather(batches, tokens)
    per_rank = []
    for batch in batches:
        reference.zero_grad()
        reference(batch).sum().backward()
        per_rank.append({n: p.grad.clone() for n, p in reference.named_parameters()})
    peers = [r for r in range(4) if r % 2 == dist.get_rank() % 2]
    for name, param in model.named_parameters():
        ranks = peers if "experts" in name else range(4)
        expected = torch.stack([per_rank[r][name] for r in ranks]).mean(0)
        torch.testing.assert_close(param.grad.full_tensor(), expected, rtol=1e-5, atol=1e-6)
