"""MoE building blocks on one device: router, grouped experts, MoE, load statistics, errors.

Oracles: a per-token loop written from the definitions (each token's top-k experts run as plain
SwiGLU matmuls and summed with their weights), brute-force group-limited routing, and the
per-expert loop for the grouped GEMM.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

from hp_cp_ep import (
    GroupedExperts,
    MoE,
    MoEArgs,
    Router,
    TokenChoiceTopKRouter,
    expert_load,
    grouped_mm_supported,
    load_balancing_loss,
    moe_layers,
    register_expert_bias_update,
    update_expert_bias,
)

DIM, HIDDEN = 16, 32


def _swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()


def _per_token_moe(moe: MoE, x: torch.Tensor, dropped: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE written token by token from its definition (no permutation, no grouped GEMM)."""
    tokens = x.reshape(-1, x.shape[-1])
    weights, chosen, _ = moe.router(tokens, moe.expert_bias)
    exp = moe.experts
    rows = []
    for t in range(tokens.shape[0]):
        acc = torch.zeros_like(tokens[t])
        for c in range(moe.top_k):
            if dropped is not None and dropped[t, c]:
                continue
            e = int(chosen[t, c])
            if moe.moe_args.score_before_experts:
                y = _swiglu(tokens[t] * weights[t, c], exp.w1[e], exp.w2[e], exp.w3[e])
            else:
                y = weights[t, c] * _swiglu(tokens[t], exp.w1[e], exp.w2[e], exp.w3[e])
            acc = acc + y
        if moe.shared_experts is not None:
            acc = acc + moe.shared_experts(tokens[t])
        rows.append(acc)
    return torch.stack(rows).reshape(x.shape)


# ------------------------------------------------------------------------------------------
# router
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_topk_norm_scale_and_bias(score_func: str) -> None:
    torch.manual_seed(0)
    router = TokenChoiceTopKRouter(
        DIM, 6, top_k=2, score_func=score_func, route_norm=True, route_scale=2.5
    )
    x = torch.randn(10, DIM)
    logits = x @ router.gate.weight.t()
    probs = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    top, idx = probs.topk(2, dim=-1)
    scores, chosen, counts = router(x)
    assert torch.equal(chosen, idx)
    torch.testing.assert_close(scores, 2.5 * top / top.sum(-1, keepdim=True))
    assert counts.tolist() == torch.bincount(idx.flatten(), minlength=6).tolist()
    # the bias steers the choice only: a huge bias on expert 5 selects it, unbiased weight kept
    bias = torch.zeros(6)
    bias[5] = 100.0
    scores_b, chosen_b, counts_b = router(x, bias)
    assert (chosen_b == 5).any(-1).all()
    assert counts_b[5] == 10
    col = (chosen_b == 5).float().argmax(-1)
    raw = probs[:, 5]
    other = probs.gather(1, chosen_b).sum(-1)
    torch.testing.assert_close(scores_b[torch.arange(10), col], 2.5 * raw / other)
    assert Router is TokenChoiceTopKRouter


