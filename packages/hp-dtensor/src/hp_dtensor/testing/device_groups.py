"""Catch host tensors handed to collectives of a device group, on a CPU-only machine.

On a GPU job the default process group is NCCL-only: a CPU tensor given to one of its
collectives or point-to-point calls raises "No backend type associated with device type cpu",
and an object collective (``all_gather_object``, ``broadcast_object_list``, ...) needs a CPU
(gloo) side group. A gloo test accepts both, so :func:`check_device_groups` makes the CPU behave
like the device for this purpose:

- **Which tensors are "host" tensors.** Inside the block, a torch-function mode marks as host
  every tensor made by a factory without ``device=`` (``torch.tensor([n])``, ``torch.zeros(3)``,
  ...), by ``torch.frombuffer`` / ``torch.from_numpy``, by ``Tensor.cpu()``, and every result
  computed from a host tensor. ``Tensor.to(device)`` (and ``.to(device=...)``) of a host tensor
  makes a *device copy*: a new, unmarked tensor, as a real host-to-device copy would be
  (``.to`` of a device tensor returns it unchanged, as on an accelerator). Everything else is a
  device tensor: tensors that existed before the block (the model lives on the device), tensors
  made with ``device=``, gradients computed by autograd, results computed from device tensors.
- **Which groups are device groups.** Every process group, the default one included, except
  the side groups: those passed as ``side_groups=`` and those created inside the block with an
  explicit CPU backend (``new_group(..., backend="gloo")`` or ``"cpu:gloo"``).
- **What is checked.** The public collective and point-to-point entry points of
  ``torch.distributed`` (``all_reduce``, ``all_gather``, ``all_gather_into_tensor``,
  ``reduce_scatter_tensor``, ``broadcast``, ``send``/``recv``/``isend``/``irecv``,
  ``batch_isend_irecv`` (the tensors of its ``P2POp``), ``all_to_all_single``, ...) are wrapped:
  a host tensor on a device group, or an object collective on a device group, raises
  :class:`HostTensorOnDeviceGroupError` (or is recorded, with ``strict=False``). Every call is
  counted in :attr:`DeviceGroupChecker.calls`.
- **The device layer reports an accelerator.** ``hp_dtensor.device.is_accelerator()`` asked
  about the process (no argument) answers ``True``, and ``pin_memory_available()`` ``False``
  (streams and events, asked about an explicit device type, keep their CPU behaviour).

What it does not see: functional collectives (``torch.distributed._functional_collectives``,
used by DTensor's redistribution), calls through names bound before the block (``from
torch.distributed import all_reduce``), and host tensors made by C++ code outside autograd.

Example:
    .. code-block:: python

        from hp_dtensor.testing import check_device_groups

        with check_device_groups(device=torch.device("cpu")) as checker:
            schedule.step(x.to(device), target=y.to(device))
        assert not checker.violations
        assert checker.count("all_gather_object") == 0

See Also:
    :pt:`torch.distributed.new_group` (``backend="gloo"`` side groups);
    :func:`hp_dtensor.testing.count_host_syncs`, the other CPU stand-in for a device rule.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = ["DeviceGroupChecker", "HostTensorOnDeviceGroupError", "check_device_groups"]

_FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.asarray,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.empty_strided,
}

# Entry point -> index of its ``group`` argument when passed positionally.
_TENSOR_CALLS: dict[str, int] = {
    "all_reduce": 2,
    "all_gather": 2,
    "all_gather_into_tensor": 2,
    "reduce_scatter": 3,
    "reduce_scatter_tensor": 3,
    "broadcast": 2,
    "reduce": 3,
    "send": 2,
    "recv": 2,
    "isend": 2,
    "irecv": 2,
    "all_to_all": 2,
    "all_to_all_single": 4,
    "gather": 3,
    "scatter": 3,
}
_OBJECT_CALLS: dict[str, int] = {
    "all_gather_object": 2,
    "broadcast_object_list": 2,
    "gather_object": 3,
    "scatter_object_list": 3,
    "send_object_list": 2,
    "recv_object_list": 2,
}


class HostTensorOnDeviceGroupError(RuntimeError):
    """A host tensor (or an object collective) reached a device group: NCCL would refuse it."""


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dist.P2POp):
        yield value.tensor


class DeviceGroupChecker:
    """The state of one :func:`check_device_groups` block.

    Attributes:
        violations: One message per host tensor or object collective seen on a device group.
        calls: ``(entry point, "device" | "side")`` for every checked call, in order.
        side_groups: The groups allowed to carry host tensors.
    """

    def __init__(
        self, *, device: torch.device | None, side_groups: Iterable[Any], strict: bool
    ) -> None:
        self.device = device
        self.strict = strict
        self.violations: list[str] = []
        self.calls: list[tuple[str, str]] = []
        self.side_groups: list[Any] = list(side_groups)
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}

    # -- marks ------------------------------------------------------------------------------

    def is_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` counts as a host tensor."""
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def mark_host(self, tensor: torch.Tensor) -> None:
        """Count ``tensor`` as a host tensor from now on."""
        key = id(tensor)
        host = self._host

        def forget(_ref: Any) -> None:
            host.pop(key, None)

        host[key] = weakref.ref(tensor, forget)

    def mark_device(self, tensor: torch.Tensor) -> None:
        """Count ``tensor`` as a device tensor from now on."""
        self._host.pop(id(tensor), None)

    def count(self, entry_point: str, kind: str | None = None) -> int:
        """How many calls of ``entry_point`` were seen (on ``"device"`` or ``"side"`` groups,
        or both when ``kind`` is ``None``)."""
        return sum(1 for name, k in self.calls if name == entry_point and kind in (None, k))

    # -- groups -----------------------------------------------------------------------------

    def is_side_group(self, group: Any) -> bool:
        """Whether ``group`` may carry host tensors."""
        return any(group is g for g in self.side_groups)

    def _check(self, name: str, group: Any, tensors: list[torch.Tensor], objects: bool) -> None:
        group = group if group is not None else dist.group.WORLD
        kind = "side" if self.is_side_group(group) else "device"
        self.calls.append((name, kind))
        if kind == "side":
            return
        problem = None
        if objects:
            problem = (
                f"{name} on a device group: object collectives need a CPU side group "
                "(new_group(backend='gloo')) on an accelerator"
            )
        else:
            for i, t in enumerate(tensors):
                if self.is_host(t):
                    problem = (
                        f"{name} on a device group got a host tensor (argument tensor {i}: "
                        f"shape {tuple(t.shape)}, {t.dtype}): on an accelerator this raises "
                        "'No backend type associated with device type cpu'; put it on the "
                        "device or use a CPU side group"
                    )
                    break
        if problem is None:
            return
        self.violations.append(problem)
        if self.strict:
            raise HostTensorOnDeviceGroupError(problem)


