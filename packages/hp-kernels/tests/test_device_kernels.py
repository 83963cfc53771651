"""Device-kernel dispatch: what ships, registration for the PrivateUse1 slot, error messages."""

from __future__ import annotations

import pytest
import torch

import hp_kernels as hk


def test_shipped_kernels_are_what_the_dispatcher_holds() -> None:
    from hp_kernels._library import SHIPPED

    shipped = hk.shipped_device_kernels()
    assert set(shipped) == set(hk.OP_NAMES)
    for name in hk.OP_NAMES:
        assert hasattr(torch.ops.hp_kernels, name), name
        expected = tuple(d for d in SHIPPED.device_types(name) if hk.has_device_kernel(name, d))
        assert shipped[name] == expected
        # No shipped kernel replaces the reference on the CPU.
        assert "cpu" not in shipped[name]
    # Namespace is ours, not torch's ``fsdp``: both stacks import together.
    assert str(torch.ops.hp_kernels.all_gather_copy_in.default._schema).startswith("hp_kernels::")


def test_shipped_kernels_follow_registrations() -> None:
    """A registration recorded as shipped shows up, and disappears with its library."""
    from hp_kernels._library import SHIPPED

    name = "post_reduce_inplace"
    before = hk.shipped_device_kernels()[name]
    assert PU1 not in before
    lib = torch.library.Library("hp_kernels", "FRAGMENT")  # type: ignore[no-untyped-call]
    try:
        hk.register_device_kernel(name, PU1, hk.reference_kernel(name), lib=lib)
        SHIPPED._device_types.setdefault(name, set()).add(PU1)
        assert PU1 in hk.shipped_device_kernels()[name]
    finally:
        lib._destroy()
    # The record alone does not make a kernel "shipped": the dispatcher no longer has it.
    assert hk.shipped_device_kernels()[name] == before
    SHIPPED._device_types[name].discard(PU1)


PU1 = "privateuseone"


def _merge_args() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(3)
    return (
        torch.randn(2, 5, 4, generator=gen),
        torch.randn(2, 5, generator=gen),
        torch.randn(2, 5, 4, generator=gen),
        torch.randn(2, 5, generator=gen),
    )


def test_kernel_registered_with_torch_library_is_honoured_in_eager_ops_and_compile() -> None:
    """One dispatch path: a plain ``torch.library.register_kernel`` wins everywhere."""
    args = _merge_args()
    reference = hk.reference_kernel("merge_attention_partials")
    expected_out, expected_lse = reference(*args)
    calls: list[int] = []

    def doubled(oa, la, ob, lb):  # type: ignore[no-untyped-def]
        calls.append(1)
        out, lse = reference(oa, la, ob, lb)
        return out * 2, lse

    compiled = torch.compile(hk.merge_attention_partials, fullgraph=True, backend="aot_eager")
    lib = torch.library.Library("hp_kernels", "FRAGMENT")  # type: ignore[no-untyped-call]
    try:
        torch.library.register_kernel(
            "hp_kernels::merge_attention_partials", "cpu", doubled, lib=lib
        )
        assert hk.has_device_kernel("merge_attention_partials", "cpu")
        eager = hk.merge_attention_partials(*args)
        via_ops = torch.ops.hp_kernels.merge_attention_partials(*args)
        via_compile = compiled(*args)
        for out, lse in (eager, via_ops, via_compile):
            torch.testing.assert_close(out, 2 * expected_out, rtol=0, atol=0)
            torch.testing.assert_close(lse, expected_lse, rtol=0, atol=0)
        assert len(calls) == 3
    finally:
        lib._destroy()
    # Deregistered: every path is back on the reference, with no stale record.
    assert not hk.has_device_kernel("merge_attention_partials", "cpu")
    out, _ = hk.merge_attention_partials(*args)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    assert len(calls) == 3


