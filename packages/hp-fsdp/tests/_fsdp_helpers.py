"""Shared helpers of the hp-fsdp tests: a tiny tied-embedding transformer and parity runners.

Loaded by path from the test modules (workers import test modules by file, so a plain sibling
import would not resolve).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

VOCAB = 37  # uneven over 2, 3 and 4 ranks
DIM = 32
HEADS = 2
SEQ = 16
BATCH = 2


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # a key bias has a zero gradient
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 3 * dim)
        self.down = nn.Linear(3 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS, blocks: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(SEQ, dim) * 0.02)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.pos.normal_(std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def make_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def data_seed(step: int, micro: int, rank: int) -> int:
    return 7919 * step + 104729 * micro + 31 * rank + 1


@dataclass
class Config:
    """One parity configuration (everything picklable)."""

    mesh_shape: tuple[int, ...] = (2,)
    mp: str = "fp32"  # "fp32" or "bf16"
    reshard: Any = None  # None, True, False or an int (blocks only; the root keeps None)
    micro_batches: int = 1
    offload: bool = False
    list_unit: bool = False
    meta: bool = False
    steps: int = 10
    blocks: int = 2
    extra: dict[str, Any] = field(default_factory=dict)


def build_mesh(shape: tuple[int, ...]) -> DeviceMesh:
    if len(shape) == 1:
        return init_device_mesh("cpu", shape)
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def apply_sharding(model: TinyLM, api: Any, cfg: Config, mesh: DeviceMesh) -> None:
    """Apply one library's fully_shard (``api`` is hp_fsdp or torch.distributed.fsdp)."""
    kwargs: dict[str, Any] = {"mesh": mesh}
    if cfg.mp == "bf16":
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if cfg.offload:
        kwargs["offload_policy"] = api.CPUOffloadPolicy(pin_memory=False)
    block_kwargs = dict(kwargs)
    if cfg.reshard is not None:
        block_kwargs["reshard_after_forward"] = cfg.reshard
    for layer in model.layers:
        api.fully_shard(layer, **block_kwargs)
    if cfg.list_unit:  # the tied embedding and head form one unit
        api.fully_shard([model.embed, model.head], **block_kwargs)
    api.fully_shard(model, **kwargs)


def _materialize_same(model: nn.Module, reference: nn.Module) -> None:
    """Load the reference's full weights into a materialized (to_empty) sharded model."""
    ref = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = ref[name].detach()
            if isinstance(param, DTensor):
                from torch.distributed.tensor import distribute_tensor

                local = distribute_tensor(
                    full, param.device_mesh, param.placements, src_data_rank=None
                ).to_local()
                param.to_local().copy_(local)
            else:
                param.copy_(full)


def build_pair(cfg: Config) -> tuple[nn.Module, nn.Module, nn.Module, DeviceMesh]:
    """(ours, torch's, single-process reference) built from the same seed."""
    import torch.distributed.fsdp as torch_fsdp

    import hp_fsdp

    mesh = build_mesh(cfg.mesh_shape)
    torch.manual_seed(0)
    base = TinyLM(blocks=cfg.blocks)
    ref = copy.deepcopy(base)
    if cfg.meta:
        with torch.device("meta"):
            ours: nn.Module = TinyLM(blocks=cfg.blocks)
            theirs: nn.Module = TinyLM(blocks=cfg.blocks)
    else:
        ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    apply_sharding(ours, hp_fsdp, cfg, mesh)  # type: ignore[arg-type]
    apply_sharding(theirs, torch_fsdp, cfg, mesh)  # type: ignore[arg-type]
    if cfg.meta:
        from hp_dtensor.init import init_parameters

        torch.manual_seed(123)
        init_parameters(ours, device="cpu")
        theirs.to_empty(device="cpu")
        _materialize_same(ours, base)
        _materialize_same(theirs, base)
    return ours, theirs, ref, mesh


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def assert_bitwise(ours: nn.Module, theirs: nn.Module, what: str) -> None:
    ours_p = dict(ours.named_parameters())
    theirs_p = dict(theirs.named_parameters())
    assert ours_p.keys() == theirs_p.keys(), (sorted(ours_p), sorted(theirs_p))
    for name, p in ours_p.items():
        q = theirs_p[name]
        assert isinstance(p, DTensor), name
        assert isinstance(q, DTensor), name
        assert p.placements == q.placements, (name, p.placements, q.placements)
        assert p.to_local().shape == q.to_local().shape, name
        assert torch.equal(p.to_local(), q.to_local()), f"{what}: param {name} differs"
        if q.grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None, f"{what}: grad {name} missing"
        assert torch.equal(_local(p.grad), _local(q.grad)), f"{what}: grad {name} differs"


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, cfg: Config, step: int, rank: int
) -> torch.Tensor:
    total = torch.zeros(())
    for micro in range(cfg.micro_batches):
        last = micro == cfg.micro_batches - 1
        if cfg.micro_batches > 1 and cfg.extra.get("all_reduce_last_only"):
            model.set_requires_all_reduce(last)  # type: ignore[operator]
        elif cfg.micro_batches > 1 and cfg.extra.get("reduce_every_micro_batch"):
            model.set_is_last_backward(last)  # type: ignore[operator]
        elif cfg.micro_batches > 1:
            model.set_requires_gradient_sync(last)  # type: ignore[operator]
        loss = loss_fn(model, make_batch(data_seed(step, micro, rank)))
        loss.backward()
        total = total + loss.detach()
    return total