class _Marker(TorchFunctionMode):
    def __init__(self, checker: DeviceGroupChecker) -> None:
        super().__init__()
        self.checker = checker

    def _to_device(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if func is not torch.Tensor.to:
            return False
        target = kwargs.get("device")
        for a in args[1:]:
            if isinstance(a, torch.device | str):
                target = a
        if target is None:
            return False
        return self.checker.device is None or torch.device(target) == self.checker.device

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        checker = self.checker
        if self._to_device(func, args, kwargs):
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and checker.is_host(args[0]):
                if out is args[0]:
                    out = out.clone()  # a host-to-device copy on an accelerator
                checker.mark_device(out)
            return out
        out = func(*args, **kwargs)
        host = False
        if func is torch.Tensor.cpu or (func in _FACTORIES and "device" not in kwargs):
            host = True
        else:
            host = any(checker.is_host(t) for t in _tensors_in(list(args) + list(kwargs.values())))
        if host:
            for t in _tensors_in(out):
                checker.mark_host(t)
        return out


@contextlib.contextmanager
def check_device_groups(
    *,
    device: torch.device | str | None = None,
    side_groups: Iterable[Any] = (),
    strict: bool = True,
    accelerator: bool = True,
) -> Iterator[DeviceGroupChecker]:
    """Reject host tensors on device groups inside the block (see the module docstring).

    Args:
        device: The device ``Tensor.to(device)`` copies to (default: any ``to(<device>)``).
        side_groups: Groups that may carry host tensors (a ``cpu:gloo`` side group).
        strict: Raise :class:`HostTensorOnDeviceGroupError` at the first violation (default);
            ``False`` records it in ``violations`` and lets the call run.
        accelerator: Make ``hp_dtensor.device.is_accelerator()`` (no argument) answer ``True``
            and ``pin_memory_available()`` ``False`` inside the block.

    Yields:
        The :class:`DeviceGroupChecker`.

    Raises:
        HostTensorOnDeviceGroupError: a host tensor or an object collective reached a device
            group (``strict=True``).

    See Also:
        :pt:`torch.distributed.new_group`
    """
    from hp_dtensor import device as device_layer

    checker = DeviceGroupChecker(
        device=None if device is None else torch.device(device),
        side_groups=side_groups,
        strict=strict,
    )
    saved: dict[tuple[Any, str], Any] = {}

    def patch(owner: Any, name: str, value: Any) -> None:
        saved[(owner, name)] = getattr(owner, name)
        setattr(owner, name, value)

    def wrap(name: str, group_pos: int, objects: bool) -> Callable[..., Any]:
        original = getattr(dist, name)

        def checked(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group", args[group_pos] if len(args) > group_pos else None)
            tensors = [] if objects else list(_tensors_in(list(args) + list(kwargs.values())))
            checker._check(name, group, tensors, objects)
            return original(*args, **kwargs)

        return checked

    for name, pos in _TENSOR_CALLS.items():
        patch(dist, name, wrap(name, pos, False))
    for name, pos in _OBJECT_CALLS.items():
        patch(dist, name, wrap(name, pos, True))

    original_batch = dist.batch_isend_irecv

    def batch(p2p_op_list: list[Any]) -> Any:
        groups = {id(op.group): op.group for op in p2p_op_list}
        for group in groups.values():
            ops = [op for op in p2p_op_list if op.group is group]
            checker._check("batch_isend_irecv", group, [op.tensor for op in ops], False)
        return original_batch(p2p_op_list)

    patch(dist, "batch_isend_irecv", batch)

    original_new_group = dist.new_group

    def new_group(*args: Any, **kwargs: Any) -> Any:
        made = original_new_group(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if backend is not None and "gloo" in str(backend).lower():
            checker.side_groups.append(made)
        return made

    patch(dist, "new_group", new_group)

    def host_factory(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def made(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = original(*args, **kwargs)
            checker.mark_host(out)
            return out

        return made

    patch(torch, "frombuffer", host_factory(torch.frombuffer))
    patch(torch, "from_numpy", host_factory(torch.from_numpy))

    if accelerator:
        truthful = device_layer.is_accelerator

        def is_accelerator(device_type: Any = None) -> bool:
            return True if device_type is None else truthful(device_type)

        patch(device_layer, "is_accelerator", is_accelerator)
        patch(device_layer, "pin_memory_available", lambda: False)
    try:
        with _Marker(checker):
            yield checker
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)
