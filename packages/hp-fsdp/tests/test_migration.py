"""Behaviours a user migrating from PyTorch's FSDP2 relies on, each against ``fully_shard``.

Every test runs hp-fsdp and PyTorch's ``fully_shard`` on the same model, seed and data (data
differs per rank) and compares bitwise, or against the unsharded model where PyTorch refuses.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import hp_fsdp
from hp_dtensor.testing import distributed, rank_seed

DIM = 12


@dataclasses.dataclass
class Packet:
    x: torch.Tensor
    scale: float = 1.0


class Aux(NamedTuple):
    y: torch.Tensor
    extra: dict[str, torch.Tensor]


class PacketBlock(nn.Module):
    """Takes and returns dataclasses (with a named tuple and a dict nested inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.gate = nn.Linear(DIM, DIM, bias=False)

    def forward(self, packet: Packet) -> Packet:
        h = torch.tanh(self.lin(packet.x)) * packet.scale
        return Packet(x=h + self.gate(h), scale=packet.scale)


class PacketModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(PacketBlock() for _ in range(2))
        self.out = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> Aux:
        packet = Packet(x=self.inp(x), scale=0.5)
        for block in self.blocks:
            packet = block(packet)
        return Aux(y=self.out(packet.x), extra={"h": packet.x})


def _shard_packet_model(api: Any, model: PacketModel, mesh: Any, **kwargs: Any) -> None:
    for block in model.blocks:
        api.fully_shard(block, mesh=mesh, **kwargs)
    api.fully_shard(model, mesh=mesh, **kwargs)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a = a.to_local() if isinstance(a, DTensor) else a
    b = b.to_local() if isinstance(b, DTensor) else b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _bitwise(ours: nn.Module, theirs: nn.Module, what: str) -> None:
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        q = theirs_params[name]
        assert p.placements == q.placements, (what, name)
        assert _same_bits(p, q), f"{what}: {name}"
        if q.grad is not None or p.grad is not None:
            assert _same_bits(p.grad, q.grad), f"{what}: {name} grad"


def _train_pair(ours: nn.Module, theirs: nn.Module, steps: int, loss_of: Any) -> None:
    opt_o = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    opt_t = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank_seed(5))
    for step in range(steps):
        x = torch.randn(4, DIM, generator=gen)
        lo, lt = loss_of(ours, x), loss_of(theirs, x)
        assert torch.equal(lo, lt), f"step {step}: loss {lo} != {lt}"
        lo.backward()
        lt.backward()
        _bitwise(ours, theirs, f"step {step} grads")
        opt_o.step()
        opt_t.step()
        opt_o.zero_grad()
        opt_t.zero_grad()
    _bitwise(ours, theirs, "after training")


@distributed(world_size=3)
def test_dataclass_and_namedtuple_inputs_outputs_match_torch() -> None:
    """Pre-backward hooks and post-backward triggers reach tensors inside dataclasses."""
    mesh = init_device_mesh("cpu", (3,))
    torch.manual_seed(0)
    base = PacketModel()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    _shard_packet_model(hp_fsdp, ours, mesh, reshard_after_forward=True)
    _shard_packet_model(torch_fsdp, theirs, mesh, reshard_after_forward=True)

    def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        aux = model(x)
        return aux.y.square().mean() + aux.extra["h"].mean()

    _train_pair(ours, theirs, 3, loss_of)


@distributed(world_size=2)
def test_forward_inputs_cast_inside_dataclasses() -> None:
    """cast_forward_inputs reaches a dataclass field, as PyTorch's does."""
    mesh = init_device_mesh("cpu", (2,))
    seen: dict[str, torch.dtype] = {}
    for name, api in (("ours", hp_fsdp), ("torch", torch_fsdp)):
        block = PacketBlock()
        block.register_forward_pre_hook(
            lambda m, args, name=name: seen.__setitem__(name, args[0].x.dtype)
        )
        mp = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        api.fully_shard(block, mesh=mesh, mp_policy=mp)
        block(Packet(x=torch.randn(2, DIM)))
    assert seen == {"ours": torch.bfloat16, "torch": torch.bfloat16}


