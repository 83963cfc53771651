"""Shipped device kernels: registration from installed runtimes, import safety, NPU glue."""

from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import hp_kernels as hk
from hp_kernels import npu_kernels, triton_kernels
from hp_kernels._library import SHIPPED, ShippedKernels


def test_kernels_are_registered_exactly_where_their_runtime_is_installed() -> None:
    shipped = hk.shipped_device_kernels()
    for name in hk.OP_NAMES:
        expected = set()
        if triton_kernels.triton_available():
            expected.add("cuda")  # every op has a Triton kernel
        if npu_kernels.torch_npu_available() and name in npu_kernels.NPU_KERNELS:
            expected.add("privateuseone")
        assert set(SHIPPED.device_types(name)) == expected, name
        assert set(shipped[name]) == expected, name


def test_importing_the_package_imports_neither_triton_nor_torch_npu() -> None:
    code = (
        "import sys, hp_kernels\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "assert 'torch_npu' not in sys.modules, 'torch_npu imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.fixture
def scoped() -> Iterator[ShippedKernels]:
    lib = torch.library.Library("hp_kernels", "FRAGMENT")  # type: ignore[no-untyped-call]
    try:
        yield ShippedKernels(lib)
    finally:
        lib._destroy()


def test_register_skips_missing_runtimes(
    scoped: ShippedKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(triton_kernels, "triton_available", lambda: False)
    monkeypatch.setattr(npu_kernels, "torch_npu_available", lambda: False)
    triton_kernels.register(scoped)
    npu_kernels.register(scoped)
    assert all(scoped.device_types(name) == () for name in hk.OP_NAMES)


def _stand_in_torch_npu() -> types.ModuleType:
    """torch_npu's two MoE ops as documented (stable sort; index_copy + weighted sum)."""
    module = types.ModuleType("torch_npu")

    def npu_moe_token_permute(tokens: torch.Tensor, indices: torch.Tensor) -> Any:
        topk = 1 if indices.dim() == 1 else indices.shape[1]
        order = torch.argsort(indices.reshape(-1), stable=True)
        return tokens.index_select(0, order // topk), order.to(torch.int32)

    def npu_moe_token_unpermute(
        permuted: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor | None = None
    ) -> torch.Tensor:
        topk = 1 if probs is None else probs.shape[1]
        rows = torch.zeros_like(permuted).index_copy_(0, sorted_indices.long(), permuted)
        rows = rows.view(-1, topk, permuted.shape[-1])
        if probs is not None:
            rows = rows * probs.unsqueeze(-1)
        return rows.sum(1)

    module.npu_moe_token_permute = npu_moe_token_permute  # type: ignore[attr-defined]
    module.npu_moe_token_unpermute = npu_moe_token_unpermute  # type: ignore[attr-defined]
    return module


def test_npu_kernels_map_the_op_contract_onto_torch_npu(
    scoped: ShippedKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The glue (argument order, dtypes, counts, fallbacks) against a documented stand-in."""
    monkeypatch.setitem(sys.modules, "torch_npu", _stand_in_torch_npu())
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randn(9, 6, generator=gen)
    idx = torch.randint(0, 4, (9, 2), generator=gen)
    probs = torch.rand(9, 2, generator=gen)
    ours = npu_kernels.permute_tokens(tokens, idx, 4)
    ref = hk.reference_kernel("permute_tokens")(tokens, idx, 4)
    for a, b in zip(ours, ref, strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)
    torch.testing.assert_close(
        npu_kernels.unpermute_tokens(ref[0], ref[1], probs, 2),
        hk.reference_kernel("unpermute_tokens")(ref[0], ref[1], probs, 2),
    )
    # Unweighted top-2 is outside the fused op's contract: the reference serves it.
    torch.testing.assert_close(
        npu_kernels.unpermute_tokens(ref[0], ref[1], None, 2),
        hk.reference_kernel("unpermute_tokens")(ref[0], ref[1], None, 2),
    )
    monkeypatch.setattr(npu_kernels, "torch_npu_available", lambda: True)
    npu_kernels.register(scoped)
    assert scoped.device_types("permute_tokens") == ("privateuseone",)
    assert hk.has_device_kernel("permute_tokens", "privateuseone")


@pytest.mark.npu
def test_npu_kernels_on_an_npu() -> None:
    torch_npu = pytest.importorskip("torch_npu")
    if not torch_npu.npu.is_available():
        pytest.skip("no Ascend NPU visible")
    device = torch.device(torch_npu.npu.current_device())
    tokens = torch.randn(16, 32)
    idx = torch.randint(0, 4, (16, 2))
    probs = torch.rand(16, 2)
    ref = hk.reference_kernel("permute_tokens")(tokens, idx, 4)
    ours = hk.permute_tokens(tokens.to(device), idx.to(device), 4)
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a.cpu(), b)
    combined = hk.unpermute_tokens(ours[0], ours[1], probs.to(device))
    torch.testing.assert_close(
        combined.cpu(), hk.reference_kernel("unpermute_tokens")(ref[0], ref[1], probs, 2)
    )
