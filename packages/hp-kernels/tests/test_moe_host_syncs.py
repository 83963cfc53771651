"""The MoE permutations synchronize nothing with the host, forward or backward.

Counted with :func:`hp_dtensor.testing.count_host_syncs`, which enters the ``hp_kernels::``
custom ops, so the ATen ops of their reference kernels are seen. The expert-index range check
rides on the counting scatter (no ``min``/``max`` read on the host); a bad index is still a
``ValueError`` naming the range on the CPU.
"""

from __future__ import annotations

import pytest
import torch

import hp_kernels as hk
from hp_dtensor.testing import count_host_syncs


def _routed(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randn(7, 4, generator=gen, requires_grad=True)
    idx = torch.randint(0, 3, (7, 2), generator=gen)
    probs = torch.rand(7, 2, generator=gen, requires_grad=True)
    return tokens, idx, probs


@pytest.mark.parametrize("grad", [True, False])
def test_permute_and_unpermute_have_no_host_syncs(grad: bool) -> None:
    tokens, idx, probs = _routed()
    tokens.requires_grad_(grad)
    probs.requires_grad_(grad)
    with count_host_syncs() as forward:
        rows, order, counts = hk.permute_tokens(tokens, idx, 3)
        out = hk.unpermute_tokens(rows * 2, order, probs)
    forward.assert_at_most(0, what="permute + unpermute forward")
    assert counts.tolist() == torch.bincount(idx.reshape(-1), minlength=3).tolist()
    if grad:
        with count_host_syncs() as backward:
            out.sum().backward()
        backward.assert_at_most(0, what="permute + unpermute backward")
        assert tokens.grad is not None
        assert probs.grad is not None


def test_aligned_permutation_has_no_host_syncs() -> None:
    tokens, idx, probs = _routed(1)
    with count_host_syncs() as forward:
        rows, positions, padded = hk.permute_tokens_aligned(tokens, idx, 3, 4)
        out = hk.unpermute_tokens_aligned(rows, positions, probs)
    forward.assert_at_most(0, what="aligned permute + combine forward")
    assert padded.remainder(4).eq(0).all()
    with count_host_syncs() as backward:
        out.sum().backward()
    backward.assert_at_most(0, what="aligned permute + combine backward")


@pytest.mark.parametrize("bad", [[0, 3, 1], [0, -1, 1]])
def test_out_of_range_indices_are_value_errors_naming_the_range(bad: list[int]) -> None:
    x = torch.arange(6.0).view(3, 2)
    lo, hi = min(bad), max(bad)
    with pytest.raises(ValueError, match=rf"must lie in \[0, 3\), got \[{lo}, {hi}\]"):
        hk.permute_tokens(x, torch.tensor(bad), 3)
    with pytest.raises(ValueError, match=rf"must lie in \[0, 3\), got \[{lo}, {hi}\]"):
        hk.permute_tokens_aligned(x.requires_grad_(), torch.tensor(bad), 3, 2)
