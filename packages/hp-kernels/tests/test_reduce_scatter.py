"""Reduce-scatter copy-in (bitwise vs torch._chunk_cat) and post-reduce (vs torch FSDP2's steps)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

import hp_kernels as hk


def _torch_rs_input(grads, dims, ws, dtype, predivide=None):
    """Torch FSDP2's reduce-scatter input: Shard(d>0) rearranged, then ``_chunk_cat`` + div_."""
    arranged = [
        torch.cat(torch.chunk(g, ws, dim=d), dim=0) if d % g.dim() else g
        for g, d in zip(grads, dims, strict=True)
    ]
    numel = hk.reduce_scatter_numel([g.shape for g in grads], dims, ws)
    out = torch.empty(numel, dtype=dtype)
    torch._chunk_cat(arranged, 0, ws, out=out.view(ws, -1))
    if predivide is not None and predivide != 1:
        out.div_(predivide)
    return out


def _random_grads(gen: torch.Generator, ws: int, dtype: torch.dtype):
    shapes_dims = [
        ((7, 5), 0),
        ((3,), 0),
        ((2, 2 * ws, 3), 1),
        ((ws * 2, 3), 0),
        ((1, 4), 0),
        ((4, ws), -1),
    ]
    grads = [torch.randn(s, generator=gen).to(dtype) for s, _ in shapes_dims]
    return grads, [d for _, d in shapes_dims]


