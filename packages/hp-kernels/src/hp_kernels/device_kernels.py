"""Device-kernel dispatch for the ``hp_kernels`` ops.

Every op is a ``torch.library`` custom op whose default kernel is the pure-torch reference: it
runs on any device (CPU, GPUs, Ascend NPUs through ``torch_npu``, meta). A device-specific kernel
replaces it for one device type through :func:`register_device_kernel`, which goes through
``torch.library.register_kernel``; the dispatcher then picks it for tensors of that device and
the reference keeps serving every other device.

What ships in 0.1.0: the reference kernels only. Triton (``cuda``) and ``torch_npu``
(``privateuseone``) kernels are not shipped, because a device kernel is only accepted with parity
evidence from the hardware (or, for Triton, the ``TRITON_INTERPRET=1`` interpreter) and none was
available when this release was built; :func:`shipped_device_kernels` reports this at run time.
Out-of-tree accelerators register under PyTorch's generic ``"privateuseone"`` device type (the
dispatch slot ``torch_npu`` renames), which is valid with or without the plugin installed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hp_kernels._dispatch_keys import PRIVATEUSE1_DEVICE_TYPE, PRIVATEUSE1_DISPATCH_KEY
from hp_kernels._library import REFERENCE_KERNELS, forget_registrations, qualname

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
)


def _check_op(op_name: str) -> str:
    if op_name not in OP_NAMES:
        raise ValueError(f"unknown hp_kernels op {op_name!r}; expected one of {list(OP_NAMES)}")
    return qualname(op_name)


def _dispatch_key(device_type: str) -> str:
    if not isinstance(device_type, str) or not device_type:
        raise TypeError(f"device_type must be a non-empty str, got {device_type!r}")
    if device_type == PRIVATEUSE1_DEVICE_TYPE:
        return PRIVATEUSE1_DISPATCH_KEY
    try:
        return str(torch._C._dispatch_key_for_device(device_type))
    except RuntimeError as err:
        raise ValueError(f"unknown device type {device_type!r}: {err}") from err


def register_device_kernel(
    op_name: str, device_types: str | Sequence[str], fn: Callable[..., Any]
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

    Raises:
        ValueError: If ``op_name`` is unknown or a device type is invalid.
        TypeError: If ``fn`` is not callable or a device type is not a string.

    Example:
        >>> from hp_kernels import register_device_kernel
        >>> def my_kernel(reduced, divide_factor, scale, out_dtype): ...
        >>> register_device_kernel("post_reduce", "privateuseone", my_kernel)  # doctest: +SKIP

    See Also:
        ``torch.library.register_kernel``: the PyTorch API used.
    """
    name = _check_op(op_name)
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    types = [device_types] if isinstance(device_types, str) else list(device_types)
    for device_type in types:
        _dispatch_key(device_type)
    torch.library.register_kernel(name, types, fn)
    forget_registrations()


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
        ``torch.library.get_kernel``: PyTorch's kernel lookup.
    """
    name = _check_op(op_name)
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(name, _dispatch_key(device_type)))


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
        ``torch.library.get_kernel``: PyTorch's lookup of a registered kernel.
    """
    _check_op(op_name)
    return REFERENCE_KERNELS[op_name]


def shipped_device_kernels() -> dict[str, tuple[str, ...]]:
    """Device kernels this release ships, per op (the reference serves every other device).

    Returns:
        A mapping from op name to the device types with a shipped specialised kernel. In 0.1.0
        every entry is empty: no Triton or ``torch_npu`` kernel passed a hardware parity check
        yet, so none is registered.

    Example:
        >>> from hp_kernels import shipped_device_kernels
        >>> shipped_device_kernels()["post_reduce"]
        ()

    See Also:
        ``torch.library.custom_op``: the reference kernels are the ops' default implementation.
    """
    return {name: () for name in OP_NAMES}
