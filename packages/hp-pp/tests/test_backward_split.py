"""Zero-bubble backward split: the weight pass starts from recorded gradients, no re-walk.

Oracles: a full backward of the same graph (gradients bitwise equal, FLOPs counted with
``FlopCounterMode``), and the old way of computing weight gradients (a second backward from
the outputs), whose FLOPs show what the split saves. In a pipeline step (ZBV, 2 ranks), the
I and W actions of every stage add up to one full backward.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import hp_pp
from hp_dtensor.testing import distributed, run_distributed
from hp_pp import generators
from hp_pp._backward import backward_input

DIM = 32
HEADS = 4
SEQ = 16
BATCH = 2


class DecoderBlock(nn.Module):
    """A pre-norm decoder block as the trainer builds them: RMSNorm, causal attention,
    RMSNorm, SwiGLU MLP, residuals."""

    def __init__(self, dim: int = DIM, heads: int = HEADS) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w3 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.attn_norm(x)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.wq(h)), split(self.wk(h)), split(self.wv(h))
        # Attention written out: FlopCounterMode does not count the CPU SDPA kernel, and the
        # attention backward (activation x activation) belongs to the input pass.
        scores = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        a = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, d))
        h = self.mlp_norm(x)
        return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


def mlp(layers: int = 8) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.GELU()) for _ in range(layers)])


def decoder(blocks: int = 2) -> nn.Module:
    return nn.Sequential(*[DecoderBlock() for _ in range(blocks)])


def _input(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    shape = (BATCH * SEQ, DIM) if kind == "mlp" else (BATCH, SEQ, DIM)
    return torch.randn(shape, generator=g)


def _flops(fn: Callable[[], Any]) -> tuple[int, Any]:
    with FlopCounterMode(display=False) as counter:
        out = fn()
    return counter.get_total_flops(), out


def _measure(kind: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = mlp() if kind == "mlp" else decoder()
    x0 = _input(kind)
    g = torch.Generator().manual_seed(8)
    grad_out = torch.randn(x0.shape, generator=g)

    # Full backward: the oracle.
    x = x0.clone().requires_grad_()
    y = model(x)
    full, _ = _flops(lambda: torch.autograd.backward([y], [grad_out]))
    ref_input = x.grad
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    # Split: input pass, then weight pass.
    x = x0.clone().requires_grad_()
    y = model(x)
    i_flops, (input_grads, weight_pass) = _flops(lambda: backward_input([y], [grad_out], [x]))
    assert all(p.grad is None for p in model.parameters()), "the input pass touched .grad"
    w_flops, _ = _flops(weight_pass.run)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    # What the split replaces: input grads with the graph kept, then a second backward from
    # the outputs restricted to the parameters.
    x = x0.clone().requires_grad_()
    y = model(x)
    old_i, _ = _flops(lambda: torch.autograd.grad([y], [x], [grad_out], retain_graph=True))
    params = list(model.parameters())
    old_w, _ = _flops(lambda: torch.autograd.backward([y], [grad_out], inputs=params))
    model.zero_grad(set_to_none=True)
    return {
        "B": full,
        "I": i_flops,
        "W": w_flops,
        "old_I": old_i,
        "old_W": old_w,
        "input_equal": torch.equal(input_grads[0], ref_input),
        "weights_equal": all(torch.equal(got[n], ref[n]) for n in ref),
        "groups": weight_pass.num_groups,
    }


@pytest.mark.parametrize("kind", ["decoder", "mlp"])
def test_weight_pass_does_not_rewalk_the_activation_chain(kind: str) -> None:
    m = _measure(kind)
    # Same numbers as one full backward, bitwise.
    assert m["input_equal"]
    assert m["weights_equal"]
    # I + W costs one full backward; W alone is the weight half only.
    assert m["I"] + m["W"] <= 1.05 * m["B"], m
    assert m["W"] <= 0.6 * m["B"], m
    assert m["I"] < m["B"], m
    # The re-walk it replaces costs far more (the figures: W = 0.94 B on an MLP).
    assert m["old_W"] > 0.8 * m["B"], m
    # Weight-pass calls: one per weight-consuming node, except that parallel branches share
    # one (a block: norm, {wq, wk, wv}, wo, norm, {w1, w3}, w2).
    assert m["groups"] == (8 if kind == "mlp" else 2 * 6), m


class _SavedTensors:
    """Weak references to the activations autograd saves during a forward (tensors that
    share storage with a parameter or the input live on regardless)."""

    def __init__(self, *owned: torch.Tensor) -> None:
        self.owned = {t.untyped_storage().data_ptr() for t in owned}
        self.refs: list[weakref.ref[torch.Tensor]] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        # Packed detached: returning a saved output itself would tie it to its own node in a
        # cycle that only a backward without retain_graph breaks.
        packed = t.detach()
        if t.untyped_storage().data_ptr() not in self.owned:
            self.refs.append(weakref.ref(packed))
        return packed

    def alive(self) -> int:
        return sum(r() is not None for r in self.refs)


def test_memory_between_the_passes_is_bounded_and_freed_after_the_weight_pass() -> None:
    torch.manual_seed(0)
    model = decoder()
    x = _input("decoder").requires_grad_()
    grad_out = torch.randn(x.shape)
    saved = _SavedTensors(x, *model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        y = model(x)
    forward_saved = saved.alive()
    assert forward_saved > 0
    input_grads, weight_pass = backward_input([y], [grad_out], [x])
    del y
    gc.collect()
    # Between the passes: the graph (no more than the forward saved) and one gradient per
    # weight-consuming node output, each of one activation's size at most.
    assert saved.alive() <= forward_saved
    held = weight_pass.held_gradients()
    assert len(held) == 18  # 7 linears and 2 norms per block
    assert weight_pass.num_groups == 12
    biggest_activation = BATCH * SEQ * 2 * DIM
    assert all(g.numel() <= biggest_activation for g in held)
    held_refs = [weakref.ref(g) for g in held]
    del held
    weight_pass.run()
    assert weight_pass.held_gradients() == []
    # Everything is freed once the weight pass ran and its object is dropped.
    del weight_pass, input_grads
    gc.collect()
    assert all(r() is None for r in held_refs)
    assert saved.alive() == 0, f"{saved.alive()} saved tensors still alive"


def test_first_stage_without_input_gradients_defers_everything_to_the_weight_pass() -> None:
    # Stage 0's inputs need no gradient: I has nothing to compute, W is the whole backward.
    torch.manual_seed(0)
    model = mlp(4)
    x = _input("mlp")
    grad_out = torch.randn(x.shape[0], DIM)
    y = model(x)
    full, _ = _flops(lambda: torch.autograd.backward([y], [grad_out]))
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    y = model(x)
    i_flops, (grads, weight_pass) = _flops(lambda: backward_input([y], [grad_out], []))
    assert grads == []
    assert i_flops == 0
    w_flops, _ = _flops(weight_pass.run)
    assert w_flops == full
    assert all(torch.equal(p.grad, ref[n]) for n, p in model.named_parameters())


class Tied(nn.Module):
    """One weight used at two depths: the deeper use is also reached through the chain."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(DIM, DIM)
        self.mid = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(torch.tanh(self.mid(torch.tanh(self.shared(x)))))


