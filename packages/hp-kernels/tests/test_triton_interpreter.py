"""Every Triton kernel under ``TRITON_INTERPRET=1`` on CPU tensors against the reference.

Runs in CI's ``kernels-interpreter`` stage (which installs ``triton`` and sets
``HP_KERNELS_REQUIRE_TRITON=1``, turning the skip below into a failure). Elsewhere the module
skips unless ``triton`` is installed and the interpreter is on (real GPUs are exercised by
``benchmarks/kernels_gpu.py``). Shapes are random (seeded), with uneven and padded sizes, and
every supported dtype; results are compared bitwise where the arithmetic is the same.
"""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

import hp_kernels as hk

pytestmark = pytest.mark.triton_interpret

_REASON = None
if importlib.util.find_spec("triton") is None:
    _REASON = "triton is not installed (pip install hp-kernels[triton])"
elif os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    _REASON = "needs TRITON_INTERPRET=1 (Triton's CPU interpreter)"
if _REASON is not None:
    if os.environ.get("HP_KERNELS_REQUIRE_TRITON") == "1":
        pytest.fail(f"HP_KERNELS_REQUIRE_TRITON=1 but {_REASON}", pytrace=False)
    pytest.skip(_REASON, allow_module_level=True)

from hp_kernels.triton_kernels import LazyLauncher, _common, launcher  # noqa: E402
from hp_kernels.triton_kernels import fsdp as triton_fsdp  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REF = hk.reference_kernel


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.equal(_bits(a), _bits(b)), (a - b).abs().max()


@pytest.fixture
def rng() -> random.Random:
    return random.Random(20)


def _randn(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 3).to(dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_casts_are_exact_for_every_dtype_pair() -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def convert(src, dst, n, BLOCK: tl.constexpr):
        k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(src + k, mask=k < n)
        tl.store(dst + k, _common.cast(x, dst.dtype.element_ty), mask=k < n)

    base = torch.randn(512, generator=torch.Generator().manual_seed(0)) * torch.logspace(
        -42, 38, 512
    )
    base[:6] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1e-45, 65520.0])
    for src_dtype in DTYPES:
        x = base.to(src_dtype)
        for dst_dtype in DTYPES:
            y = torch.empty(512, dtype=dst_dtype)
            convert[(1,)](x, y, 512, BLOCK=512)
            assert_bitwise(y, x.to(dst_dtype))
    nan = torch.full((4,), float("nan"))
    y = torch.empty(4, dtype=torch.bfloat16)
    convert[(1,)](nan, y, 4, BLOCK=4)
    # NaN stays NaN; its payload is not specified (torch's CPU vector path gives 0xFFFF, its
    # scalar path and the kernels 0x7FC0).
    assert y.isnan().all()


