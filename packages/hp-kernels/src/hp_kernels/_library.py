"""Private op-definition helpers shared by the op modules: namespace, dispatch names, ``Op``.

hp-kernels depends only on torch, so it does not import ``hp_dtensor.device``. The only
dispatch name it needs is PyTorch's generic out-of-tree backend slot, ``"privateuseone"``,
which is where Ascend's ``torch_npu`` (and any other PrivateUse1 backend) registers itself.
Registering under this generic name is import-safe on every build of torch: the backend-specific
name only exists once the plugin has renamed the slot.

Ops are defined with ``torch.library.Library.define`` and their reference kernel registered under
``CompositeExplicitAutograd`` (every device, including meta), rather than with
``torch.library.custom_op``: the latter adds roughly 50-100 us of Python work per eager call for
mutating ops on this machine, which is more than the copies themselves cost. Fake kernels and
autograd go through the public ``torch.library.register_fake`` / ``register_autograd``, device
kernels through ``torch.library.register_kernel`` (a backend key takes precedence over the
composite reference).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__: list[str] = []

#: ``torch.library`` namespace of every op in this package (``torch.ops.hp_kernels.*``).
NAMESPACE = "hp_kernels"

#: PyTorch's device type for the PrivateUse1 dispatch key (out-of-tree accelerators).
PRIVATEUSE1_DEVICE_TYPE = "privateuseone"

#: The library object that owns the ``hp_kernels`` namespace (kept alive for the process).
LIB = torch.library.Library(NAMESPACE, "DEF")  # type: ignore[no-untyped-call]

#: The pure-torch reference kernel of every op, by op name (filled at import by ``define_op``).
REFERENCE_KERNELS: dict[str, Callable[..., Any]] = {}


def qualname(name: str) -> str:
    """Return the fully qualified op name ``hp_kernels::<name>``."""
    return f"{NAMESPACE}::{name}"


def module_available(name: str) -> bool:
    """Return whether ``name`` is importable, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


class Op:
    """Handle of one ``hp_kernels`` op: call it, and register its fake and autograd kernels."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.qualname = qualname(name)
        self.overload: torch._ops.OpOverload = getattr(torch.ops.hp_kernels, name).default

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
        LIB.impl(name, fn, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
        REFERENCE_KERNELS[name] = fn
        return Op(name)

    return wrap


def needs_autograd(*tensors: torch.Tensor | None) -> bool:
    """Whether a call must go through the op's autograd kernel (or is being compiled)."""
    if torch.compiler.is_compiling():
        return True
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in tensors)


def call_below_autograd(op: Op, *args: Any) -> Any:
    """Call ``op`` skipping its autograd kernel (valid when no input requires grad).

    The autograd kernel would only redispatch below itself in that case; skipping it saves the
    Python ``autograd.Function`` set-up on every eager call.
    """
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)
