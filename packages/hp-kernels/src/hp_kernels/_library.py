"""Private op-definition helpers shared by the op modules: namespace, dispatch names, ``Op``.

Device-type and dispatch-key names come from :mod:`hp_kernels._dispatch_keys`.

Ops are defined with ``torch.library.Library.define`` and their reference kernel registered under
``CompositeExplicitAutograd`` (every device, including meta), rather than with
``torch.library.custom_op``: for mutating ops the latter measured about 120 us of Python work
per eager call against about 15 us here (a loaded 2-core machine), more than the copies
themselves. Fake kernels and autograd go through the public ``torch.library.register_fake`` /
``register_autograd``, device kernels through ``torch.library.register_kernel`` (a backend key
takes precedence over the composite reference).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from hp_kernels._dispatch_keys import (
    META_DEVICE_TYPE,
    PRIVATEUSE1_DEVICE_TYPE,
    PRIVATEUSE1_DISPATCH_KEY,
    REFERENCE_DISPATCH_KEY,
)
from hp_kernels._torch_compat import (
    AutoDispatchBelowAutograd,
    OpOverload,
    dispatch_key_for_device,
    len_torch_dispatch_stack,
    python_impls,
)

__all__: list[str] = []

#: ``torch.library`` namespace of every op in this package (``torch.ops.hp_kernels.*``).
NAMESPACE = "hp_kernels"

#: The library object that owns the ``hp_kernels`` namespace (kept alive for the process).
LIB = torch.library.Library(NAMESPACE, "DEF")  # type: ignore[no-untyped-call]

#: The pure-torch reference kernel of every op, by op name (filled at import by ``define_op``).
REFERENCE_KERNELS: dict[str, Callable[..., Any]] = {}

#: Every op handle, by op name (filled at import by ``define_op``).
OPS: dict[str, Op] = {}


class ShippedKernels:
    """The device kernels this package registers itself (Triton for CUDA, ``torch_npu``)."""

    def __init__(self, lib: torch.library.Library) -> None:
        self.lib = lib
        self._device_types: dict[str, set[str]] = {}

    def register(self, op_name: str, device_type: str, fn: Callable[..., Any]) -> None:
        """Register ``fn`` as ``op_name``'s kernel for ``device_type`` and remember it."""
        torch.library.register_kernel(qualname(op_name), device_type, fn, lib=self.lib)
        self._device_types.setdefault(op_name, set()).add(device_type)

    def device_types(self, op_name: str) -> tuple[str, ...]:
        """Device types this package registered a kernel for (the dispatcher may differ)."""
        return tuple(sorted(self._device_types.get(op_name, ())))


#: Record of the kernels registered by :mod:`hp_kernels.triton_kernels` / ``npu_kernels``.
SHIPPED = ShippedKernels(LIB)


def qualname(name: str) -> str:
    """Return the fully qualified op name ``hp_kernels::<name>``."""
    return f"{NAMESPACE}::{name}"


