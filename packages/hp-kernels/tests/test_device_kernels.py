"""Device-kernel dispatch: what ships, registration for the PrivateUse1 slot, error messages."""

from __future__ import annotations

import pytest
import torch

import hp_kernels as hk


def test_every_op_exists_and_only_reference_kernels_ship() -> None:
    shipped = hk.shipped_device_kernels()
    assert set(shipped) == set(hk.OP_NAMES)
    for name in hk.OP_NAMES:
        assert hasattr(torch.ops.hp_kernels, name), name
        assert shipped[name] == ()
        # The reference is the default kernel: no device-specific registration anywhere.
        assert not hk.has_device_kernel(name, "cpu")
    # Namespace is ours, not torch's ``fsdp``: both stacks import together.
    assert str(torch.ops.hp_kernels.all_gather_copy_in.default._schema).startswith("hp_kernels::")


_CALLS: list[tuple[int, ...]] = []


def _spy_unpermute(permuted_tokens, sorted_indices, probs, topk):  # type: ignore[no-untyped-def]
    _CALLS.append(tuple(permuted_tokens.shape))
    return hk.reference_kernel("unpermute_tokens")(permuted_tokens, sorted_indices, probs, topk)


def test_register_device_kernel_targets_the_dispatch_key() -> None:
    assert set(hk.OP_NAMES) <= {n for n in dir(torch.ops.hp_kernels) if not n.startswith("_")}
    # PrivateUse1 (Ascend's slot) is valid without torch_npu installed.
    assert not hk.has_device_kernel("merge_attention_partials", "privateuseone")
    hk.register_device_kernel(
        "merge_attention_partials", "privateuseone", hk.reference_kernel("merge_attention_partials")
    )
    assert hk.has_device_kernel("merge_attention_partials", "privateuseone")
    assert not hk.has_device_kernel("merge_attention_partials", "cpu")
    # A kernel registered for a device is what the dispatcher runs for that device's tensors.
    # (Registration is process-wide, so the spy delegates to the reference and changes nothing.)
    hk.register_device_kernel("unpermute_tokens", ["cpu"], _spy_unpermute)
    assert hk.has_device_kernel("unpermute_tokens", "cpu")
    p, idx, _ = hk.permute_tokens(torch.randn(3, 2), torch.tensor([1, 0, 1]), 2)
    before = len(_CALLS)
    assert torch.equal(hk.unpermute_tokens(p, idx), p[torch.argsort(idx)])
    assert _CALLS[before:] == [(3, 2)]


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