@pytest.mark.parametrize("ws", [1, 2, 3, 4, 5])
@pytest.mark.parametrize(
    ("grad_dtype", "reduce_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
def test_copy_in_bitwise_equals_torch_chunk_cat(
    ws: int, grad_dtype: torch.dtype, reduce_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(ws)
    grads, dims = _random_grads(gen, ws, grad_dtype)
    ours = hk.reduce_scatter_copy_in(grads, dims, ws, reduce_dtype)
    ref = _torch_rs_input(grads, dims, ws, reduce_dtype)
    assert ours.dtype == reduce_dtype
    assert ours.shape == ref.shape
    assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))
    # Padding rows are zero: rank chunk of the 3-element vector on ws=5 is partly empty.
    # fp16: torch's pre-division happens after the cast, in the reduce dtype.
    pre, _ = hk.gradient_divide_factors(ws, reduce_dtype)
    ours_pre = hk.reduce_scatter_copy_in(grads, dims, ws, reduce_dtype, predivide_factor=pre)
    assert torch.equal(ours_pre, _torch_rs_input(grads, dims, ws, reduce_dtype, pre))
    buf = torch.full_like(ref, float("nan"))
    assert hk.reduce_scatter_copy_in(grads, dims, ws, reduce_dtype, out=buf) is buf
    assert torch.equal(buf, ref)


def test_only_given_gradients_and_layout_by_hand() -> None:
    a = torch.arange(5.0)  # dim 0 uneven: chunks [0,1], [2,3], [4, pad]
    b = torch.arange(6.0).view(2, 3) + 10  # one row per rank, last rank only padding
    out = hk.reduce_scatter_copy_in([a, b], [0, 0], 3, torch.float32).view(3, -1)
    assert out.tolist() == [
        [0, 1, 10, 11, 12],
        [2, 3, 13, 14, 15],
        [4, 0, 0, 0, 0],
    ]
    c = torch.arange(8.0).view(2, 4)  # Shard(1), ws=2: chunk r = columns [2r, 2r+2)
    out = hk.reduce_scatter_copy_in([c], [1], 2, torch.float32).view(2, -1)
    assert out.tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_copy_in_errors() -> None:
    with pytest.raises(ValueError, match="at least one"):
        hk.reduce_scatter_copy_in([], [], 2, torch.float32)
    with pytest.raises(ValueError, match="even sharding"):
        hk.reduce_scatter_copy_in([torch.randn(2, 3)], [1], 2, torch.float32)
    with pytest.raises(ValueError, match="shard_dims"):
        hk.reduce_scatter_copy_in([torch.randn(2, 3)], [0, 1], 2, torch.float32)
    with pytest.raises(ValueError, match="out of range"):
        hk.reduce_scatter_copy_in([torch.randn(2, 3)], [2], 2, torch.float32)
    with pytest.raises(ValueError, match="0-d"):
        hk.reduce_scatter_copy_in([torch.tensor(1.0)], [0], 2, torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        hk.reduce_scatter_copy_in(
            [torch.randn(2)], [0], 2, torch.float32, out=torch.empty(2, dtype=torch.half)
        )
    with pytest.raises(ValueError, match="elements"):
        hk.reduce_scatter_copy_in([torch.randn(2)], [0], 2, torch.float32, out=torch.empty(3))


def test_copy_in_gradcheck_float64() -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(5, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return hk.reduce_scatter_copy_in([x, y], [0, 1], 2, torch.float64, predivide_factor=2.0)

    assert torch.autograd.gradcheck(fn, (a, b))


def test_opcheck_reduce_scatter_ops() -> None:
    grads = [torch.randn(5, 2, requires_grad=True), torch.randn(3, 4, requires_grad=True)]
    torch.library.opcheck(
        torch.ops.hp_kernels.reduce_scatter_copy_in.default,
        (grads, [0, 1], 2, torch.float32, None),
    )
    torch.library.opcheck(
        torch.ops.hp_kernels.reduce_scatter_copy_in_out.default,
        ([g.detach() for g in grads], [0, 1], 2, 2.0, torch.zeros(24)),
    )
    x = torch.randn(6, requires_grad=True)
    torch.library.opcheck(torch.ops.hp_kernels.post_reduce.default, (x, 3.0, 0.5, torch.bfloat16))
    torch.library.opcheck(
        torch.ops.hp_kernels.post_reduce_accumulate.default,
        (x.detach(), torch.zeros(6), 3.0, None, None),
    )
    torch.library.opcheck(
        torch.ops.hp_kernels.post_reduce_inplace.default, (torch.randn(6), 3.0, 2.0)
    )


@pytest.mark.parametrize("ws", [1, 2, 3, 4, 6, 8, 12, 16, 24, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_divide_factors_match_torch(ws: int, dtype: torch.dtype) -> None:
    class _Group:  # duck-typed group: torch only calls size()
        def size(self) -> int:
            return ws

    pre, post, _, _ = _get_gradient_divide_factors(
        _Group(), None, dtype, "cpu", None, force_sum_reduction_for_comms=True
    )
    assert hk.gradient_divide_factors(ws, dtype) == (pre, post)
    pre, post, _, _ = _get_gradient_divide_factors(
        _Group(), None, dtype, "cpu", 2.0 * ws, force_sum_reduction_for_comms=True
    )
    assert hk.gradient_divide_factors(ws, dtype, 2.0 * ws) == (pre, post)


@pytest.mark.parametrize(
    ("reduce_dtype", "orig_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float32),
    ],
)
def test_post_reduce_bitwise_equals_torch_sequence(
    reduce_dtype: torch.dtype, orig_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(3)
    reduced = (torch.randn(37, generator=gen) * 7).to(reduce_dtype)
    existing = torch.randn(37, generator=gen).to(orig_dtype)
    for ws in (3, 7):
        # Torch FSDP2: reduce_output.div_(post); .to(orig_dtype); grad += new_grad.
        ref = reduced.clone().div_(float(ws)).to(orig_dtype)
        ours = hk.post_reduce(reduced, divide_factor=ws, out_dtype=orig_dtype)
        assert torch.equal(ours, ref)
        assert not torch.equal(reduced.to(orig_dtype), ours)  # it divided
        acc = existing.clone()
        assert (
            hk.post_reduce(reduced, divide_factor=ws, out_dtype=orig_dtype, accumulate_into=acc)
            is acc
        )
        assert torch.equal(acc, existing + ref)
        inplace = reduced.clone()
        assert hk.post_reduce(inplace, divide_factor=ws, inplace=True) is inplace
        assert torch.equal(inplace, reduced.clone().div_(float(ws)))


def test_post_reduce_true_division_and_scale_and_fp32_main_grad() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    ours = hk.post_reduce(x, divide_factor=3.0)
    assert torch.equal(ours, x / 3.0)
    assert not torch.equal(ours, x * (1.0 / 3.0))  # multiplying by 1/3 differs in some bits
    scaled = hk.post_reduce(x, divide_factor=3.0, scale=0.25)
    assert torch.equal(scaled, (x / 3.0) * 0.25)
    main_grad = torch.ones(1000, dtype=torch.float32)
    bf = x.to(torch.bfloat16)
    hk.post_reduce(bf, divide_factor=3.0, accumulate_into=main_grad)
    assert torch.equal(main_grad, 1 + (bf / 3.0).float())
    assert torch.equal(hk.post_reduce(x), x)
    with pytest.raises(ValueError, match="non-zero"):
        hk.post_reduce(x, divide_factor=0)
    with pytest.raises(ValueError, match="elements"):
        hk.post_reduce(x, accumulate_into=torch.zeros(3))
    with pytest.raises(ValueError, match="inplace"):
        hk.post_reduce(x, out_dtype=torch.bfloat16, inplace=True)


def test_post_reduce_gradcheck() -> None:
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda t: hk.post_reduce(t, divide_factor=3.0, scale=2.0, out_dtype=torch.float64), (x,)
    )
    with pytest.raises(ValueError, match="requires grad"):
        hk.post_reduce(x, divide_factor=2.0, inplace=True)
