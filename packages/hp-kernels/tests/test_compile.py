"""One ``torch.compile(fullgraph=True)`` graph using every op: eager and compiled agree."""

from __future__ import annotations

import torch

import hp_kernels as hk


def _step(
    a: torch.Tensor,
    b: torch.Tensor,
    tokens: torch.Tensor,
    idx: torch.Tensor,
    probs: torch.Tensor,
    oa: torch.Tensor,
    la: torch.Tensor,
    ob: torch.Tensor,
    lb: torch.Tensor,
    acc: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    # All-gather path (the other rank's slice is zeroed here in place of the collective).
    _, buf = hk.all_gather_copy_in([a, b], [6, 4], 2, 0, torch.float32)
    buf[10:].zero_()
    o1, o2 = torch.empty(12), torch.empty(8)
    hk.all_gather_copy_out(buf, [6, 4], 2, [o1, o2])
    w = hk.unpadded_views(o1, [2, 3], [4, 3], 0, 2)
    # Reduce-scatter path.
    rs = hk.reduce_scatter_copy_in([w, b.view(1, 3).expand(2, 3)], [0, 1], 1, torch.float32)
    hk.post_reduce(rs, divide_factor=2.0, accumulate_into=acc)
    grad = hk.post_reduce(rs, divide_factor=2.0, scale=0.5, out_dtype=torch.bfloat16)
    # MoE and attention merge.
    permuted, order, counts = hk.permute_tokens(tokens, idx, 3)
    combined = hk.unpermute_tokens(permuted * 2, order, probs)
    out, lse = hk.merge_attention_partials(oa, la, ob, lb)
    return grad, o2, combined, counts, out, lse


def test_every_op_compiles_fullgraph() -> None:
    gen = torch.Generator().manual_seed(0)
    args = [
        torch.randn(2, 3, generator=gen),
        torch.randn(3, generator=gen),
        torch.randn(6, 4, generator=gen),
        torch.randint(0, 3, (6, 2), generator=gen),
        torch.rand(6, 2, generator=gen),
        torch.randn(2, 5, 4, generator=gen),
        torch.randn(2, 5, generator=gen),
        torch.randn(2, 5, 4, generator=gen),
        torch.randn(2, 5, generator=gen),
    ]
    acc_eager, acc_compiled = torch.zeros(18), torch.zeros(18)
    eager = _step(*args, acc_eager)
    compiled_fn = torch.compile(_step, fullgraph=True, backend="aot_eager")
    compiled = compiled_fn(*args, acc_compiled)
    for e, c in zip(eager, compiled, strict=True):
        torch.testing.assert_close(c, e, rtol=0, atol=0)
    torch.testing.assert_close(acc_compiled, acc_eager, rtol=0, atol=0)
    assert acc_eager.abs().sum() > 0
