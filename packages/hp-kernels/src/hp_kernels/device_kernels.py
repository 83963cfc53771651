"""Device-kernel dispatch for the ``hp_kernels`` ops.

Every op is a ``torch.library`` custom op whose default kernel is the pure-torch reference
(registered under ``CompositeExplicitAutograd``): it runs on any device (CPU, GPUs, Ascend NPUs,
meta). A kernel registered for a device type's own dispatch key replaces it for tensors of that
device, whoever registers it: this package's shipped kernels, :func:`register_device_kernel`, or
a plain ``torch.library.register_kernel`` call. Eager calls, ``torch.ops.hp_kernels.*`` and
``torch.compile`` all follow the dispatcher's table, read live on every call.

Shipped device kernels, registered at import when their runtime is importable (never imported
before a kernel runs):

- ``cuda``: Triton kernels (:mod:`hp_kernels.triton_kernels`) when ``triton`` is installed;
  verified against the reference under ``TRITON_INTERPRET=1`` on CPU tensors.
- ``privateuseone`` (Ascend): ``torch_npu`` fused ops (:mod:`hp_kernels.npu_kernels`) when
  ``torch_npu`` is installed.

:func:`shipped_device_kernels` reports what is registered at run time, from the dispatcher.
Out-of-tree accelerators register under PyTorch's generic ``"privateuseone"`` device type (the
dispatch slot ``torch_npu`` renames), which is valid with or without the plugin installed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hp_kernels._library import REFERENCE_KERNELS, SHIPPED, dispatch_key_of, qualname
from hp_kernels._torch_compat import dispatch_has_kernel_for_dispatch_key

__all__ = [
    "OP_NAMES",
    "has_device_kernel",
    "reference_kernel",
    "register_device_kernel",
    "shipped_device_kernels",
]

#: Names of the custom ops in the ``hp_kernels`` namespace (``torch.ops.hp_kernels.<name>``).
OP_NAMES: tuple[str, ...] = (
    "all_gather_copy_in",
    "all_gather_copy_out",
    "reduce_scatter_copy_in",
    "reduce_scatter_copy_in_out",
    "post_reduce",
    "post_reduce_accumulate",
    "post_reduce_inplace",
    "permute_tokens",
    "unpermute_tokens",
    "merge_attention_partials",
    "permute_tokens_aligned",
    "combine_tokens",
    "mega_moe",
    "mega_moe_grad",
)


def register_shipped_kernels() -> None:
    """Register this package's device kernels whose runtime is installed (called at import)."""
    from hp_kernels import npu_kernels, triton_kernels

    triton_kernels.register(SHIPPED)
    npu_kernels.register(SHIPPED)


def _check_op(op_name: str) -> str:
    if op_name not in OP_NAMES:
        raise ValueError(f"unknown hp_kernels op {op_name!r}; expected one of {list(OP_NAMES)}")
    return qualname(op_name)


def _dispatch_key(device_type: str) -> str:
    if not isinstance(device_type, str) or not device_type:
        raise TypeError(f"device_type must be a non-empty str, got {device_type!r}")
    try:
        return dispatch_key_of(device_type)
    except RuntimeError as err:
        raise ValueError(f"unknown device type {device_type!r}: {err}") from err


def register_device_kernel(
    op_name: str,
    device_types: str | Sequence[str],
    fn: Callable[..., Any],
    *,
    lib: torch.library.Library | None = None,
) -> None:
    """Register a device-specific kernel for one of the ``hp_kernels`` ops.

    The kernel must have the op's exact signature and semantics (the reference kernel is the
    oracle). Registration is process-wide (``torch.library`` state), like any
    ``torch.library.register_kernel`` call; registering again for the same device replaces it.
    Register through this function rather than ``torch.library.register_kernel`` directly: eager
    calls skip the dispatcher when no device kernel is known for the device, and this function
    keeps that record current.

    Args:
        op_name: One of :data:`OP_NAMES`.
        device_types: Device type(s) such as ``"cpu"`` or ``"privateuseone"``.
        fn: The kernel.
        lib: Keyword-only extension: the ``torch.library.Library`` that owns the registration
            (as in ``torch.library.register_kernel``); destroying it removes the kernel.

    Raises:
        ValueError: If ``op_name`` is unknown or a device type is invalid.
        TypeError: If ``fn`` is not callable or a device type is not a string.

    Example:
        >>> from hp_kernels import register_device_kernel
        >>> def my_kernel(reduced, divide_factor, scale, out_dtype): ...
        >>> register_device_kernel("post_reduce", "privateuseone", my_kernel)  # doctest: +SKIP

    See Also:
        :pt:`torch.library.register_kernel`: the PyTorch API used.
    """
    name = _check_op(op_name)
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    types = [device_types] if isinstance(device_types, str) else list(device_types)
    for device_type in types:
        _dispatch_key(device_type)
    torch.library.register_kernel(name, types, fn, lib=lib)


def has_device_kernel(op_name: str, device_type: str) -> bool:
    """Return whether an op has a kernel registered specifically for ``device_type``.

    Args:
        op_name: One of :data:`OP_NAMES`.
        device_type: A device type such as ``"cpu"`` or ``"privateuseone"``.

    Returns:
        True if a device-specific kernel (not the reference default) is registered.

    Raises:
        ValueError: If ``op_name`` or ``device_type`` is unknown.

    See Also:
        :pt:`torch.library.get_kernel`: PyTorch's kernel lookup.
    """
    name = _check_op(op_name)
    return bool(dispatch_has_kernel_for_dispatch_key(name, _dispatch_key(device_type)))


def reference_kernel(op_name: str) -> Callable[..., Any]:
    """Return the pure-torch reference kernel of an op.

    A device kernel can delegate the cases it does not specialise (a dtype, a layout) to it, and
    device tests use it as the oracle.

    Args:
        op_name: One of :data:`OP_NAMES`.

    Returns:
        The reference function, with the op's signature.

    Raises:
        ValueError: If ``op_name`` is unknown.

    See Also:
        :pt:`torch.library.get_kernel`: PyTorch's lookup of a registered kernel.
    """
    _check_op(op_name)
    return REFERENCE_KERNELS[op_name]


def shipped_device_kernels() -> dict[str, tuple[str, ...]]:
    """Device kernels this package registered and the dispatcher still holds, per op.

    Computed at call time: the (op, device type) pairs this package's kernel modules registered
    at import (CUDA when ``triton`` is installed, ``privateuseone`` when ``torch_npu`` is), kept
    only where the dispatcher's table still has a kernel for that device's key. The reference
    kernel serves every other device.

    Returns:
        A mapping from every op name in :data:`OP_NAMES` to the sorted device types with a
        shipped specialised kernel (empty when the op has none in this environment).

    Example:
        >>> from hp_kernels import shipped_device_kernels
        >>> from hp_kernels import OP_NAMES
        >>> sorted(shipped_device_kernels()) == sorted(OP_NAMES)
        True

    See Also:
        :pt:`torch.library.register_kernel`: how the kernels are registered.
    """
    result: dict[str, tuple[str, ...]] = {}
    for op_name in OP_NAMES:
        live = [
            device_type
            for device_type in SHIPPED.device_types(op_name)
            if has_device_kernel(op_name, device_type)
        ]
        result[op_name] = tuple(sorted(live))
    return result