@distributed(world_size=2)
def test_state_dict_hooks_after_no_grad_forward_and_parent_load() -> None:
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    base, other = PacketModel(), PacketModel()
    x = torch.randn(3, DIM, generator=torch.Generator().manual_seed(rank_seed(1)))
    outputs = {}
    for name, api in (("ours", hp_fsdp), ("torch", torch_fsdp)):
        model, source = copy.deepcopy(base), copy.deepcopy(other)
        _shard_packet_model(api, model, mesh)
        _shard_packet_model(api, source, mesh)
        with torch.no_grad():
            model(x)  # the root keeps its parameters unsharded after forward
        state = model.state_dict()
        assert all(isinstance(v, DTensor) for v in state.values()), name
        parent = nn.ModuleDict({"model": model})  # not a fully_shard module
        with torch.no_grad():
            model(x)
        parent.load_state_dict({f"model.{k}": v for k, v in source.state_dict().items()})
        for (key, p), q in zip(model.named_parameters(), source.parameters(), strict=True):
            assert isinstance(p, DTensor), (name, key)
            assert torch.equal(p.to_local(), q.to_local()), (name, key)
        with torch.no_grad():
            outputs[name] = model(x).y
            assert torch.equal(outputs[name], source(x).y), name
    assert torch.equal(outputs["ours"], outputs["torch"])


@distributed(world_size=2)
def test_forward_mode_ad_through_sharded_module() -> None:
    """torch.func.jvp through a sharded module equals jvp through the unsharded one."""
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 4))
    ours = copy.deepcopy(base)
    for layer in (ours[0], ours[2]):
        hp_fsdp.fully_shard(layer, mesh=mesh)
    hp_fsdp.fully_shard(ours, mesh=mesh)
    gen = torch.Generator().manual_seed(rank_seed(2))
    x = torch.randn(3, DIM, generator=gen, requires_grad=True)
    tangent = torch.randn(3, DIM, generator=gen)
    out, jvp_out = torch.func.jvp(ours, (x,), (tangent,))
    ref_out, ref_jvp = torch.func.jvp(base, (x,), (tangent,))
    assert torch.equal(out, ref_out)
    assert torch.equal(jvp_out, ref_jvp)
    # the module still trains afterwards: gradients are the ranks' mean of the unsharded ones
    ours(x).sum().backward()
    base(x).sum().backward()
    for p, q in zip(ours.parameters(), base.parameters(), strict=True):
        mean = q.grad.clone()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        expected = distribute_tensor(mean, p.device_mesh, p.placements, src_data_rank=None)
        torch.testing.assert_close(p.grad.to_local(), expected.to_local(), rtol=1e-5, atol=1e-6)


@distributed(world_size=2)
def test_partial_forward_then_standalone_unit() -> None:
    """Run one unit's forward, then another unit alone, backward, then the root: as torch."""
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    base = PacketModel()
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank_seed(3)))
    results: dict[str, list[torch.Tensor | None]] = {}
    for name, api in (("ours", hp_fsdp), ("torch", torch_fsdp)):
        model = copy.deepcopy(base)
        _shard_packet_model(api, model, mesh, reshard_after_forward=True)
        model(x).y.sum().backward()  # lazy init through the root
        model.zero_grad()
        packet = model.blocks[0](Packet(x=x.clone().requires_grad_()))  # part of the model...
        standalone = model.blocks[1](Packet(x=x * 2))  # ...then another unit on its own
        (packet.x.sum() + standalone.x.square().sum()).backward()
        grads: list[torch.Tensor | None] = [
            None if p.grad is None else p.grad.full_tensor() for p in model.parameters()
        ]
        model.zero_grad()
        model(x).y.sum().backward()
        grads += [p.grad.full_tensor() for p in model.parameters()]
        results[name] = grads
    assert len(results["ours"]) == len(results["torch"])
    for a, b in zip(results["ours"], results["torch"], strict=True):
        assert (a is None) == (b is None)
        assert a is None or torch.equal(a, b)


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(17, 8)  # weight (8, 17)
        self.b = nn.Linear(8, 17)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@distributed(world_size=3)