class Op:
    """Handle of one ``hp_kernels`` op: call it, and register its fake and autograd kernels."""

    def __init__(self, name: str, reference: Callable[..., Any]) -> None:
        self.name = name
        self.qualname = qualname(name)
        self.reference = reference
        self.overload: OpOverload = getattr(torch.ops.hp_kernels, name).default
        # Registration key in torch.library's record, per device type (a pure function of
        # the two names; whether the key is registered is looked up on every call).
        self._impl_keys: dict[str, str] = {}

    def has_backend_kernel(self, device_type: str) -> bool:
        """Whether a kernel is registered for ``device_type``'s own dispatch key right now.

        Read live on every call, never remembered, so a kernel registered at any time (through
        ``torch.library.register_kernel``, ``Library.impl`` or
        :func:`hp_kernels.register_device_kernel`) is seen by the very next eager call. The
        lookup is a set membership in ``torch.library``'s record of every kernel registered
        from Python (about 0.1 us); asking the C++ dispatcher by op name measured 7-25 us per
        call between real copies, more than some of the ops. Without that record (a torch
        that renamed it) the dispatcher is asked.
        """
        key = self._impl_keys.get(device_type)
        if key is None:
            key = f"{NAMESPACE}/{self.name}/{dispatch_key_of(device_type)}"
            self._impl_keys[device_type] = key
        # Entries leave ``python_impls`` when their library is destroyed.
        return key in python_impls

    def __call__(self, *args: Any) -> Any:
        return self.overload(*args)

    def register_fake(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        torch.library.register_fake(self.qualname, fn, lib=LIB)
        return fn

    def register_autograd(
        self, backward: Callable[..., Any], *, setup_context: Callable[..., Any]
    ) -> None:
        torch.library.register_autograd(
            self.qualname, backward, setup_context=setup_context, lib=LIB
        )


def define_op(name: str, *, mutates_args: Iterable[str] = ()) -> Callable[[Callable[..., Any]], Op]:
    """Define ``hp_kernels::<name>`` with the decorated function as its reference kernel.

    The schema is inferred from the function's annotations (as ``torch.library.custom_op`` does).
    """

    def wrap(fn: Callable[..., Any]) -> Op:
        schema = torch.library.infer_schema(fn, mutates_args=tuple(mutates_args))
        LIB.define(name + schema)  # type: ignore[no-untyped-call]
        LIB.impl(name, fn, REFERENCE_DISPATCH_KEY)  # type: ignore[no-untyped-call]
        REFERENCE_KERNELS[name] = fn
        op = Op(name, fn)
        OPS[name] = op
        return op

    return wrap


def needs_autograd(*tensors: torch.Tensor | None) -> bool:
    """Whether a call must go through the op's autograd kernel (or is being compiled)."""
    if torch.compiler.is_compiling():
        return True
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in tensors)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


@functools.cache
def dispatch_key_of(device_type: str) -> str:
    """The backend dispatch key of a device type (a pure function of the string)."""
    if device_type == PRIVATEUSE1_DEVICE_TYPE:
        return PRIVATEUSE1_DISPATCH_KEY
    return str(dispatch_key_for_device(device_type))


def can_call_reference(op: Op, tensors: Iterable[torch.Tensor]) -> bool:
    """Whether the dispatcher would run the reference kernel for this eager call.

    There is one dispatch decision, the dispatcher's: this function only recognises the case
    where its answer is known to be the reference (registered under
    ``CompositeExplicitAutograd``), so the call can skip the dispatcher's round trip (1.5 us,
    and 5-13 us boxing ten-tensor lists, more than the copies on small buffers). That is: not
    tracing/compiling, no ``TorchDispatchMode`` active (fake tensors, functionalization, debug
    modes), plain tensors (no subclass such as DTensor), not on the
    meta device, and no kernel registered for the device's backend key *now* (checked live by
    :meth:`Op.has_backend_kernel`, so kernels registered with ``torch.library.register_kernel``
    at any time are honoured in eager mode exactly as through ``torch.ops`` and
    ``torch.compile``).
    """
    if torch.compiler.is_compiling() or len_torch_dispatch_stack():
        return False
    device_type = None
    for t in tensors:
        if type(t) not in _PLAIN_TYPES:
            return False
        if device_type is None:
            device_type = t.device.type
    if device_type is None or device_type == META_DEVICE_TYPE:
        return False
    return not op.has_backend_kernel(device_type)


def call(op: Op, tensors: Iterable[torch.Tensor], *args: Any) -> Any:
    """Call ``op`` without autograd: the reference directly when allowed, else the dispatcher."""
    if torch.compiler.is_compiling():
        return op(*args)
    if can_call_reference(op, tensors):
        return op.reference(*args)
    return call_below_autograd(op, *args)


def call_below_autograd(op: Op, *args: Any) -> Any:
    """Call ``op`` skipping its autograd kernel (valid when no input requires grad).

    The autograd kernel would only redispatch below itself in that case; skipping it saves the
    Python ``autograd.Function`` set-up on every eager call.
    """
    with AutoDispatchBelowAutograd():
        return op(*args)