def test_fast_path_check_agrees_with_the_dispatcher_table() -> None:
    """The eager shortcut's live check and the C++ dispatcher agree through (de)registration."""
    from hp_kernels._library import OPS

    def agree(name: str, device_type: str) -> bool:
        live = OPS[name].has_backend_kernel(device_type)
        return live == hk.has_device_kernel(name, device_type)

    names = ["post_reduce", "all_gather_copy_out"]
    assert all(agree(n, d) for n in names for d in ("cpu", PU1))
    lib = torch.library.Library("hp_kernels", "FRAGMENT")  # type: ignore[no-untyped-call]
    try:
        torch.library.register_kernel(
            "hp_kernels::post_reduce", "cpu", hk.reference_kernel("post_reduce"), lib=lib
        )
        lib.impl("all_gather_copy_out", hk.reference_kernel("all_gather_copy_out"), "PrivateUse1")
        assert OPS["post_reduce"].has_backend_kernel("cpu")
        assert OPS["all_gather_copy_out"].has_backend_kernel(PU1)
        assert all(agree(n, d) for n in names for d in ("cpu", PU1))
    finally:
        lib._destroy()
    assert not OPS["post_reduce"].has_backend_kernel("cpu")
    assert all(agree(n, d) for n in names for d in ("cpu", PU1))


_CALLS: list[tuple[int, ...]] = []


def _spy_unpermute(permuted_tokens, sorted_indices, probs, topk):  # type: ignore[no-untyped-def]
    _CALLS.append(tuple(permuted_tokens.shape))
    return hk.reference_kernel("unpermute_tokens")(permuted_tokens, sorted_indices, probs, topk)


def test_register_device_kernel_targets_the_dispatch_key() -> None:
    # PrivateUse1 (Ascend's slot) is valid without torch_npu installed.
    lib = torch.library.Library("hp_kernels", "FRAGMENT")  # type: ignore[no-untyped-call]
    try:
        assert not hk.has_device_kernel("merge_attention_partials", PU1)
        hk.register_device_kernel(
            "merge_attention_partials",
            PU1,
            hk.reference_kernel("merge_attention_partials"),
            lib=lib,
        )
        assert hk.has_device_kernel("merge_attention_partials", PU1)
        assert not hk.has_device_kernel("merge_attention_partials", "cpu")
        # A kernel registered for a device is what the dispatcher runs for its tensors.
        hk.register_device_kernel("unpermute_tokens", ["cpu"], _spy_unpermute, lib=lib)
        assert hk.has_device_kernel("unpermute_tokens", "cpu")
        p, idx, _ = hk.permute_tokens(torch.randn(3, 2), torch.tensor([1, 0, 1]), 2)
        before = len(_CALLS)
        assert torch.equal(hk.unpermute_tokens(p, idx), p[torch.argsort(idx)])
        assert _CALLS[before:] == [(3, 2)]
    finally:
        lib._destroy()
    assert not hk.has_device_kernel("unpermute_tokens", "cpu")
    assert not hk.has_device_kernel("merge_attention_partials", PU1)


def test_register_device_kernel_errors() -> None:
    with pytest.raises(ValueError, match="unknown hp_kernels op"):
        hk.register_device_kernel("rms_norm", "cpu", lambda x: x)
    with pytest.raises(TypeError, match="callable"):
        hk.register_device_kernel("post_reduce", "cpu", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown device type"):
        hk.has_device_kernel("post_reduce", "not_a_device")
    with pytest.raises(TypeError, match="device_type"):
        hk.has_device_kernel("post_reduce", "")


def test_eager_fast_path_only_where_the_dispatcher_would_run_the_reference() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hp_kernels._library import can_call_reference
    from hp_kernels.attention import _merge_op

    x = torch.ones(2)
    assert can_call_reference(_merge_op, [x])
    assert not can_call_reference(_merge_op, [torch.empty(2, device="meta")])
    with FakeTensorMode():
        assert not can_call_reference(_merge_op, [x])
    # Both paths give the same result.
    g = [torch.randn(5, 4), torch.randn(2, 6)]
    direct = torch.ops.hp_kernels.reduce_scatter_copy_in.default(g, [0, 1], 3, torch.bfloat16, 2.0)
    wrapped = hk.reduce_scatter_copy_in(g, [0, 1], 3, torch.bfloat16, predivide_factor=2.0)
    assert torch.equal(direct, wrapped)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = hk.reduce_scatter_copy_in(
            [mode.from_tensor(t) for t in g], [0, 1], 3, torch.bfloat16, predivide_factor=2.0
        )
        assert fake.shape == direct.shape
