"""Aligned MoE permutation (grouped-GEMM layout): oracle, inverse, gradcheck, opcheck, compile."""

from __future__ import annotations

import pytest
import torch

import hp_kernels as hk


def _aligned_oracle(
    tokens: torch.Tensor, idx: torch.Tensor, num_experts: int, alignment: int
) -> tuple[torch.Tensor, list[int], list[int]]:
    """Walk experts, then tokens, then choices; pad each group with zero rows."""
    rows: list[torch.Tensor] = []
    positions = [0] * idx.numel()
    counts = []
    for e in range(num_experts):
        start = len(rows)
        for t in range(idx.shape[0]):
            for c in range(idx.shape[1]):
                if int(idx[t, c]) == e:
                    positions[t * idx.shape[1] + c] = len(rows)
                    rows.append(tokens[t])
        while (len(rows) - start) % alignment:
            rows.append(torch.zeros_like(tokens[0]))
        counts.append(len(rows) - start)
    capacity = idx.numel() + num_experts * (alignment - 1)
    rows += [torch.zeros_like(tokens[0])] * (capacity - len(rows))
    return torch.stack(rows), positions, counts


@pytest.mark.parametrize(
    ("num_tokens", "topk", "num_experts", "alignment"),
    [(9, 1, 4, 4), (8, 2, 3, 8), (5, 3, 6, 3), (7, 2, 5, 1)],
)
def test_aligned_layout_matches_oracle_and_combines_back(
    num_tokens: int, topk: int, num_experts: int, alignment: int
) -> None:
    gen = torch.Generator().manual_seed(num_tokens + alignment)
    tokens = torch.randn(num_tokens, 3, generator=gen)
    idx = torch.randint(0, num_experts, (num_tokens, topk), generator=gen)
    permuted, positions, counts = hk.permute_tokens_aligned(tokens, idx, num_experts, alignment)
    expected, expected_positions, expected_counts = _aligned_oracle(
        tokens, idx, num_experts, alignment
    )
    assert torch.equal(permuted, expected)
    assert positions.tolist() == expected_positions
    assert counts.tolist() == expected_counts
    assert all(c % alignment == 0 for c in counts.tolist())
    # Same rows as the unaligned permutation, in the same order.
    plain, _, _ = hk.permute_tokens(tokens, idx, num_experts)
    assert torch.equal(permuted.index_select(0, positions.sort().values), plain)
    probs = torch.rand(num_tokens, topk, generator=gen)
    combined = hk.unpermute_tokens_aligned(permuted * 2, positions, probs)
    torch.testing.assert_close(combined, 2 * (probs.unsqueeze(-1) * tokens.unsqueeze(1)).sum(1))
    torch.testing.assert_close(
        hk.unpermute_tokens_aligned(permuted, positions, topk=topk), topk * tokens
    )


def test_aligned_errors() -> None:
    tokens = torch.randn(3, 2)
    with pytest.raises(ValueError, match="alignment"):
        hk.permute_tokens_aligned(tokens, torch.tensor([0, 1, 0]), 2, 0)
    with pytest.raises(ValueError, match="expert indices"):
        hk.permute_tokens_aligned(tokens, torch.tensor([0, 2, 0]), 2, 4)
    with pytest.raises(TypeError, match="integer"):
        hk.permute_tokens_aligned(tokens, torch.tensor([0.0, 1.0, 0.0]), 2, 4)
    with pytest.raises(ValueError, match="positions"):
        hk.unpermute_tokens_aligned(tokens, torch.tensor([0, 1, 2]), topk=2)


def test_aligned_gradcheck_opcheck_compile() -> None:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randn(5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    probs = torch.rand(5, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(3, 3, dtype=torch.float64, generator=gen)
    idx = torch.randint(0, 3, (5, 2), generator=gen)

    def layer(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        rows, positions, _ = hk.permute_tokens_aligned(x, idx, 3, 4)
        return hk.unpermute_tokens_aligned(rows @ weight, positions, p)

    assert torch.autograd.gradcheck(layer, (tokens, probs))
    x32 = torch.randn(5, 3, generator=gen)
    torch.library.opcheck(torch.ops.hp_kernels.permute_tokens_aligned.default, (x32, idx, 3, 4))
    rows, positions, _ = hk.permute_tokens_aligned(x32, idx, 3, 4)
    torch.library.opcheck(
        torch.ops.hp_kernels.combine_tokens.default, (rows, positions, probs.detach().float(), 2)
    )
    torch.library.opcheck(torch.ops.hp_kernels.combine_tokens.default, (rows, positions, None, 2))
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(tokens, probs), layer(tokens, probs), rtol=0, atol=0)