def run_parity(cfg: Config) -> list[float]:
    """Train ours and torch's side by side; assert bitwise equality every step.

    Returns:
        Our per-step losses on this rank (for the single-process oracle).
    """
    ours, theirs, _, mesh = build_pair(cfg)
    losses = compare_training(ours, theirs, cfg, dist.get_rank())
    del mesh
    return losses


def compare_training(ours: nn.Module, theirs: nn.Module, cfg: Config, dp_rank: int) -> list[float]:
    """Train both models on the same data (seeded by ``dp_rank``); assert bitwise equality."""
    opt_o = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    opt_t = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1)
    assert_bitwise(ours, theirs, "init")
    losses: list[float] = []
    for step in range(cfg.steps):
        lo = train_step(ours, opt_o, cfg, step, dp_rank)
        lt = train_step(theirs, opt_t, cfg, step, dp_rank)
        assert torch.equal(lo, lt), f"step {step}: loss {lo.item()!r} != torch {lt.item()!r}"
        assert_bitwise(ours, theirs, f"step {step} after backward")
        opt_o.step()
        opt_t.step()
        opt_o.zero_grad()
        opt_t.zero_grad()
        assert_bitwise(ours, theirs, f"step {step} after optimizer")
        losses.append(lo.item())
    return losses


def run_tp_parity(configs: list[Config]) -> None:
    """FSDP over tensor parallelism (dp=2 x tp=2): ours against torch's, bitwise.

    All configurations share one mesh (a mesh is created once per test).
    """
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import hp_fsdp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for cfg in configs:
        torch.manual_seed(0)
        base = TinyLM(blocks=cfg.blocks)
        ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        for model in (ours, theirs):
            for layer in model.layers:
                parallelize_module(layer, mesh["tp"], plan)
        apply_sharding(ours, hp_fsdp, cfg, mesh["dp"])  # type: ignore[arg-type]
        apply_sharding(theirs, torch_fsdp, cfg, mesh["dp"])  # type: ignore[arg-type]
        up = ours.layers[0].up.weight  # type: ignore[index]
        assert isinstance(up, DTensor)
        assert up.device_mesh.mesh_dim_names == ("dp", "tp")
        compare_training(ours, theirs, cfg, mesh["dp"].get_local_rank())


def run_oracle(cfg: Config, world: int) -> None:
    """Ours against a single process on the global batch (mean of per-rank losses)."""
    import hp_fsdp

    mesh = build_mesh(cfg.mesh_shape)
    torch.manual_seed(0)
    base = TinyLM(blocks=cfg.blocks)
    ref = copy.deepcopy(base)
    ours = copy.deepcopy(base)
    apply_sharding(ours, hp_fsdp, cfg, mesh)  # type: ignore[arg-type]
    rank = dist.get_rank()
    opt_o = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(cfg.steps):
        lo = train_step(ours, opt_o, cfg, step, rank)
        mean = lo.clone()
        dist.all_reduce(mean, op=dist.ReduceOp.SUM)
        mean /= world
        opt_o.step()
        opt_o.zero_grad()
        total = torch.zeros(())
        for micro in range(cfg.micro_batches):
            losses = [loss_fn(ref, make_batch(data_seed(step, micro, r))) for r in range(world)]
            loss = torch.stack(losses).mean()
            loss.backward()
            total = total + loss.detach()
        opt_r.step()
        opt_r.zero_grad()
        torch.testing.assert_close(mean, total, rtol=1e-5, atol=1e-5)
    from torch.distributed.tensor import distribute_tensor

    ref_params = dict(ref.named_parameters())
    for name, param in ours.named_parameters():
        assert isinstance(param, DTensor)
        expected = distribute_tensor(
            ref_params[name].detach(), param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        torch.testing.assert_close(param.to_local(), expected, rtol=1e-4, atol=1e-4)
