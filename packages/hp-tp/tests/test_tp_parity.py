"""Parity of hp-tp against a single-process run and against torch.distributed.tensor.parallel.

Every case builds three copies of one model: a single-process reference, the model parallelized
with ``hp_tp`` and the model parallelized with PyTorch's ``torch.distributed.tensor.parallel``
using the same plan (the style names and arguments are identical, so one plan builder serves
both). Each rank initializes its model from a *different* seed; ``hp_tp.parallelize_module`` must
take the values of rank 0 (``src_data_rank=0``), while the reference and torch's copy are loaded
with rank 0's state explicitly. Tensor-parallel ranks must see the same batch (that is what TP
means), so the batch comes from a common seed; the parameters, and therefore every partial sum a
collective reduces, differ per rank.

Oracles: the reference (``assert_close`` at rtol=atol=1e-5, as a sharded run reorders sums) and
torch's TP. Against torch the losses and gradients are compared bitwise: hp-tp issues the same
redistributions (all-gather, all-reduce, reduce-scatter) in the same layouts, and its
``loss_parallel`` performs the same arithmetic in the same order (max / sum-exp / target
all-reduces; ``(exp(log_probs) - one_hot) * grad`` in the backward).
"""

from __future__ import annotations

import copy
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel as torch_tp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

import hp_fsdp
import hp_tp
from hp_dtensor.testing import distributed

VOCAB, DIM, HEADS, HIDDEN, SEQ, BATCH, BLOCKS = 48, 24, 12, 48, 12, 2, 1


