"""Hyper-offload of the parameters: they live in host memory and visit the device per block.

:func:`offload_params` (``--offload.params true``) splits each model part into units: every
transformer block of ``model.layers``, and each other child module holding parameters (the
embedding, the final norm, the LM head; children that share a parameter, e.g. tied
embeddings, form one unit). Each parameter keeps its identity (optimizers, clipping and
checkpoints see the same ``nn.Parameter`` objects) but its data is a host tensor (pinned where
the device layer has pinned memory) except while its unit computes:

* forward: a unit's pre-hook makes its device copy the parameters' data and issues the copy
  of the next unit (prefetch depth 1, on a copy stream of the device layer where there is
  one; on the CPU the copy is synchronous); its post-hook drops the device copy;
* backward: a hook on the unit's output gradient (it fires before the unit's backward, and
  before a checkpointed block's re-forward) copies the unit in again and issues the copy of
  the unit before it; after the unit's last gradient is accumulated, the gradients are moved
  into persistent host buffers (added there over micro-batches), which become the
  parameters' ``.grad``, and the device copy is dropped (a unit some of whose parameters get
  no gradient stays until its next forward).

The optimizer therefore steps the host parameters with host gradients directly (its state is
created in host memory). With ``--offload.optimizer`` as well, its host master copy is a
second host copy: each step copies the host gradients into its buffers and its result back
into the host parameters (host to host); the numbers are unchanged.

Same numbers: the device computes with copies of the same values and the gradients are summed
in the same order, so losses, gradients and weights match a run without offload bit for bit
(tested). On a CPU "device" the host is the same memory: the copies and the drops run as on an
accelerator, and the saving shows as tensor-level device memory (the tensors allocated during
the step), which is what ``hp_trainer.planner`` predicts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hp_dtensor import DTensor
from hp_dtensor import device as hp_device

__all__ = ["ParamOffloader", "offload_params"]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class _ParamView:
    """A saved tensor that is a view of a unit's device copy: rebuilt from the copy fetched
    for the backward, so the forward's copy can be freed."""

    __slots__ = ("index", "offset", "size", "stride", "unit")

    def __init__(self, unit: _Unit, index: int, t: torch.Tensor) -> None:
        self.unit, self.index = unit, index
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