def _shards(rng: random.Random, seed: int) -> tuple[list[torch.Tensor], list[int]]:
    shards, splits = [], []
    for i in range(rng.randint(1, 5)):
        split = rng.choice([0, 1, 7, 33, 130])
        numel = rng.randint(0, split)  # short shards are zero-padded
        dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16])
        shard = _randn((numel,), dtype, seed + i)
        if numel % 2 == 0 and numel:
            shard = shard.view(2, numel // 2)
        shards.append(shard)
        splits.append(split)
    return shards, splits


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_copy_in(dtype: torch.dtype, rng: random.Random) -> None:
    for case in range(6):
        shards, splits = _shards(rng, 10 * case)
        world_size = rng.choice([1, 3, 4])
        rank = rng.randrange(world_size)
        total = world_size * sum(splits)
        ours = torch.full((total,), 5.0, dtype=dtype)
        ref = ours.clone()
        launcher("all_gather_copy_in")(shards, splits, rank, ours)
        REF("all_gather_copy_in")(shards, splits, rank, ref)
        assert_bitwise(ours, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_copy_out_and_unsharded_parameters(
    dtype: torch.dtype, rng: random.Random
) -> None:
    world_size = 3
    # Shard(0) even and uneven, Shard(1): padded shards of torch.chunk semantics.
    params = [((7, 4), 0), ((6, 5), 1), ((3,), 0), ((1, 6), 1), ((2, 3), 0)]
    fulls = [_randn(shape, dtype, i) for i, (shape, _) in enumerate(params)]
    padded_shapes = []
    for full, (_, dim) in zip(fulls, params, strict=True):
        chunk = list(full.shape)
        chunk[dim] = -(-chunk[dim] // world_size)
        padded_shapes.append(chunk)
    splits = [int(torch.Size(p).numel()) for p in padded_shapes]
    gathered = torch.zeros(world_size * sum(splits), dtype=dtype)
    for r in range(world_size):
        shards = []
        for full, (_, dim), split in zip(fulls, params, splits, strict=True):
            pieces = torch.chunk(full, world_size, dim)
            piece = pieces[r] if r < len(pieces) else full.narrow(dim, 0, 0)
            padded = torch.zeros(split, dtype=dtype)
            padded[: piece.numel()] = piece.contiguous().view(-1)
            shards.append(padded.view(-1))
        REF("all_gather_copy_in")(shards, splits, r, gathered)
    ours = [torch.full((world_size * s,), 9.0, dtype=dtype) for s in splits]
    ref = [o.clone() for o in ours]
    launcher("all_gather_copy_out")(gathered, splits, world_size, ours)
    REF("all_gather_copy_out")(gathered, splits, world_size, ref)
    for o, r in zip(ours, ref, strict=True):
        assert_bitwise(o, r)
    for o, full, p, (_, dim) in zip(ours, fulls, padded_shapes, params, strict=True):
        if dim == 1 and full.shape[1] % world_size:
            continue
        unsharded = hk.unpadded_views(o, p, full.shape, dim, world_size)
        assert_bitwise(unsharded.contiguous(), full)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_copy_in(dtype: torch.dtype, rng: random.Random) -> None:
    for case in range(5):
        world_size = rng.choice([1, 2, 3, 4])
        grads, dims = [], []
        for i in range(rng.randint(1, 4)):
            shape = [rng.randint(1, 9) for _ in range(rng.choice([1, 2, 3]))]
            dim = rng.choice([0, 0, 1, -1]) if len(shape) > 1 else rng.choice([0, -1])
            d = dim % len(shape)
            if d:
                shape[d] = world_size * rng.randint(1, 3)  # Shard(dim != 0) divides evenly
            grads.append(_randn(tuple(shape), rng.choice(DTYPES), 100 * case + i))
            dims.append(dim)
        for pre in (None, 3.0, 4.0):
            ours = launcher("reduce_scatter_copy_in")(grads, dims, world_size, dtype, pre)
            ref = REF("reduce_scatter_copy_in")(grads, dims, world_size, dtype, pre)
            assert_bitwise(ours, ref)


def _post_cases() -> list[tuple[float | None, float | None]]:
    return [(3.0, None), (None, 0.7), (6.0, 1.3), (4.0, None)]


@pytest.mark.parametrize("reduce_dtype", DTYPES)
def test_post_reduce_all_forms(reduce_dtype: torch.dtype) -> None:
    x = _randn((257,), reduce_dtype, 1) * 50
    for out_dtype in (None, torch.bfloat16, torch.float32):
        for divide, scale in _post_cases():
            assert_bitwise(
                launcher("post_reduce")(x, divide, scale, out_dtype),
                REF("post_reduce")(x, divide, scale, out_dtype),
            )
            main_grad = _randn((257,), torch.float32, 2)
            expected = main_grad.clone()
            launcher("post_reduce_accumulate")(x, main_grad, divide, scale, out_dtype)
            REF("post_reduce_accumulate")(x, expected, divide, scale, out_dtype)
            assert_bitwise(main_grad, expected)
        ours, ref = x.clone(), x.clone()
        launcher("post_reduce_inplace")(ours, 3.0, 0.5)
        REF("post_reduce_inplace")(ref, 3.0, 0.5)
        assert_bitwise(ours, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_division_mode_matches_torch_reciprocal_multiply(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU torch divides by a scalar as ``x * fp32(1 / s)``; the kernels follow it there."""
    monkeypatch.setattr(triton_fsdp, "device_divides_by_reciprocal", lambda t: True)
    x = _randn((300,), dtype, 4) * 7
    inverse = _common.fp32_reciprocal(3.0)
    assert_bitwise(launcher("post_reduce")(x, 3.0, None, None), x * inverse)
    assert not torch.equal(_bits(x.float() * inverse), _bits(x.float() / 3.0))
    grads = [_randn((5, 4), dtype, 5)]
    ours = launcher("reduce_scatter_copy_in")(grads, [0], 2, dtype, 3.0)
    ref = REF("reduce_scatter_copy_in")(grads, [0], 2, dtype, None) * inverse
    assert_bitwise(ours, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_permute_unpermute(dtype: torch.dtype, rng: random.Random) -> None:
    for case in range(4):
        tokens = _randn((rng.randint(1, 13), rng.choice([1, 5, 40]), 3), dtype, case)
        topk, experts = rng.choice([(1, 3), (2, 4), (3, 5)])
        gen = torch.Generator().manual_seed(case)
        idx = torch.randint(0, experts, (tokens.shape[0], topk), generator=gen)
        ours = launcher("permute_tokens")(tokens, idx, experts)
        ref = REF("permute_tokens")(tokens, idx, experts)
        for a, b in zip(ours, ref, strict=True):
            assert torch.equal(a, b)
        probs = torch.rand(tokens.shape[0], topk, generator=gen)
        for weights in (None, probs):
            out = launcher("unpermute_tokens")(ref[0], ref[1], weights, topk)
            expected = REF("unpermute_tokens")(ref[0], ref[1], weights, topk)
            tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {}
            torch.testing.assert_close(out, expected, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_attention_partials(dtype: torch.dtype, rng: random.Random) -> None:
    for case in range(4):
        shape = (rng.randint(1, 3), rng.randint(1, 5), rng.choice([1, 7, 64]))
        out_a, out_b = _randn(shape, dtype, case), _randn(shape, dtype, case + 9)
        lse_a, lse_b = _randn(shape[:-1], torch.float32, 3), _randn(shape[:-1], torch.float32, 4)
        lse_a[0, 0] = lse_b[0, 0] = -float("inf")  # a row that saw no key on either side
        lse_a.view(-1)[-1] = -float("inf")  # one side empty
        ours = launcher("merge_attention_partials")(out_a, lse_a, out_b, lse_b)
        ref = REF("merge_attention_partials")(out_a, lse_a, out_b, lse_b)
        tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}
        torch.testing.assert_close(ours[0], ref[0], **tol)
        torch.testing.assert_close(ours[1], ref[1], rtol=1e-5, atol=1e-6)
        assert torch.equal(ours[0][0, 0], torch.zeros_like(ours[0][0, 0]))


def test_registered_launcher_is_what_the_dispatcher_runs() -> None:
    """The CUDA registration's callable, registered for CPU here, serves the public op."""
    calls: list[str] = []

    class Spy(LazyLauncher):
        def __call__(self, *args: Any) -> Any:
            calls.append(self.op_name)
            return super().__call__(*args)

    x = _randn((100,), torch.float32, 8)
    lib = torch.library.Library("hp_kernels", "FRAGMENT")  # type: ignore[no-untyped-call]
    try:
        hk.register_device_kernel("post_reduce", "cpu", Spy("post_reduce"), lib=lib)
        result = hk.post_reduce(x, divide_factor=3.0, out_dtype=torch.bfloat16)
    finally:
        lib._destroy()
    assert calls == ["post_reduce"]
    assert_bitwise(result, REF("post_reduce")(x, 3.0, None, torch.bfloat16))


def test_kernels_are_autotuned() -> None:
    import triton

    kernels: list[Callable[..., Any]] = [
        triton_fsdp._all_gather_copy_in_kernel,
        triton_fsdp._all_gather_copy_out_kernel,
        triton_fsdp._reduce_scatter_copy_in_kernel,
        triton_fsdp._post_reduce_kernel,
    ]
    for kernel in kernels:
        assert isinstance(kernel, triton.runtime.Autotuner)
        # One config under the interpreter (nothing to benchmark on a CPU).
        assert len(kernel.configs) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_aligned_permute_and_combine(dtype: torch.dtype, rng: random.Random) -> None:
    for case in range(3):
        tokens = _randn((rng.randint(1, 11), rng.choice([1, 6, 40])), dtype, case)
        topk, experts, alignment = rng.choice([(1, 3, 4), (2, 4, 8), (3, 5, 3)])
        gen = torch.Generator().manual_seed(case)
        idx = torch.randint(0, experts, (tokens.shape[0], topk), generator=gen)
        ours = launcher("permute_tokens_aligned")(tokens, idx, experts, alignment)
        ref = REF("permute_tokens_aligned")(tokens, idx, experts, alignment)
        for a, b in zip(ours, ref, strict=True):
            assert torch.equal(a, b)
        probs = torch.rand(tokens.shape[0], topk, generator=gen)
        for weights in (None, probs):
            out = launcher("combine_tokens")(ref[0], ref[1], weights, topk)
            expected = REF("combine_tokens")(ref[0], ref[1], weights, topk)
            tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {}
            torch.testing.assert_close(out, expected, **tol)