def test_a_weight_used_twice_gets_its_gradient_once() -> None:
    torch.manual_seed(0)
    model = Tied()
    x0 = _input("mlp")
    grad_out = torch.randn(x0.shape)
    x = x0.clone().requires_grad_()
    torch.autograd.backward([model(x)], [grad_out])
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    (dx,), weight_pass = backward_input([model(x)], [grad_out], [x])
    assert weight_pass.num_groups == 2  # {shared: both uses}, {mid}
    weight_pass.run()
    torch.testing.assert_close(dx, x.grad if x.grad is not None else dx)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-6, atol=1e-6)


# -- in a pipeline step ---------------------------------------------------------------------

N_MB = 4


def _count_flops(stage: hp_pp.PipelineStage, counts: dict[str, int]) -> None:
    """Wrap the stage's backward entry points so each action's FLOPs are counted."""
    backward, weight = stage.backward_one_chunk, stage.backward_weight_one_chunk

    def b(mb: int, loss: Any = None, full_backward: bool = True) -> None:
        with FlopCounterMode(display=False) as c:
            backward(mb, loss, full_backward)
        counts["B" if full_backward else "I"] += c.get_total_flops()

    def w(mb: int) -> None:
        with FlopCounterMode(display=False) as c:
            weight(mb)
        counts["W"] += c.get_total_flops()

    stage.backward_one_chunk = b  # type: ignore[method-assign]
    stage.backward_weight_one_chunk = w  # type: ignore[method-assign]


def _full_backward_flops(block: nn.Module, stage_index: int, num_stages: int) -> int:
    """FLOPs of one full backward of a stage on one micro-batch's shapes."""
    x = torch.randn(BATCH, SEQ, DIM, requires_grad=stage_index != 0)
    out = block(x)
    if stage_index == num_stages - 1:
        loss = nn.functional.mse_loss(out, torch.zeros_like(out))
        flops, _ = _flops(lambda: torch.autograd.backward(loss))
    else:
        flops, _ = _flops(lambda: torch.autograd.backward(out, torch.ones_like(out)))
    return flops


_STEP_CASES = [("ZBVZeroBubble", 2), ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 3)]


@pytest.mark.parametrize(("schedule", "ws"), _STEP_CASES)
def test_zero_bubble_step_costs_one_backward_per_microbatch(schedule: str, ws: int) -> None:
    run_distributed(_step_flops, ws, schedule)