# ------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, DIM)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        # -1 heads: under TP each rank holds HEADS / tp heads (attention inputs stay local).
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.LayerNorm(DIM)
        self.ffn = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.pos_embeddings = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        with torch.no_grad():  # non-trivial norm parameters, so their gradients mean something
            for m in self.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.normal_(1.0, 0.1)
                    m.bias.normal_(0.0, 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


# ------------------------------------------------------------------------------------------
# plans: ``ns`` is hp_tp or torch.distributed.tensor.parallel (same names and arguments)
# ------------------------------------------------------------------------------------------


def mlp_plan(ns: ModuleType) -> dict[str, Any]:
    return {"w1": ns.ColwiseParallel(), "w2": ns.RowwiseParallel()}


def transformer_plan(ns: ModuleType, mode: str) -> dict[str, Any]:
    sp = mode in ("sp", "sp_loss")
    if not sp:
        return {
            "tok_embeddings": ns.RowwiseParallel(input_layouts=Replicate()),
            "layers.*.attention.wq": ns.ColwiseParallel(),
            "layers.*.attention.wk": ns.ColwiseParallel(),
            "layers.*.attention.wv": ns.ColwiseParallel(),
            "layers.*.attention.wo": ns.RowwiseParallel(),
            "layers.*.ffn.w1": ns.ColwiseParallel(),
            "layers.*.ffn.w2": ns.RowwiseParallel(),
            "output": ns.ColwiseParallel(output_layouts=Replicate()),
        }
    output = (
        ns.ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
        if mode == "sp_loss"
        else ns.ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    )
    return {
        "tok_embeddings": ns.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos_embeddings": ns.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "layers.*.attention_norm": ns.SequenceParallel(),
        "layers.*.attention": ns.PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "layers.*.attention.wq": ns.ColwiseParallel(),
        "layers.*.attention.wk": ns.ColwiseParallel(),
        "layers.*.attention.wv": ns.ColwiseParallel(),
        "layers.*.attention.wo": ns.RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": ns.SequenceParallel(),
        "layers.*.ffn": ns.PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "layers.*.ffn.w1": ns.ColwiseParallel(),
        "layers.*.ffn.w2": ns.RowwiseParallel(output_layouts=Shard(1)),
        "norm": ns.SequenceParallel(),
        "output": output,
    }


# ------------------------------------------------------------------------------------------
# helpers (module level: the workers import them)
# ------------------------------------------------------------------------------------------


def broadcast_state(model: nn.Module) -> None:
    """Make ``model`` hold rank 0's values on every rank."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t, src=0)


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        g = p.grad
        out[name] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


def as_full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def lm_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, ns: Any) -> Any:
    logits = model(tokens)
    if isinstance(logits, DTensor):  # the loss-parallel plan keeps logits sharded on the vocab
        with ns.loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
            loss.backward()
        return loss
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
    loss.backward()
    return loss


def check_same(
    ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], *, bitwise: bool, what: str
) -> None:
    assert ref.keys() == got.keys(), what
    for name in ref:
        if bitwise:
            assert torch.equal(ref[name], got[name]), (
                f"{what}: {name} differs by {(ref[name] - got[name]).abs().max().item()}"
            )
        else:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-5, msg=what)


def run_transformer_case(mode: str) -> None:
    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(100 + dist.get_rank())  # a different initialization on every rank
    local_init = Transformer()
    ref = copy.deepcopy(local_init)
    broadcast_state(ref)
    theirs = copy.deepcopy(ref)
    if mode == "tp":  # modules outside the plan keep their local values, under torch's TP too
        for name, module in local_init.named_modules():
            if isinstance(module, nn.LayerNorm) or name == "pos_embeddings":
                broadcast_state(module)
    ours = hp_tp.parallelize_module(local_init, mesh, transformer_plan(hp_tp, mode))
    torch_tp.parallelize_module(theirs, mesh, transformer_plan(torch_tp, mode))
    if mode != "tp":  # the sequence-parallel norms are replicated DTensors, the rest sharded
        assert isinstance(ours.norm.weight, DTensor)
        assert ours.norm.weight.placements == (Replicate(),)
    assert ours.layers[0].attention.wq.weight.placements == (Shard(0),)
    assert ours.layers[0].ffn.w2.weight.placements == (Shard(1),)

    gen = torch.Generator().manual_seed(7)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, ours, theirs)]
    for _step in range(2):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        loss_ref = lm_loss(ref, tokens, labels, torch_tp)
        loss_ours = as_full(lm_loss(ours, tokens, labels, hp_tp))
        loss_theirs = as_full(lm_loss(theirs, tokens, labels, torch_tp))
        torch.testing.assert_close(loss_ours, loss_ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(loss_ours, loss_theirs), (loss_ours, loss_theirs)
        g_ref, g_ours, g_theirs = full_grads(ref), full_grads(ours), full_grads(theirs)
        check_same(g_ref, g_ours, bitwise=False, what=f"{mode}: hp_tp vs single process")
        check_same(g_theirs, g_ours, bitwise=True, what=f"{mode}: hp_tp vs torch TP")
        for opt in opts:
            opt.step()
            opt.zero_grad()


def run_mlp_case() -> None:
    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(200 + dist.get_rank())
    local_init = MLP()
    ref = copy.deepcopy(local_init)
    broadcast_state(ref)
    theirs = copy.deepcopy(ref)
    ours = hp_tp.parallelize_module(local_init, mesh, mlp_plan(hp_tp))
    torch_tp.parallelize_module(theirs, mesh, mlp_plan(torch_tp))
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(3))
    outs = []
    for model in (ref, ours, theirs):
        out = model(x)
        assert not isinstance(out, DTensor)  # use_local_output=True by default
        out.pow(2).sum().backward()
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[1], outs[2])
    check_same(full_grads(ref), full_grads(ours), bitwise=False, what="mlp vs single process")
    check_same(full_grads(theirs), full_grads(ours), bitwise=True, what="mlp vs torch TP")


def fsdp_tp_batches(step: int, dp_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of data-parallel replica ``dp_index`` at ``step`` (the same on its TP ranks)."""
    gen = torch.Generator().manual_seed(1000 * step + dp_index)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return tokens, torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def run_fsdp_tp_case(fsdp_impl: str) -> str:
    """FSDP(dp=2) x TP(tp=2): 10 SGD steps against one process; placements against torch's."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_index = mesh.get_local_rank("dp")
    fully_shard = hp_fsdp.fully_shard if fsdp_impl == "hp" else torch_fully_shard
    torch.manual_seed(0)
    ref = Transformer()
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    hp_tp.parallelize_module(ours, mesh["tp"], transformer_plan(hp_tp, "sp_loss"))
    torch_tp.parallelize_module(theirs, mesh["tp"], transformer_plan(torch_tp, "sp_loss"))
    for model, shard in ((ours, fully_shard), (theirs, torch_fully_shard)):
        for layer in model.layers:
            shard(layer, mesh=mesh["dp"])
        shard(model, mesh=mesh["dp"])
    # the same 2-D placements as torch's FSDP x TP (_StridedShard where FSDP splits a TP shard),
    # so DCP checkpoints of either reshard into the other
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert isinstance(p, DTensor), name
        assert p.device_mesh == q.device_mesh, name
        assert p.placements == q.placements, (name, p.placements, q.placements)
        assert torch.equal(p.to_local(), q.to_local()), name

    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.5)
    for step in range(10):
        tokens, labels = fsdp_tp_batches(step, dp_index)
        loss = lm_loss(ours, tokens, labels, hp_tp).full_tensor().detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh.get_group("dp"))
        opt_ours.step()
        opt_ours.zero_grad()
        batches = [fsdp_tp_batches(step, i) for i in range(2)]  # the global batch
        all_tokens = torch.cat([b[0] for b in batches])
        all_labels = torch.cat([b[1] for b in batches])
        loss_ref = lm_loss(ref, all_tokens, all_labels, torch_tp).detach()
        opt_ref.step()
        opt_ref.zero_grad()
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
    for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-5, msg=name)
    return "ok"


def run_case(case: str) -> None:
    if case == "mlp":
        run_mlp_case()
    else:
        run_transformer_case(case)


# The MLP and every transformer mode at 2 ranks; the non-power-of-two world size 3 with and
# without sequence parallel; the full TP+SP+loss-parallel plan and FSDP x TP at 4 (the package's
# test budget is under a minute).
@distributed(world_size=2)
@pytest.mark.parametrize("case", ["mlp", "tp", "sp", "sp_loss"])
def test_two_ranks_match_single_process_and_torch_tp(case: str) -> None:
    run_case(case)


@distributed(world_size=3)
@pytest.mark.parametrize("case", ["mlp", "tp", "sp_loss"])
def test_three_ranks_match_single_process_and_torch_tp(case: str) -> None:
    run_case(case)


@distributed(world_size=4)
@pytest.mark.parametrize("case", ["mlp", "sp_loss"])
def test_four_ranks_match_single_process_and_torch_tp(case: str) -> None:
    run_case(case)


@distributed(world_size=4)
def test_fsdp_x_tp_with_torch_fsdp() -> None:
    """FSDP(dp=2) x TP(tp=2) with hp_tp + torch's fully_shard: placements and 10 steps."""
    assert run_fsdp_tp_case("torch") == "ok"


@distributed(world_size=4)
def test_fsdp_x_tp_with_hp_fsdp() -> None:
    """FSDP(dp=2) x TP(tp=2) with hp_tp + hp_fsdp.fully_shard: placements and 10 steps."""
    assert run_fsdp_tp_case("hp") == "ok"
