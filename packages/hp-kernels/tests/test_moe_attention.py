"""MoE permute/unpermute and the LSE attention merge: oracles, gradcheck, opcheck, compile."""

from __future__ import annotations

import pytest
import torch

import hp_kernels as hk


def _loop_permute(tokens: torch.Tensor, idx: torch.Tensor, num_experts: int):
    """Oracle: walk experts in order, then tokens, then choices."""
    rows, src = [], []
    for e in range(num_experts):
        for t in range(idx.shape[0]):
            for c in range(idx.shape[1]):
                if int(idx[t, c]) == e:
                    rows.append(tokens[t])
                    src.append(t * idx.shape[1] + c)
    return torch.stack(rows), torch.tensor(src)


@pytest.mark.parametrize(("num_tokens", "topk", "num_experts"), [(9, 1, 4), (8, 2, 3), (5, 3, 6)])
def test_permute_matches_loop_oracle_and_unpermute_inverts(
    num_tokens: int, topk: int, num_experts: int
) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    tokens = torch.randn(num_tokens, 4, generator=gen)
    idx = torch.randint(0, num_experts, (num_tokens, topk), generator=gen)
    permuted, sorted_indices, counts = hk.permute_tokens(tokens, idx, num_experts)
    ref_rows, ref_src = _loop_permute(tokens, idx, num_experts)
    assert torch.equal(permuted, ref_rows)
    assert torch.equal(sorted_indices, ref_src)
    assert counts.tolist() == [int((idx == e).sum()) for e in range(num_experts)]
    assert int(counts.sum()) == num_tokens * topk
    # Expert outputs (here: a per-expert scale), combined with router weights.
    expert_of_row = torch.repeat_interleave(torch.arange(num_experts), counts)
    outputs = permuted * (expert_of_row + 1).unsqueeze(1)
    probs = torch.rand(num_tokens, topk, generator=gen)
    combined = hk.unpermute_tokens(outputs, sorted_indices, probs)
    ref = torch.zeros_like(tokens)
    for t in range(num_tokens):
        for c in range(topk):
            ref[t] += probs[t, c] * tokens[t] * (int(idx[t, c]) + 1)
    torch.testing.assert_close(combined, ref)
    unweighted = hk.unpermute_tokens(permuted, sorted_indices, topk=topk)
    torch.testing.assert_close(unweighted, tokens * topk)


def test_permute_one_dim_indices_and_errors() -> None:
    x = torch.arange(6.0).view(3, 2)
    p, idx, cnt = hk.permute_tokens(x, torch.tensor([2, 0, 2]), 3)
    assert p.tolist() == [[2, 3], [0, 1], [4, 5]]
    assert cnt.tolist() == [1, 0, 2]
    assert torch.equal(hk.unpermute_tokens(p, idx), x)
    with pytest.raises(ValueError, match="lie in"):
        hk.permute_tokens(x, torch.tensor([3, 0, 0]), 3)
    with pytest.raises(TypeError, match="integer"):
        hk.permute_tokens(x, torch.tensor([0.0, 0.0, 0.0]), 3)
    with pytest.raises(ValueError, match="T = 3"):
        hk.permute_tokens(x, torch.tensor([0, 0]), 3)
    with pytest.raises(ValueError, match="topk"):
        hk.unpermute_tokens(p, idx, torch.ones(3, 1), topk=2)
    with pytest.raises(ValueError, match="multiple"):
        hk.unpermute_tokens(p, idx, topk=2)


def test_moe_gradcheck_float64() -> None:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, 3, (5, 2), generator=gen)
    probs = torch.rand(5, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, generator=gen, dtype=torch.float64, requires_grad=True)

    def fn(t: torch.Tensor, p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        permuted, sorted_indices, _ = hk.permute_tokens(t, idx, 3)
        return hk.unpermute_tokens(torch.tanh(permuted * w), sorted_indices, p)

    assert torch.autograd.gradcheck(fn, (tokens, probs, weight))

    def unweighted(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        permuted, sorted_indices, _ = hk.permute_tokens(t, idx, 3)
        return hk.unpermute_tokens(torch.tanh(permuted * w), sorted_indices, topk=2)

    assert torch.autograd.gradcheck(unweighted, (tokens, weight))


def test_moe_opcheck() -> None:
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randn(6, 4, generator=gen, requires_grad=True)
    idx = torch.randint(0, 3, (6, 2), generator=gen)
    torch.library.opcheck(torch.ops.hp_kernels.permute_tokens.default, (tokens, idx, 3))
    permuted, sorted_indices, _ = hk.permute_tokens(tokens.detach(), idx, 3)
    probs = torch.rand(6, 2, generator=gen, requires_grad=True)
    torch.library.opcheck(
        torch.ops.hp_kernels.unpermute_tokens.default,
        (permuted.requires_grad_(), sorted_indices, probs, 2),
    )


def _attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    scores = q @ k.transpose(-1, -2)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_equals_attention_over_all_keys(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 5, 8, generator=gen, dtype=dtype)
    k = torch.randn(2, 3, 12, 8, generator=gen, dtype=dtype)
    v = torch.randn(2, 3, 12, 8, generator=gen, dtype=dtype)
    full, full_lse = _attention_with_lse(q, k, v)
    oa, la = _attention_with_lse(q, k[..., :7, :], v[..., :7, :])
    ob, lb = _attention_with_lse(q, k[..., 7:, :], v[..., 7:, :])
    out, lse = hk.merge_attention_partials(oa, la, ob, lb)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out, full, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, full_lse, rtol=tol, atol=tol)
    # Merging is commutative.
    out2, lse2 = hk.merge_attention_partials(ob, lb, oa, la)
    torch.testing.assert_close(out2, out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse2, lse, rtol=tol, atol=tol)


def test_merge_handles_empty_sides_and_low_precision() -> None:
    o = torch.randn(4, 3)
    lse = torch.randn(4)
    empty_lse = torch.full((4,), float("-inf"))
    out, merged = hk.merge_attention_partials(o, lse, torch.zeros(4, 3), empty_lse)
    torch.testing.assert_close(out, o)
    torch.testing.assert_close(merged, lse)
    out, merged = hk.merge_attention_partials(o, empty_lse, o, empty_lse)
    assert torch.equal(out, torch.zeros_like(o))
    assert torch.isneginf(merged).all()
    ob = o.to(torch.bfloat16)
    out, _ = hk.merge_attention_partials(ob, lse, ob, lse)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ob)  # fp32 compute: equal halves merge exactly
    with pytest.raises(ValueError, match="shape"):
        hk.merge_attention_partials(o, lse, o, lse[:3])
    with pytest.raises(ValueError, match=r"out.shape\[:-1\]"):
        hk.merge_attention_partials(o, lse[:3], o, lse[:3])
    with pytest.raises(TypeError, match="dtype"):
        hk.merge_attention_partials(o, lse, ob, lse)


def test_merge_gradcheck_opcheck() -> None:
    gen = torch.Generator().manual_seed(4)
    args = [
        torch.randn(2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True),
        torch.randn(2, 3, generator=gen, dtype=torch.float64, requires_grad=True),
        torch.randn(2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True),
        torch.randn(2, 3, generator=gen, dtype=torch.float64, requires_grad=True),
    ]
    assert torch.autograd.gradcheck(lambda *a: hk.merge_attention_partials(*a), tuple(args))
    f32 = [a.detach().float().requires_grad_() for a in args]
    torch.library.opcheck(torch.ops.hp_kernels.merge_attention_partials.default, tuple(f32))