def _step_flops(schedule: str) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    num_stages = 2 * ws
    torch.manual_seed(0)
    blocks = [DecoderBlock() for _ in range(num_stages)]
    indices = generators.rank_to_stages(rank, ws, num_stages, generators.STYLE[schedule])
    stages = [hp_pp.PipelineStage(blocks[s], s, num_stages, torch.device("cpu")) for s in indices]
    counts = {s: {"B": 0, "I": 0, "W": 0} for s in indices}
    for stage in stages:
        _count_flops(stage, counts[stage.stage_index])
    sched = hp_pp.get_schedule_class(schedule)(
        stages, N_MB * ws // 2, loss_fn=nn.functional.mse_loss
    )
    g = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    x = torch.randn(N_MB * ws // 2 * BATCH, SEQ, DIM, generator=g)
    y = torch.randn(N_MB * ws // 2 * BATCH, SEQ, DIM, generator=g)
    kwargs: dict[str, Any] = {}
    if num_stages - 1 in indices:
        kwargs["target"] = y
    sched.step(*((x,) if 0 in indices else ()), **kwargs)
    for s in indices:
        c, full = counts[s], N_MB * ws // 2 * _full_backward_flops(blocks[s], s, num_stages)
        # Every micro-batch's backward costs one full backward, however it was split.
        assert c["B"] + c["I"] + c["W"] <= 1.05 * full, (s, c, full)
        if s == 0:
            # Nothing to send upstream: the input pass is empty, the weight pass does it all.
            assert c["I"] == 0, c
        else:
            # The split actions hold the input half and the weight half, not a re-walk.
            assert c["I"] > 0, (s, c)
            assert c["W"] > 0, (s, c)
            assert c["W"] <= 0.6 * full, (s, c, full)


@pytest.mark.parametrize(("schedule", "ws"), _STEP_CASES)
def test_activations_are_freed_by_the_weight_pass_in_a_step(schedule: str, ws: int) -> None:
    # A send in flight keeps the output tensor it sends (gloo: until the step ends); the
    # graph behind it, and the activations of the nodes the weight pass never runs, must not
    # stay alive with it.
    run_distributed(_activations_freed, ws, schedule)


def _activations_freed(schedule: str) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    num_stages = 2 * ws
    torch.manual_seed(0)
    blocks = [DecoderBlock() for _ in range(num_stages)]
    indices = generators.rank_to_stages(rank, ws, num_stages, generators.STYLE[schedule])
    stages = [hp_pp.PipelineStage(blocks[s], s, num_stages, torch.device("cpu")) for s in indices]
    saved: dict[tuple[int, int], _SavedTensors] = {}
    leftovers: list[tuple[int, int, int]] = []
    for stage in stages:
        forward, weight = stage.forward_one_chunk, stage.backward_weight_one_chunk
        params = list(stage.submod.parameters())

        def f(
            mb: int,
            *args: Any,
            forward: Any = forward,
            s: int = stage.stage_index,
            params: Any = params,
            **kwargs: Any,
        ) -> Any:
            tracker = saved[(s, mb)] = _SavedTensors(*params)
            with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
                return forward(mb, *args, **kwargs)

        def w(mb: int, weight: Any = weight, s: int = stage.stage_index) -> None:
            weight(mb)
            leftovers.append((s, mb, saved[(s, mb)].alive()))

        stage.forward_one_chunk = f  # type: ignore[method-assign]
        stage.backward_weight_one_chunk = w  # type: ignore[method-assign]
    sched = hp_pp.get_schedule_class(schedule)(
        stages, N_MB * ws // 2, loss_fn=nn.functional.mse_loss
    )
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(N_MB * ws // 2 * BATCH, SEQ, DIM, generator=g)
    y = torch.randn(N_MB * ws // 2 * BATCH, SEQ, DIM, generator=g)
    kwargs: dict[str, Any] = {"target": y} if num_stages - 1 in indices else {}
    sched.step(*((x,) if 0 in indices else ()), **kwargs)
    assert leftovers, "no weight pass ran"
    assert all(alive == 0 for _, _, alive in leftovers), leftovers


@distributed(world_size=2)
def test_split_on_tensor_parallel_dtensors_equals_a_full_backward() -> None:
    # Colwise/rowwise-sharded DTensor weights (TP inside a stage): the weight-side subgraphs
    # hold DTensor nodes and the chain holds the TP all-reduce; the split gives the same
    # sharded gradients and input gradient as one full backward, bitwise.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM), nn.LayerNorm(DIM)
        )
        return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    g = torch.Generator().manual_seed(dist.get_rank())  # different data on each rank
    x0, grad_out = torch.randn(8, DIM, generator=g), torch.randn(8, DIM, generator=g)
    ref_model, model = build(), build()
    x = x0.clone().requires_grad_()
    torch.autograd.backward([ref_model(x)], [grad_out])
    ref_dx = x.grad
    x = x0.clone().requires_grad_()
    (dx,), weight_pass = backward_input([model(x)], [grad_out], [x])
    assert all(p.grad is None for p in model.parameters())
    weight_pass.run()
    assert dx is not None
    assert torch.equal(dx, ref_dx)
    sharded = 0
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert type(p.grad) is type(q.grad), name
        if isinstance(p.grad, DTensor):
            sharded += 1
            assert p.grad.placements == q.grad.placements, name
            assert torch.equal(p.grad.to_local(), q.grad.to_local()), name
        else:
            assert torch.equal(p.grad, q.grad), name
    assert sharded == 4  # both linears' weights and biases