def test_group_limited_routing_matches_brute_force() -> None:
    torch.manual_seed(1)
    groups, limited, experts, k = 4, 2, 8, 3
    router = TokenChoiceTopKRouter(
        DIM, experts, num_expert_groups=groups, num_limited_groups=limited, top_k=k
    )
    x = torch.randn(20, DIM)
    _, chosen, _ = router(x)
    probs = (x @ router.gate.weight.t()).sigmoid().detach()
    per_group = experts // groups
    for t in range(20):
        g_score = [
            probs[t, g * per_group : (g + 1) * per_group].topk(2).values.sum()
            for g in range(groups)
        ]
        best = sorted(range(groups), key=lambda g: -float(g_score[g]))[:limited]
        allowed = [e for g in best for e in range(g * per_group, (g + 1) * per_group)]
        expected = sorted(allowed, key=lambda e: -float(probs[t, e]))[:k]
        assert sorted(chosen[t].tolist()) == sorted(expected)
        assert {e // per_group for e in chosen[t].tolist()} <= set(best)


def test_router_bad_input_names_values() -> None:
    with pytest.raises(ValueError, match=r"top_k=5 must lie in \[1, num_experts=4\]"):
        TokenChoiceTopKRouter(DIM, 4, top_k=5)
    with pytest.raises(
        ValueError, match="num_expert_groups=3 must be positive and divide num_experts=8"
    ):
        TokenChoiceTopKRouter(DIM, 8, num_expert_groups=3, num_limited_groups=1)
    with pytest.raises(ValueError, match="num_limited_groups=None"):
        TokenChoiceTopKRouter(DIM, 8, num_expert_groups=4)
    with pytest.raises(ValueError, match="top_k=5 exceeds the 4 experts reachable"):
        TokenChoiceTopKRouter(DIM, 8, num_expert_groups=4, num_limited_groups=2, top_k=5)
    with pytest.raises(ValueError, match="score_func"):
        TokenChoiceTopKRouter(DIM, 8, score_func="relu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity_factor"):
        MoE(MoEArgs(num_experts=4, capacity_factor=0.0), DIM, HIDDEN)


def test_load_balancing_loss_values_and_gradient() -> None:
    uniform = torch.full((4, 4), 0.25)
    balanced = torch.tensor([[0], [1], [2], [3]])
    assert float(load_balancing_loss(uniform, balanced, 4)) == pytest.approx(1.0)
    peaked = torch.tensor([[1.0, 0, 0, 0]] * 4)
    assert float(
        load_balancing_loss(peaked, torch.zeros(4, 1, dtype=torch.long), 4)
    ) == pytest.approx(4.0)
    # the aux loss reaches the router through the backward without the caller adding it
    torch.manual_seed(2)
    args = MoEArgs(num_experts=4, top_k=2, num_shared_experts=0, aux_loss_coeff=0.5)
    moe = MoE(args, DIM, HIDDEN)
    plain = MoE(MoEArgs(num_experts=4, top_k=2, num_shared_experts=0), DIM, HIDDEN)
    plain.load_state_dict(moe.state_dict())
    x = torch.randn(12, DIM)
    moe(x).sum().backward()
    out = plain(x)
    routing = plain.router.route(x, plain.expert_bias)
    aux = load_balancing_loss(routing.scores, routing.selected_experts, 4)
    (out.sum() + 0.5 * aux).backward()
    torch.testing.assert_close(moe.router.gate.weight.grad, plain.router.gate.weight.grad)
    assert moe.aux_loss is not None
    assert float(moe.aux_loss) == pytest.approx(float(aux.detach()))


# ------------------------------------------------------------------------------------------
# experts
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_grouped_experts_match_per_expert_matmuls_with_empty_experts(use_grouped_mm: bool) -> None:
    torch.manual_seed(3)
    experts = GroupedExperts(DIM, HIDDEN, 4, use_grouped_mm=use_grouped_mm)
    counts = torch.tensor([3, 0, 5, 0])  # two experts get no rows
    x = torch.randn(8, DIM, requires_grad=True)
    assert grouped_mm_supported(x, experts.w1, experts.w2)
    out = experts(x, counts)
    target = torch.randn_like(out)
    (out * target).sum().backward()
    xr = x.detach().clone().requires_grad_()
    w = [p.detach().clone().requires_grad_() for p in (experts.w1, experts.w2, experts.w3)]
    ref = torch.cat(
        [_swiglu(xr[:3], w[0][0], w[1][0], w[2][0]), _swiglu(xr[3:], w[0][2], w[1][2], w[2][2])]
    )
    (ref * target).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    for p, r in zip((experts.w1, experts.w2, experts.w3), w, strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6)
        assert p.grad[1].abs().max() == 0
        assert p.grad[3].abs().max() == 0
    empty = experts(torch.randn(0, DIM), torch.zeros(4, dtype=torch.long))
    assert empty.shape == (0, DIM)
    # no rows for any local expert: the result still joins the graph, so under EP this rank's
    # backward reaches the combine all-to-all its peers wait in (a detached result hung there)
    experts.zero_grad()
    none = torch.randn(0, DIM, requires_grad=True)
    out = experts(none, torch.zeros(4, dtype=torch.long))
    assert out.shape == (0, DIM)
    assert out.grad_fn is not None
    out.sum().backward()
    assert none.grad is not None
    assert none.grad.shape == (0, DIM)
    assert all(p.grad is not None and p.grad.abs().max() == 0 for p in experts.parameters())


def test_grouped_mm_fallback_for_unaligned_or_half_dtypes() -> None:
    torch.manual_seed(4)
    odd = GroupedExperts(6, 10, 3)  # 6 * 4 bytes is not a multiple of 16: per-expert loop
    x = torch.randn(5, 6)
    assert not grouped_mm_supported(x, odd.w1, odd.w2)
    counts = torch.tensor([2, 2, 1])
    ref = torch.cat(
        [
            _swiglu(x[i:j], odd.w1[e], odd.w2[e], odd.w3[e])
            for e, (i, j) in enumerate([(0, 2), (2, 4), (4, 5)])
        ]
    )
    torch.testing.assert_close(odd(x, counts), ref)
    assert not grouped_mm_supported(x.double(), odd.w1.double())
    half = copy.deepcopy(odd).double()
    torch.testing.assert_close(half(x.double(), counts), ref.double(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------
# MoE
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("score_before", "shared", "score_func"),
    list(itertools.product([True, False], [0, 2], ["sigmoid", "softmax"])),
)
def test_moe_matches_per_token_definition(score_before: bool, shared: int, score_func: str) -> None:
    torch.manual_seed(5)
    args = MoEArgs(
        num_experts=4,
        top_k=2,
        num_shared_experts=shared,
        score_before_experts=score_before,
        score_func=score_func,  # type: ignore[arg-type]
        route_norm=True,
    )
    moe = MoE(args, DIM, HIDDEN)
    reference = copy.deepcopy(moe)
    x = torch.randn(2, 5, DIM)
    out = moe(x)
    ref = _per_token_moe(reference, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    target = torch.randn_like(out)
    (out * target).sum().backward()
    (ref * target).sum().backward()
    for (name, p), r in zip(moe.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert moe.tokens_per_expert.sum() == 20


def test_capacity_factor_drops_later_tokens_of_full_experts() -> None:
    torch.manual_seed(6)
    args = MoEArgs(num_experts=4, top_k=1, num_shared_experts=0, capacity_factor=1.0)
    moe = MoE(args, DIM, HIDDEN)
    with torch.no_grad():
        moe.router.gate.weight[0] += 3.0 * moe.router.gate.weight.abs().max()  # expert 0 hot
    x = torch.randn(12, DIM).abs()
    _, chosen, counts = moe.router(x)
    assert counts[0] > 3  # capacity ceil(1.0 * 12 * 1 / 4) = 3
    seen: dict[int, int] = {}
    dropped = torch.zeros(12, 1, dtype=torch.bool)
    for t in range(12):
        e = int(chosen[t, 0])
        seen[e] = seen.get(e, 0) + 1
        dropped[t, 0] = seen[e] > 3
    out = moe(x)
    torch.testing.assert_close(out, _per_token_moe(moe, x, dropped), rtol=1e-5, atol=1e-6)
    assert (out[dropped[:, 0]] == 0).all()
    assert dropped.sum() == counts[0] - 3


def test_expert_bias_update_and_load_stats() -> None:
    torch.manual_seed(7)
    model = torch.nn.Sequential(
        MoE(MoEArgs(num_experts=4, top_k=1, load_balance_coeff=0.1), DIM, HIDDEN),
        MoE(MoEArgs(num_experts=4, top_k=1, load_balance_coeff=None), DIM, HIDDEN),
    )
    assert list(moe_layers(model)) == ["0", "1"]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    handle = register_expert_bias_update(opt, model)
    x = torch.randn(16, DIM)
    model(x).sum().backward()
    counts = model[0].tokens_per_expert.clone()
    opt.step()
    expected = 0.1 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(model[0].expert_bias, expected - expected.mean())
    assert model[0].tokens_per_expert.sum() == 0
    load = model[0].last_load
    assert load is not None
    assert torch.equal(load.tokens_per_expert, counts)
    assert load.max == float(counts.max())
    assert load.imbalance == pytest.approx(float(counts.max()) / 4.0)
    handle.remove()
    assert update_expert_bias(torch.nn.Linear(2, 2)) == {}
    stats = expert_load(torch.tensor([6.0, 2.0, 0.0, 0.0]))
    assert (stats.min, stats.max, stats.mean, stats.imbalance) == (0.0, 6.0, 2.0, 3.0)
    assert expert_load(torch.zeros(3)).imbalance == 0.0


def test_activation_checkpoint_recompute_counts_tokens_once() -> None:
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(8)
    moe = MoE(MoEArgs(num_experts=4, top_k=2, aux_loss_coeff=0.1), DIM, HIDDEN)
    plain = copy.deepcopy(moe)
    x = torch.randn(6, DIM)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    plain(x).sum().backward()
    assert torch.equal(moe.tokens_per_expert, plain.tokens_per_expert)
    assert moe.tokens_per_expert.sum() == 12
    for p, r in zip(moe.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad)


@pytest.mark.parametrize("dim", [16, 12])  # 16: bf16 grouped GEMM; 12 * 2 bytes: the loop
def test_bf16_moe_tracks_fp32(dim: int) -> None:
    torch.manual_seed(9)
    moe = MoE(MoEArgs(num_experts=4, top_k=2), dim, 2 * dim)
    low = copy.deepcopy(moe).to(torch.bfloat16)
    x = torch.randn(10, dim)
    assert grouped_mm_supported(x.bfloat16(), low.experts.w1, low.experts.w2) == (dim == 16)
    out = low(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), moe(x), rtol=5e-2, atol=2e-2)
    out.float().square().sum().backward()
    assert low.experts.w1.grad is not None
    assert low.experts.w1.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_under_torch_compile(dtype: torch.dtype) -> None:
    torch.manual_seed(10)
    moe = MoE(MoEArgs(num_experts=4, top_k=2), DIM, HIDDEN).to(dtype)
    reference = copy.deepcopy(moe)
    x = torch.randn(2, 5, DIM, dtype=dtype)
    out = torch.compile(moe, backend="aot_eager")(x)
    expected = reference(x)
    torch.testing.assert_close(out, expected)
    out.float().square().sum().backward()
    expected.float().square().sum().backward()
    for p, r in zip(moe.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad)
    assert torch.equal(moe.tokens_per_expert, reference.tokens_per_expert)


def test_bf16_moe_compiles_as_one_graph_and_counts_recompute_once() -> None:
    """``fullgraph=True``: the expert-load count reads whether a backward runs through an opaque
    op decided when the graph runs (an activation checkpoint's recompute adds nothing), not a
    Python branch that dynamo cannot trace."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(11)
    moe = MoE(MoEArgs(num_experts=4, top_k=2), 16, 32).to(torch.bfloat16)
    reference = copy.deepcopy(moe)
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    out = checkpoint(compiled, x, use_reentrant=False)
    expected = reference(x)
    torch.testing.assert_close(out, expected)
    out.float().square().sum().backward()
    expected.float().square().sum().backward()
    assert torch.equal(moe.tokens_per_expert, reference.tokens_per_expert)
    assert float(moe.tokens_per_expert.sum()) == 2 * 5 * 2  # every choice once
    for p, r in zip(moe.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad)
