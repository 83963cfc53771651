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