class _Unit:
    """The parameters that move to the device together, and where they are now."""

    def __init__(self, name: str, params: list[nn.Parameter], pin: bool) -> None:
        self.name = name
        self.params = params
        self.host = []
        self.grads = []
        for p in params:
            host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
            host.copy_(p.detach())
            self.host.append(host)
            self.grads.append(
                torch.zeros(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
                if p.requires_grad
                else None
            )
        self.nbytes = sum(h.numel() * h.element_size() for h in self.host)
        self.device: list[torch.Tensor] | None = None  # the device copy, while there is one
        self.event: hp_device.Event | None = None
        self.backward = False  # between its output-gradient hook and its last gradient
        self.pending: set[int] = set()
        self.accumulate = [False] * len(params)  # host buffer holds gradient to add to


class ParamOffloader:
    """Keeps a model's parameters in host memory and brings them to the device per unit.

    Built by :func:`offload_params`; see the module docstring for the schedule.

    Attributes:
        units: The units in forward order (names: ``layers.<i>``, or the child modules' names).
        copied_bytes: Bytes copied between host and device since the last :meth:`reset_stats`
            (parameters in, gradients out).
        max_resident_bytes: Most parameter bytes on the device at a hook since the last reset.
        log: ``(phase, unit, resident units)`` at each unit's forward and backward (``fwd``,
            ``bwd``) since the last reset.

    See Also:
        :pt:`torch.distributed.fsdp.CPUOffloadPolicy`: FSDP2 keeps sharded parameters on the
        host and copies them in for the all-gather, only under FSDP.
    """

    def __init__(self, model_parts: Iterable[nn.Module], device: torch.device) -> None:
        self.device = device
        self._pin = hp_device.pin_memory_available()
        self._accel = hp_device.is_accelerator(device.type)
        self._copy_stream = hp_device.Stream(device.type) if self._accel else None
        self.units: list[_Unit] = []
        self._order: list[tuple[nn.Module, _Unit]] = []  # hooked modules in forward order
        self._where: dict[nn.Parameter, tuple[_Unit, int]] = {}
        for part in model_parts:
            self._split(part)
        self._handles: list[Any] = []
        for index, (module, _unit) in enumerate(self._order):
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(index)))
            self._handles.append(module.register_forward_hook(self._post_hook(index)))
        for unit in self.units:
            for i, p in enumerate(unit.params):
                p.data = unit.host[i]
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._grad_done))  # type: ignore[no-untyped-call]
        self.copied_bytes = 0
        self.max_resident_bytes = 0
        self.log: list[tuple[str, str, tuple[str, ...]]] = []
        self._on_device: dict[int, tuple[_Unit, int]] = {}  # storage address -> parameter
        self._saving: list[Any] = []  # the saved-tensor hooks of the units in forward
        self.reset_stats()

    # -- structure ------------------------------------------------------------------------
    def _split(self, part: nn.Module) -> None:
        layers = getattr(part, "layers", None)
        if not isinstance(layers, nn.ModuleDict):
            raise ValueError(
                f"offload.params needs a model with its blocks in model.layers (a ModuleDict); "
                f"{type(part).__name__} has {type(layers).__name__}"
            )
        if any(True for _ in part.parameters(recurse=False)):
            raise ValueError(
                f"offload.params: {type(part).__name__} holds parameters outside its child "
                "modules; expected every parameter inside a block or a child module"
            )
        for p in part.parameters():
            if isinstance(p, DTensor):
                raise ValueError(
                    "offload.params needs plain (unsharded) parameters; got DTensor parameters "
                    "(FSDP, TP or replicate): use training.enable_cpu_offload under FSDP"
                )
        groups: list[tuple[list[tuple[str, nn.Module]], list[nn.Parameter]]] = []
        for name, child in part.named_children():
            if child is None:
                continue
            if name == "layers":
                for key, block in layers.items():
                    groups.append(([(f"layers.{key}", block)], list(block.parameters())))
                continue
            params = list(child.parameters())
            if not params:
                continue
            shared = [g for g in groups if any(p is q for p in params for q in g[1])]
            if any(g[0][0][0].startswith("layers.") for g in shared):
                raise ValueError(
                    f"offload.params: module {name} shares a parameter with a block; expected "
                    "blocks to own their parameters"
                )
            if shared:  # tied weights: one unit
                shared[0][0].append((name, child))
                ids = {id(q) for q in shared[0][1]}
                shared[0][1].extend(p for p in params if id(p) not in ids)
            else:
                groups.append(([(name, child)], params))
        for modules, params in groups:
            unit = _Unit("+".join(n for n, _ in modules), params, self._pin)
            self.units.append(unit)
            for i, p in enumerate(params):
                self._where[p] = (unit, i)
            self._order += [(m, unit) for _, m in modules]
        # forward order: registration order with the blocks where model.layers is
        # (a different actual order only costs prefetches: each unit is fetched when used)

    # -- moving ----------------------------------------------------------------------------
    def _fetch(self, unit: _Unit) -> None:
        """Issue the copy of ``unit`` to the device (no wait)."""
        if unit.device is not None:
            return
        if self._copy_stream is None:
            unit.device = [h.to(self.device, copy=True) for h in unit.host]
        else:
            self._copy_stream.wait_stream(hp_device.current_stream(self.device.type))
            with hp_device.stream(self._copy_stream):
                unit.device = [h.to(self.device, non_blocking=self._pin) for h in unit.host]
            unit.event = self._copy_stream.record_event()
        self.copied_bytes += unit.nbytes

    def _use(self, unit: _Unit) -> None:
        """Make ``unit``'s device copy its parameters' data."""
        self._fetch(unit)
        assert unit.device is not None
        if unit.event is not None:
            compute = hp_device.current_stream(self.device.type)
            compute.wait_event(unit.event)
            for d in unit.device:
                compute.record_tensor(d)
            unit.event = None
        for i, (p, d) in enumerate(zip(unit.params, unit.device, strict=True)):
            p.data = d
            self._on_device[d.untyped_storage().data_ptr()] = (unit, i)

    def _drop(self, unit: _Unit) -> None:
        for p, h in zip(unit.params, unit.host, strict=True):
            self._on_device.pop(p.untyped_storage().data_ptr(), None)
            p.data = h
        unit.device = None

    def _pack(self, t: torch.Tensor) -> Any:
        """Save a view of a device copy (e.g. a transposed weight) as where it sits in it."""
        if t.device.type != self.device.type or t.layout != torch.strided:
            return t
        hit = self._on_device.get(t.untyped_storage().data_ptr())
        if hit is None or hit[0].params[hit[1]].dtype != t.dtype:
            return t
        return _ParamView(hit[0], hit[1], t)

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _ParamView):
            return saved  # type: ignore[no-any-return]
        unit = saved.unit
        if unit.device is None:  # not fetched by its output's gradient hook (cannot happen)
            self._use(unit)
        assert unit.device is not None
        return unit.device[saved.index].as_strided(saved.size, saved.stride, saved.offset)

    def _note(self, phase: str, unit: _Unit) -> None:
        resident = tuple(u.name for u in self.units if u.device is not None)
        nbytes = sum(u.nbytes for u in self.units if u.device is not None)
        self.max_resident_bytes = max(self.max_resident_bytes, nbytes)
        self.log.append((phase, unit.name, resident))

    # -- hooks -----------------------------------------------------------------------------
    def _pre_hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            unit = self._order[index][1]
            if unit.backward:  # some parameters got no gradient in the last backward
                unit.backward = False
                unit.pending = set()
            self._use(unit)
            if index + 1 < len(self._order) and self._order[index + 1][1] is not unit:
                self._fetch(self._order[index + 1][1])
            self._note("fwd", unit)
            saving = None
            if torch.is_grad_enabled():
                saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                saving.__enter__()
            self._saving.append(saving)

        return hook

    def _post_hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            unit = self._order[index][1]
            saving = self._saving.pop()
            if saving is not None:
                saving.__exit__(None, None, None)
            if not unit.backward:
                self._drop(unit)
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._backward_hook(index))  # type: ignore[no-untyped-call]

        return hook

    def _backward_hook(self, index: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            unit = self._order[index][1]
            if not unit.backward:
                unit.backward = True
                unit.pending = {i for i, p in enumerate(unit.params) if p.requires_grad}
                for i, p in enumerate(unit.params):
                    if p.grad is None:
                        unit.accumulate[i] = False
                    elif p.grad is unit.grads[i]:  # an earlier micro-batch's, on the host
                        p.grad = None
                        unit.accumulate[i] = True
                    else:
                        raise RuntimeError(
                            f"offload.params: {unit.name} has a gradient that is not its host "
                            "buffer (set outside the offloaded backward)"
                        )
            self._use(unit)
            if index > 0 and self._order[index - 1][1] is not unit:
                self._fetch(self._order[index - 1][1])
            self._note("bwd", unit)

        return hook

    @torch.no_grad()
    def _grad_done(self, p: torch.Tensor) -> None:
        unit, i = self._where[p]  # type: ignore[index]
        grad = p.grad
        if grad is None or not unit.backward:
            return
        buffer = unit.grads[i]
        assert buffer is not None
        if unit.accumulate[i]:
            buffer.add_(grad.to("cpu"))
        else:
            buffer.copy_(grad, non_blocking=self._pin)
        self.copied_bytes += buffer.numel() * buffer.element_size()
        unit.accumulate[i] = True
        p.grad = buffer  # taken off again by the next backward's hook before it accumulates
        unit.pending.discard(i)
        if not unit.pending:
            unit.backward = False
            if self._pin:  # one host wait per unit: its asynchronous gradient copies
                hp_device.current_stream(self.device.type).synchronize()
            self._drop(unit)

    # -- reporting ---------------------------------------------------------------------------
    @property
    def host_bytes(self) -> int:
        """Host bytes of the parameters and their gradient buffers."""
        return sum(
            u.nbytes + sum(g.numel() * g.element_size() for g in u.grads if g is not None)
            for u in self.units
        )

    def reset_stats(self) -> None:
        """Clear ``copied_bytes``, ``max_resident_bytes`` and ``log``."""
        self.copied_bytes = 0
        self.max_resident_bytes = 0
        self.log = []

    def remove(self) -> None:
        """Remove the hooks and put the parameters back on the device (their data copied)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for unit in self.units:
            for i, p in enumerate(unit.params):
                p.data = unit.host[i].to(self.device, copy=True)
                grad = unit.grads[i]
                if grad is not None and p.grad is grad:
                    p.grad = grad.to(self.device, copy=True)


def offload_params(
    model_parts: Iterable[nn.Module], *, device: torch.device | None = None
) -> ParamOffloader:
    """Keep the parameters of ``model_parts`` in host memory (``--offload.params true``).

    Args:
        model_parts: Models with their blocks in ``model.layers`` (a ``ModuleDict``), on the
            device, with plain (not DTensor) parameters; activation checkpointing may be
            applied already (a checkpointed block's re-forward runs after its parameters were
            copied in for its backward).
        device: The compute device (default: the device of the first parameter).

    Returns:
        The offloader (its hooks stay on the modules; :meth:`ParamOffloader.remove` undoes it).

    Raises:
        ValueError: A model without ``layers``, parameters held by the root module, a block
            sharing a parameter with another module, or DTensor parameters.

    See Also:
        :pt:`torch.distributed.fsdp.CPUOffloadPolicy`: FSDP2's parameter offload.
    """
    parts = list(model_parts)
    if device is None:
        first = next((p for m in parts for p in m.parameters()), None)
        if first is None:
            raise ValueError("offload_params got models without parameters")
        device = first.device
    return ParamOffloader(parts, device)
