"""Mixed-precision and offload policies of ``fully_shard`` (same fields and defaults as torch's).

PyTorch's own policy instances (``torch.distributed.fsdp.MixedPrecisionPolicy``,
``OffloadPolicy``, ``CPUOffloadPolicy``) are accepted wherever ours are: :func:`to_mp_policy` and
:func:`to_offload_policy` convert them field by field.

See Also:
    :pt:`torch.distributed.fsdp.MixedPrecisionPolicy`: PyTorch's FSDP2 policies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.fsdp as _torch_fsdp  # interop: accept torch's policy objects

#: torch's policy classes, taken at import: ``hp_fsdp.integrations.use_hp_fsdp`` rebinds these
#: names in ``torch.distributed.fsdp`` to ours, and a torch policy made before that still converts.
_TORCH_POLICY_CLASSES: tuple[type, type, type] = (
    _torch_fsdp.MixedPrecisionPolicy,
    _torch_fsdp.OffloadPolicy,
    _torch_fsdp.CPUOffloadPolicy,
)

__all__ = [
    "CPUOffloadPolicy",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "to_mp_policy",
    "to_offload_policy",
]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Which dtypes a ``fully_shard`` unit computes, reduces and returns in.

    Args:
        param_dtype: dtype of the unsharded parameters used in forward and backward (the
            sharded parameters are cast before the all-gather); None keeps the original dtype.
        reduce_dtype: dtype of the gradient reduction; None reduces in ``param_dtype``.
        output_dtype: dtype the unit's floating-point outputs are cast to; None leaves them.
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.
        apply_grad_on_fp32_main_grad: keyword-only (HyperParallel's extension): keep each
            reduced gradient in float32 as ``param.main_grad`` (a DTensor, accumulated in
            float32 across backwards); ``param.grad`` is the same tensor for float32 parameters,
            or its cast to the parameter dtype otherwise, so a standard optimizer still works.

    See Also:
        :pt:`torch.distributed.fsdp.MixedPrecisionPolicy`: PyTorch's policy (same fields).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    apply_grad_on_fp32_main_grad: bool = field(default=False, kw_only=True)


@dataclass
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer states stay on the device.

    See Also:
        :pt:`torch.distributed.fsdp.OffloadPolicy`: PyTorch's default policy.
    """


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients in host memory; copy them to the device to gather.

    The optimizer step then runs on the CPU. Pinned host memory (``pin_memory=True``, the
    default, as in PyTorch) is a capability of accelerators: on a CPU-only machine ``fully_shard``
    raises a ``ValueError`` asking for ``pin_memory=False``.

    Args:
        pin_memory: allocate the host copies in pinned memory (needs an accelerator).

    See Also:
        :pt:`torch.distributed.fsdp.CPUOffloadPolicy`: PyTorch's policy (same field).
    """

    pin_memory: bool = True


def _cast_any(value: object) -> Any:
    """Return ``value`` typed as ``Any`` (for reading fields of torch's policy objects)."""
    return value


def _torch_policy_classes() -> tuple[type, type, type]:
    return _TORCH_POLICY_CLASSES


def to_mp_policy(policy: object) -> MixedPrecisionPolicy:
    """Return ``policy`` as our :class:`MixedPrecisionPolicy` (accepting torch's class too).

    Args:
        policy: our policy or PyTorch's ``MixedPrecisionPolicy``.

    Returns:
        An equivalent :class:`MixedPrecisionPolicy`.

    Raises:
        TypeError: for any other object.

    See Also:
        :pt:`torch.distributed.fsdp.MixedPrecisionPolicy`: PyTorch's policy.
    """
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    torch_mp, _, _ = _torch_policy_classes()
    if isinstance(policy, torch_mp):
        fields = _cast_any(policy)
        return MixedPrecisionPolicy(
            param_dtype=fields.param_dtype,
            reduce_dtype=fields.reduce_dtype,
            output_dtype=fields.output_dtype,
            cast_forward_inputs=bool(fields.cast_forward_inputs),
        )
    raise TypeError(
        f"mp_policy must be a MixedPrecisionPolicy (hp_fsdp's or torch's), got "
        f"{type(policy).__name__}"
    )


def to_offload_policy(policy: object) -> OffloadPolicy:
    """Return ``policy`` as our :class:`OffloadPolicy` (accepting torch's classes too).

    Args:
        policy: our policy or PyTorch's ``OffloadPolicy`` / ``CPUOffloadPolicy``.

    Returns:
        An equivalent :class:`OffloadPolicy` or :class:`CPUOffloadPolicy`.

    Raises:
        TypeError: for any other object.

    See Also:
        :pt:`torch.distributed.fsdp.OffloadPolicy`: PyTorch's policy.
    """
    if isinstance(policy, OffloadPolicy):
        return policy
    _, torch_offload, torch_cpu_offload = _torch_policy_classes()
    if isinstance(policy, torch_cpu_offload):
        return CPUOffloadPolicy(pin_memory=bool(_cast_any(policy).pin_memory))
    if isinstance(policy, torch_offload):
        return OffloadPolicy()
    raise TypeError(
        f"offload_policy must be an OffloadPolicy (hp_fsdp's or torch's), got "
        f"{type(policy).__name__}"
    )
