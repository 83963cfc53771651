"""The Triton kernels of ``mega_moe`` / ``mega_moe_grad`` under ``TRITON_INTERPRET=1``.

Part of CI's ``kernels-interpreter`` stage (marker ``triton_interpret``; a failure instead of a
skip there). Oracle: the reference kernels (themselves bitwise equal to the composed ops, see
``test_mega_moe.py``). Documented tolerance: float32 ``rtol=1e-5, atol=1e-5`` (the GEMMs sum in
another order), bfloat16 one ulp of the output's magnitude (``atol`` 2**-7 of the largest
value: the row gradient adds the gate and up products before rounding, the reference after).
Shapes are uneven on purpose: widths not multiples of the blocks, an expert with no rows.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hp_kernels as hk
from hp_dtensor.testing import count_host_syncs

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

from hp_kernels.triton_kernels import LazyLauncher, launcher  # noqa: E402

REF = hk.reference_kernel


def make(seed: int, dtype: torch.dtype, tokens: int = 9, topk: int = 2) -> tuple[torch.Tensor, ...]:
    experts, dim, hidden = 4, 20, 36  # not multiples of the 16-wide interpreter blocks
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=gen).to(dtype)
    idx = torch.randint(0, experts, (tokens, topk), generator=gen)
    idx = torch.where(idx == 2, 0, idx)  # expert 2: no rows
    probs = torch.rand(tokens, topk, generator=gen).to(dtype)
    w1 = (torch.randn(experts, hidden, dim, generator=gen) * 0.3).to(dtype)
    w2 = (torch.randn(experts, dim, hidden, generator=gen) * 0.3).to(dtype)
    w3 = (torch.randn(experts, hidden, dim, generator=gen) * 0.3).to(dtype)
    return x, idx, probs, w1, w2, w3


def assert_near(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == ref.dtype
    assert ours.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    else:
        scale = float(ref.float().abs().max()) if ref.numel() else 0.0
        torch.testing.assert_close(ours.float(), ref.float(), rtol=0, atol=2**-7 * max(scale, 1))


CASES = [
    (torch.float32, "weighted"),
    (torch.float32, "score_before_experts"),
    (torch.bfloat16, "unweighted"),
]


@pytest.mark.parametrize(("dtype", "mode"), CASES)
def test_forward_and_backward_match_the_reference(dtype: torch.dtype, mode: str) -> None:
    x, idx, probs, w1, w2, w3 = make(0, dtype)
    sbe = mode == "score_before_experts"
    p = None if mode == "unweighted" else probs
    ours = launcher("mega_moe")(x, idx, p, w1, w2, w3, sbe)
    ref = REF("mega_moe")(x, idx, p, w1, w2, w3, sbe)
    assert torch.equal(ours[1], ref[1])  # sorted_indices
    assert torch.equal(ours[2], ref[2])  # counts
    for a, b in zip(ours[:1] + ours[3:], ref[:1] + ref[3:], strict=True):
        assert_near(a, b)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    saved = ref[1:]
    ours_g = launcher("mega_moe_grad")(g, x, idx, p, w1, w2, w3, *saved, sbe)
    ref_g = REF("mega_moe_grad")(g, x, idx, p, w1, w2, w3, *saved, sbe)
    for a, b in zip(ours_g, ref_g, strict=True):
        assert_near(a, b)
    assert torch.count_nonzero(ours_g[2][2]) == 0  # expert 2 had no rows


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor):
                self.calls.append((str(func.overloadpacket.__name__), tuple(t.shape)))
        return out


def test_no_permuted_copy_of_the_tokens_and_no_host_sync() -> None:
    """The reference gathers a [T k, dim] copy of x (index_select); the kernels load rows by
    index instead: no torch op of the Triton forward or backward makes a [T k, dim] gather."""
    x, idx, probs, w1, w2, w3 = make(1, torch.float32)
    rows = idx.numel()
    with _OpLog() as ref_log:
        ref = REF("mega_moe")(x, idx, probs, w1, w2, w3, False)
    assert ("index_select", (rows, x.shape[1])) in ref_log.calls
    with count_host_syncs() as syncs, _OpLog() as log:
        ours = launcher("mega_moe")(x, idx, probs, w1, w2, w3, False)
        launcher("mega_moe_grad")(torch.ones_like(x), x, idx, probs, w1, w2, w3, *ours[1:], False)
    syncs.assert_at_most(0, what="Triton mega_moe forward + backward")
    gathers = [c for c in log.calls if c[0] in ("index_select", "index", "gather")]
    assert gathers == [], gathers
    assert_near(ours[0], ref[0])


@pytest.fixture
def cpu_registration() -> Iterator[list[str]]:
    """The CUDA registration's callables, registered for CPU: the public op runs them."""
    calls: list[str] = []

    class Spy(LazyLauncher):
        def __call__(self, *args: Any) -> Any:
            calls.append(self.op_name)
            return super().__call__(*args)

    lib = torch.library.Library("hp_kernels", "FRAGMENT")  # type: ignore[no-untyped-call]
    try:
        for name in ("mega_moe", "mega_moe_grad"):
            hk.register_device_kernel(name, "cpu", Spy(name), lib=lib)
        yield calls
    finally:
        lib._destroy()


def test_public_op_and_autograd_run_the_registered_kernels(cpu_registration: list[str]) -> None:
    x, idx, probs, w1, w2, w3 = make(2, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (x, probs, w1, w2, w3)]
    out = hk.mega_moe(leaves[0], idx, leaves[1], *leaves[2:])
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert cpu_registration == ["mega_moe", "mega_moe_grad"]
    ref = REF("mega_moe")(x, idx, probs, w1, w2, w3, False)
    ref_g = REF("mega_moe_grad")(torch.ones_like(x), x, idx, probs, w1, w2, w3, *ref[1:], False)
    assert_near(out.detach(), ref[0])
    for a, b in zip(grads, ref_g, strict=True):
        assert_near(a, b)
