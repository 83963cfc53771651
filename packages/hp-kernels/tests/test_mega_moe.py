"""``mega_moe`` / ``mega_moe_grad`` (reference kernel) against the composed ops.

The oracle is what :class:`hp_cp_ep.MoE` runs unfused: ``permute_tokens``, the grouped SwiGLU
of ``GroupedExperts.compute`` (``torch._grouped_mm``) and ``unpermute_tokens``, through autograd.
Where ``torch._grouped_mm`` applies, the fused op is bitwise equal to it, forward and every
gradient; with unaligned widths (the masked per-expert fallback) equal to rounding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hp_kernels as hk
from hp_dtensor.testing import count_host_syncs
from hp_kernels._torch_compat import grouped_mm


def composed(
    x: torch.Tensor,
    idx: torch.Tensor,
    probs: torch.Tensor | None,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    score_before_experts: bool = False,
) -> torch.Tensor:
    """The unfused MoE path (``MoE._routed_by_rows`` on one device), op for op."""
    idx = idx if idx.dim() == 2 else idx.unsqueeze(1)
    topk, num_experts = idx.shape[1], w1.shape[0]
    rows, order, counts = hk.permute_tokens(x, idx, num_experts)
    if score_before_experts:
        assert probs is not None
        rows = rows * probs.reshape(-1)[order].unsqueeze(-1)
    if grouped_mm_ok(x, w1, w2):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        hidden = F.silu(grouped_mm(rows, w1.transpose(-2, -1), offs=offs)) * grouped_mm(
            rows, w3.transpose(-2, -1), offs=offs
        )
        out = grouped_mm(hidden, w2.transpose(-2, -1), offs=offs)
    else:  # GroupedExperts' per-expert loop (with its host read of the counts)
        parts = []
        for e, r in enumerate(torch.split(rows, counts.tolist())):
            parts.append((F.silu(r @ w1[e].t()) * (r @ w3[e].t())) @ w2[e].t())
        out = torch.cat(parts)
    if score_before_experts or probs is None:
        return hk.unpermute_tokens(out, order, topk=topk)
    return hk.unpermute_tokens(out, order, probs)


def grouped_mm_ok(x: torch.Tensor, *ws: torch.Tensor) -> bool:
    dims = {x.shape[-1], *(d for w in ws for d in w.shape[1:])}
    return all(d * x.element_size() % 16 == 0 for d in dims)


def make(
    seed: int,
    tokens: int = 11,
    topk: int = 2,
    experts: int = 4,
    dim: int = 16,
    hidden: int = 24,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=gen).to(dtype)
    # expert 1 gets no row: its weights' gradients must be zeros, not skipped
    idx = torch.randint(0, experts, (tokens, topk), generator=gen)
    idx = torch.where(idx == 1, 0, idx)
    probs = torch.rand(tokens, topk, generator=gen).to(dtype)
    w1 = (torch.randn(experts, hidden, dim, generator=gen) * 0.3).to(dtype)
    w2 = (torch.randn(experts, dim, hidden, generator=gen) * 0.3).to(dtype)
    w3 = (torch.randn(experts, hidden, dim, generator=gen) * 0.3).to(dtype)
    return x, idx, probs, w1, w2, w3


class Case:
    """Leaf copies of one routed batch: ``x``, ``probs`` (or None) and the three weights."""

    def __init__(self, x: torch.Tensor, probs: torch.Tensor | None, *ws: torch.Tensor) -> None:
        self.x = x.detach().clone().requires_grad_()
        self.probs = None if probs is None else probs.detach().clone().requires_grad_()
        self.w1, self.w2, self.w3 = (w.detach().clone().requires_grad_() for w in ws)

    def inputs(self) -> list[torch.Tensor | None]:
        return [self.x, self.probs, self.w1, self.w2, self.w3]

    def run(self, fn: Any, idx: torch.Tensor, sbe: bool) -> torch.Tensor:
        out: torch.Tensor = fn(
            self.x, idx, self.probs, self.w1, self.w2, self.w3, score_before_experts=sbe
        )
        return out

    def grads(self, out: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor | None]:
        live = [t for t in self.inputs() if t is not None]
        got = iter(torch.autograd.grad(out, live, g))
        return [None if t is None else next(got) for t in self.inputs()]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["weighted", "score_before_experts", "unweighted"])
def test_bitwise_equal_to_composed_ops_forward_and_backward(dtype: torch.dtype, mode: str) -> None:
    x, idx, probs, w1, w2, w3 = make(0, dtype=dtype)
    sbe = mode == "score_before_experts"
    p = None if mode == "unweighted" else probs
    ref_case, ours_case = Case(x, p, w1, w2, w3), Case(x, p, w1, w2, w3)
    ref = ref_case.run(composed, idx, sbe)
    ours = ours_case.run(hk.mega_moe, idx, sbe)
    assert ours.dtype == dtype
    assert ours.shape == x.shape
    assert torch.equal(ours, ref)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    ref_g = ref_case.grads(ref, g)
    ours_g = ours_case.grads(ours, g)
    for name, a, b in zip(("x", "probs", "w1", "w2", "w3"), ours_g, ref_g, strict=True):
        assert _same(a, b), name
    g_w1 = ours_g[2]
    assert g_w1 is not None
    assert torch.count_nonzero(g_w1[1]) == 0  # expert 1 got no rows: zero gradient
    # mega_moe_grad: the same gradients without autograd
    direct = hk.mega_moe_grad(g, x, idx, p, w1, w2, w3, score_before_experts=sbe)
    for a, b in zip(direct, ref_g, strict=True):
        assert _same(a, b)


def test_one_choice_per_token_and_flat_indices() -> None:
    x, idx, probs, w1, w2, w3 = make(1, topk=1)
    flat = idx[:, 0]
    assert torch.equal(
        hk.mega_moe(x, flat, probs[:, 0], w1, w2, w3), composed(x, idx, probs, w1, w2, w3)
    )


def test_float32_probs_with_bfloat16_tokens_follow_the_cast() -> None:
    x, idx, probs, w1, w2, w3 = make(2, dtype=torch.bfloat16)
    p32 = torch.rand(probs.shape, generator=torch.Generator().manual_seed(3), requires_grad=True)
    ours = hk.mega_moe(x, idx, p32, w1, w2, w3)
    ref = composed(x, idx, p32.detach().to(torch.bfloat16), w1, w2, w3)
    assert torch.equal(ours, ref)
    (g_p,) = torch.autograd.grad(ours.sum(), [p32])
    assert g_p.dtype == torch.float32


@pytest.mark.parametrize("sbe", [False, True])
def test_unaligned_widths_use_the_masked_fallback_equal_to_rounding(sbe: bool) -> None:
    # dim 6, hidden 10: rows of 24 / 40 bytes, not multiples of 16: no torch._grouped_mm
    x, idx, probs, w1, w2, w3 = make(4, dim=6, hidden=10)
    ref_case, ours_case = Case(x, probs, w1, w2, w3), Case(x, probs, w1, w2, w3)
    ref = ref_case.run(composed, idx, sbe)
    ours = ours_case.run(hk.mega_moe, idx, sbe)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    for a, b in zip(ours_case.grads(ours, g), ref_case.grads(ref, g), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sbe", [False, True])
def test_no_host_syncs_forward_or_backward(sbe: bool) -> None:
    x, idx, probs, w1, w2, w3 = make(7)
    case = Case(x, probs, w1, w2, w3)
    with count_host_syncs() as forward:
        out = case.run(hk.mega_moe, idx, sbe)
    forward.assert_at_most(0, what="mega_moe forward")
    with count_host_syncs() as backward:
        grads = case.grads(out, torch.ones_like(out))
    backward.assert_at_most(0, what="mega_moe backward")
    assert all(g is not None for g in grads)
    with count_host_syncs() as direct:
        hk.mega_moe_grad(out.detach(), x, idx, probs, w1, w2, w3, score_before_experts=sbe)
    direct.assert_at_most(0, what="mega_moe_grad")
    # the unaligned fallback is sync-free too (the composed loop reads the counts on the host)
    x, idx, probs, w1, w2, w3 = make(8, dim=6, hidden=10)
    with count_host_syncs() as fallback:
        hk.mega_moe(x, idx, probs, w1, w2, w3)
    fallback.assert_at_most(0, what="mega_moe masked fallback")


def _saved_bytes(fn: Any) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_saves_less_for_backward_than_the_composed_ops() -> None:
    """The fused op keeps gate, up and the choice outputs; autograd of the composed ops also
    keeps the permuted tokens, silu(gate), and the SwiGLU product (recomputed here)."""
    tokens, topk, dim, hidden = 32, 2, 16, 48
    x, idx, probs, w1, w2, w3 = make(9, tokens=tokens, dim=dim, hidden=hidden)
    case = Case(x, probs, w1, w2, w3)
    fused = _saved_bytes(lambda: case.run(hk.mega_moe, idx, False))
    unfused = _saved_bytes(lambda: case.run(composed, idx, False))
    rows = tokens * topk
    # The fused op saves its inputs plus [N, H] gate and up and the [N, D] expert outputs
    # (N = T k rows); the composed graph adds the permuted rows [N, D] and two more [N, H].
    assert unfused - fused >= 4 * (rows * dim + 2 * rows * hidden)


def test_meta_tensors_give_shapes() -> None:
    x, idx, probs, w1, w2, w3 = (t.to("meta") for t in make(10))
    assert hk.mega_moe(x, idx, probs, w1, w2, w3).shape == x.shape


def test_compiles_with_aot_eager() -> None:
    x, idx, probs, w1, w2, w3 = make(11)
    compiled = torch.compile(hk.mega_moe, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, idx, probs, w1, w2, w3), hk.mega_moe(x, idx, probs, w1, w2, w3))


def test_bad_input_is_named() -> None:
    x, idx, probs, w1, w2, w3 = make(12)
    with pytest.raises(ValueError, match=r"must lie in \[0, 4\), got \[0, 4\]"):
        hk.mega_moe(x, torch.where(idx == 2, 4, idx), probs, w1, w2, w3)
    with pytest.raises(ValueError, match=r"must lie in \[0, 4\), got \[-1, 3\]"):
        hk.mega_moe(x, torch.where(idx == 2, -1, idx), probs, w1, w2, w3)
    with pytest.raises(TypeError, match="expert_indices must be an integer tensor"):
        hk.mega_moe(x, idx.float(), probs, w1, w2, w3)
    with pytest.raises(ValueError, match=r"w2 must have shape \(4, 16, 24\)"):
        hk.mega_moe(x, idx, probs, w1, w2.transpose(1, 2), w3)
    with pytest.raises(ValueError, match=r"w3 must have shape \(4, 24, 16\)"):
        hk.mega_moe(x, idx, probs, w1, w2, w3[:3])
    with pytest.raises(TypeError, match=r"w1 has dtype torch\.bfloat16, expected x's dtype"):
        hk.mega_moe(x, idx, probs, w1.bfloat16(), w2, w3)
    with pytest.raises(ValueError, match=r"probs must have shape \(11, 2\)"):
        hk.mega_moe(x, idx, probs[:, :1], w1, w2, w3)
    with pytest.raises(ValueError, match=r"x must be \[T, dim\]"):
        hk.mega_moe(x.unsqueeze(0), idx, probs, w1, w2, w3)
    with pytest.raises(ValueError, match="expert_indices must be"):
        hk.mega_moe(x, idx[:5], probs, w1, w2, w3)
    with pytest.raises(ValueError, match="score_before_experts=True needs probs"):
        hk.mega_moe(x, idx, None, w1, w2, w3, score_before_experts=True)
    with pytest.raises(ValueError, match="grad_output must have x's shape"):
        hk.mega_moe_grad(x[:3], x, idx, probs, w1, w2, w3)


@pytest.mark.parametrize("sbe", [False, True])
def test_opcheck_both_ops(sbe: bool) -> None:
    """Schemas, fake kernels and the autograd registration agree with the reference kernels."""
    x, idx, probs, w1, w2, w3 = make(13, tokens=6, dim=8, hidden=16)
    leaves = [t.clone().requires_grad_() for t in (x, probs, w1, w2, w3)]
    args = (leaves[0], idx, leaves[1], *leaves[2:], sbe)
    torch.library.opcheck(torch.ops.hp_kernels.mega_moe.default, args)
    saved = torch.ops.hp_kernels.mega_moe.default(x, idx, probs, w1, w2, w3, sbe)[1:]
    grad_args = (torch.ones_like(x), x, idx, probs, w1, w2, w3, *saved, sbe)
    torch.library.opcheck(torch.ops.hp_kernels.mega_moe_grad.default, grad_args)


def test_gradcheck_in_float64_through_the_masked_fallback() -> None:
    """float64 takes the masked per-expert path (no torch._grouped_mm): finite differences."""
    x, idx, probs, w1, w2, w3 = make(14, tokens=5, dim=3, hidden=4, dtype=torch.float64)
    leaves = tuple(t.clone().requires_grad_() for t in (x, probs, w1, w2, w3))
    for sbe in (False, True):

        def fn(
            x: torch.Tensor,
            p: torch.Tensor,
            a: torch.Tensor,
            b: torch.Tensor,
            c: torch.Tensor,
            sbe: bool = sbe,
        ) -> torch.Tensor:
            return hk.mega_moe(x, idx, p, a, b, c, score_before_experts=sbe)

        assert torch.autograd.gradcheck(fn, leaves)