def test_uneven_shard_on_inner_dim_trains_like_torch_shard0() -> None:
    """Shard(largest dim) with 17 columns over 3 ranks (6, 6, 5) vs torch's Shard(0)."""
    mesh = init_device_mesh("cpu", (3,))
    torch.manual_seed(0)
    base = Wide()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)

    def largest_dim(param: nn.Parameter) -> Shard:
        return Shard(max(range(param.ndim), key=lambda d: param.shape[d]))

    hp_fsdp.fully_shard(ours, mesh=mesh, shard_placement_fn=largest_dim)
    torch_fsdp.fully_shard(theirs, mesh=mesh)
    weight = ours.a.weight
    assert weight.placements == (Shard(1),)
    assert weight.to_local().shape == (8, [6, 6, 5][dist.get_rank()])
    opt_o = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_t = torch.optim.SGD(theirs.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank_seed(4))
    for _ in range(3):
        x = torch.randn(5, 17, generator=gen)
        ours(x).square().mean().backward()
        theirs(x).square().mean().backward()
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert p.grad.placements == p.placements
            torch.testing.assert_close(
                p.grad.full_tensor(), q.grad.full_tensor(), rtol=1e-6, atol=1e-7
            )
        opt_o.step()
        opt_t.step()
        opt_o.zero_grad()
        opt_t.zero_grad()
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=1e-6, atol=1e-7)


class MixedDtype(nn.Module):
    """Trainable fp32 weights beside frozen bf16 and float8 weights in one unit."""

    def __init__(self) -> None:
        super().__init__()
        self.train_lin = nn.Linear(DIM, DIM)
        self.frozen_bf16 = nn.Parameter(torch.randn(DIM, DIM).to(torch.bfloat16), False)
        self.frozen_fp8 = nn.Parameter(
            (torch.randn(7, DIM) * 4).to(torch.float8_e4m3fn), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.train_lin(x) @ self.frozen_bf16.float()
        return h @ self.frozen_fp8.float().t()


@distributed(world_size=3)
def test_mixed_dtype_unit_matches_torch() -> None:
    mesh = init_device_mesh("cpu", (3,))
    torch.manual_seed(0)
    base = MixedDtype()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    hp_fsdp.fully_shard(ours, mesh=mesh, reshard_after_forward=True)
    torch_fsdp.fully_shard(theirs, mesh=mesh, reshard_after_forward=True)

    def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).square().mean()

    _train_pair(ours, theirs, 3, loss_of)
    assert ours.frozen_fp8.dtype == torch.float8_e4m3fn


@distributed(world_size=2)
def test_meta_init_and_rank0_broadcast_load_with_assign() -> None:
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    base = PacketModel()
    full = base.state_dict() if dist.get_rank() == 0 else None
    models = {}
    for name, api in (("ours", hp_fsdp), ("torch", torch_fsdp)):
        with torch.device("meta"):
            model = PacketModel()
        _shard_packet_model(api, model, mesh)
        state = {}
        for key, meta_param in model.state_dict().items():
            source = full[key] if full is not None else torch.empty(meta_param.shape)
            state[key] = distribute_tensor(
                source, meta_param.device_mesh, meta_param.placements, src_data_rank=0
            )
        model.load_state_dict(state, assign=True)
        assert all(p.device.type == "cpu" for p in model.parameters()), name
        models[name] = model

    def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).y.square().mean()

    _train_pair(models["ours"], models["torch"], 2, loss_of)
    for p, q in zip(models["ours"].parameters(), base.parameters(), strict=True):
        assert p.device.type == "cpu"
        del q
