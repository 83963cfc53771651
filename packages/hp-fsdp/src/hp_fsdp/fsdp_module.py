"""The ``FSDPModule`` mix-in (``HSDPModule``), ``UnshardHandle`` and the class swap.

``fully_shard`` swaps a module's class for ``FSDP<Original>``, a class deriving from
:class:`FSDPModule` and the original; the mix-in's methods are the per-unit control surface
(unshard/reshard, gradient sync, hooks, communication settings).

See Also:
    :pt:`torch.distributed.fsdp.FSDPModule`: PyTorch's mix-in.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, NoReturn, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from hp_dtensor.device import (
    Event,
    Stream,
    current_stream,
    is_accelerator,
)
from hp_dtensor.device import stream as device_stream
from hp_fsdp.collectives import (
    ProcessGroupAllGather,
    ProcessGroupReduceScatter,
    pg_supports_alloc,
)
from hp_fsdp.errors import FSDPDeepCopyError, FSDPUsageError
from hp_fsdp.param_group import ParamGroup
from hp_fsdp.root_state import RootContext
from hp_fsdp.state import FSDPState, get_state
from hp_fsdp.symm_mem import NCCLSymmetricMemory, SymmetricMemory, SymmetricMemoryAllGather
from hp_kernels import AllGather, ReduceScatter

__all__ = [
    "FSDPModule",
    "HSDPModule",
    "UnshardHandle",
    "disable_fsdp_module_new_init",
    "get_cls_to_fsdp_cls",
]

_log = logging.getLogger("hp_fsdp")

_CLS_TO_FSDP_CLS: dict[type, type] = {}
_NEW_INIT_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "hp_fsdp_new_init", default=True
)


def _log_hint_once(ctx: RootContext, key: str, message: str) -> None:
    """Log a best-effort hint's fallback once per root (shared comm context) at debug level."""
    if key in ctx.comm.logged_hints:
        return
    ctx.comm.logged_hints.add(key)
    _log.debug(message)


class UnshardHandle:
    """A handle on an :meth:`FSDPModule.unshard` issued with ``async_op=True``.

    See Also:
        :pt:`torch.distributed.fsdp.UnshardHandle`: PyTorch's handle.
    """

    def __init__(self, *, groups: list[ParamGroup] | None = None) -> None:
        self._groups = groups

    def wait(self) -> None:
        """Wait for the all-gather; afterwards the unsharded parameters are registered.

        See Also:
            :pt:`torch.distributed.fsdp.UnshardHandle.wait`: PyTorch's method.
        """
        if self._groups is not None:
            for group in self._groups:
                group.wait_for_unshard()
            self._groups = None


def _unimplemented_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    raise FSDPDeepCopyError(
        "FSDP does not support deepcopy: a fully_shard module cannot be deep-copied; copy the "
        "model before fully_shard, or use its state dict"
    )


class FSDPModule:
    """Mix-in class of every module ``fully_shard`` was applied to (``FSDP<Original>``).

    ``fully_shard`` swaps a module's class for a class deriving from this one and from the
    original class, so ``isinstance(m, FSDPModule)`` identifies units. ``HSDPModule`` is the
    same class under HyperParallel's name.

    See Also:
        :pt:`torch.distributed.fsdp.FSDPModule`: PyTorch's mix-in (same methods).
    """

    _orig_cls_mro_index: int = 2

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        orig_cls = cls.__mro__[cls._orig_cls_mro_index]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        if _NEW_INIT_ENABLED.get():
            self.__init__(*args, **kwargs)
        return self

    def _get_fsdp_state(self) -> FSDPState:
        state = get_state(cast(nn.Module, self))
        if state is None:
            raise RuntimeError(f"no hp_fsdp state on {type(self).__name__}")
        return state

    def _units(self, recurse: bool) -> list[FSDPState]:
        module = cast(nn.Module, self)
        modules = list(module.modules()) if recurse else [module]
        states: list[FSDPState] = []
        for sub in modules:
            state = get_state(sub)
            if state is not None and state not in states:
                states.append(state)
        return states

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones (not recursive).

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.reshard`: PyTorch's method.
        """
        for group in self._get_fsdp_state().groups:
            group.to_sharded()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather the parameters and register the unsharded ones (not recursive).

        Args:
            async_op: return an :class:`UnshardHandle` to wait on instead of waiting here.

        Returns:
            The handle when ``async_op`` is True, else None.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.unshard`: PyTorch's method.
        """
        state = self._get_fsdp_state()
        for group in state.groups:
            group.lazy_init(state.ctx if state.is_root is not None else None)
            group.unshard(async_op)
        handle = UnshardHandle(groups=list(state.groups))
        if async_op:
            return handle
        handle.wait()
        return None

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Set whether the next backward ends the iteration (waits for every reduction).

        Args:
            is_last_backward: False for all but the last micro-batch's backward.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_is_last_backward`: PyTorch's method.
        """
        self._get_fsdp_state().ctx.is_last_backward = is_last_backward

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Set whether backward reduces gradients (False: accumulate unsharded gradients).

        Args:
            requires_gradient_sync: reduce gradients in the next backward.
            recurse: apply to every unit under this module.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_requires_gradient_sync`.
        """
        for group in self._groups(recurse):
            group.configure(reduce_grads=requires_gradient_sync)
            group.configure(all_reduce_grads=requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Set whether HSDP all-reduces gradients over the replicate axis (False: accumulate).

        Args:
            requires_all_reduce: all-reduce in the next backward.
            recurse: apply to every unit under this module.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_requires_all_reduce`.
        """
        for group in self._groups(recurse):
            group.configure(all_reduce_grads=requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Set whether parameters are resharded after forward.

        Args:
            reshard_after_forward: reshard after forward.
            recurse: apply to every unit under this module.

        Raises:
            ValueError: when ``reshard_after_forward`` is not a bool.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_reshard_after_forward`.
        """
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                "reshard_after_forward should be a bool, got "
                f"{type(reshard_after_forward).__name__}"
            )
        for state in self._units(recurse):
            state.auto_reshard_after_forward = False
            for group in state.groups:
                group.reshard_after_forward = reshard_after_forward
                group.post_forward_info = None

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Set whether parameters are resharded after backward.

        Args:
            reshard_after_backward: reshard after backward.
            recurse: apply to every unit under this module.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_reshard_after_backward`.
        """
        for group in self._groups(recurse):
            group.configure(reshard_after_backward=reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Prefetch these units' all-gathers right after this unit's in forward.

        Args:
            modules: units to prefetch, in order.

        Raises:
            TypeError: when an entry is not a fully_shard module.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_modules_to_forward_prefetch`.
        """
        self._get_fsdp_state().forward_prefetch = _states_of(modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Prefetch these units' all-gathers right after this unit's in backward.

        Args:
            modules: units to prefetch, in order.

        Raises:
            TypeError: when an entry is not a fully_shard module.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_modules_to_backward_prefetch`.
        """
        self._get_fsdp_state().backward_prefetch = _states_of(modules)

    def _groups(self, recurse: bool) -> list[ParamGroup]:
        return [g for s in self._units(recurse) for g in s.groups]

    def reset_iter_state(self) -> None:
        """Recover after an exception aborted a forward or backward (call on the root).

        Waits for in-flight all-gathers, reshards every unit and clears the iteration's
        trackers; in-flight gradient reductions, HSDP partial reductions and no-sync
        accumulations are discarded, so restart a gradient-accumulation sequence. Kind (c):
        works everywhere.

        Raises:
            RuntimeError: when called on a nested unit rather than the root.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.reset_iter_state`: PyTorch's method.
        """
        self._get_fsdp_state().reset_iter_state()

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Make the next forward's all-gathers wait for ``event`` instead of the whole stream.

        Kind (b), a hint: on an accelerator the root waits for the event before the next
        forward's first all-gather; on the CPU there are no streams, so PyTorch's fallback
        (ordinary program order) applies and the call logs once at debug level.

        Args:
            event: an event recorded after the optimizer step.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_post_optim_event`: PyTorch's method.
        """
        state = self._get_fsdp_state()
        if is_accelerator(state.device) or isinstance(event, Event):
            state.ctx.post_optim_event = event
        if not is_accelerator(state.device):
            _log_hint_once(
                state.ctx,
                "set_post_optim_event",
                "set_post_optim_event: no streams on the CPU; all-gathers follow program order",
            )

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel size.

        Kind (c). With fp32/bf16 reductions torch pre-multiplies through ``PREMUL_SUM``, which
        gloo and hccl lack; hp-fsdp sums and divides the result by ``factor`` (bitwise equal
        to torch with :meth:`set_force_sum_reduction_for_comms` enabled).

        Args:
            factor: a positive divide factor for this unit (not recursive, as in PyTorch).

        Raises:
            ValueError: for a non-positive factor.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_gradient_divide_factor`: PyTorch's method.
        """
        if isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0:
            raise ValueError(f"gradient divide factor must be a positive number, got {factor!r}")
        for group in self._groups(False):
            group.configure(gradient_divide_factor=float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated alias of :meth:`set_gradient_divide_factor` (warns).

        Args:
            factor: the divide factor.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_reduce_scatter_divide_factor`.
        """
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
            FutureWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with ``SUM`` only and divide locally (no ``AVG``/``PREMUL_SUM`` collectives).

        Kind (c).

        Args:
            enable: force sum reductions for this unit (not recursive, as in PyTorch).

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_force_sum_reduction_for_comms`.
        """
        for group in self._groups(False):
            group.configure(force_sum_reduction=bool(enable))

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Set whether this unit all-gathers its parameters again in backward.

        Kind (c). False is for units whose backward does not read the parameter values (an
        embedding): the re-gather is skipped and gradients are still reduced.

        Args:
            unshard_in_backward: gather in backward (default True).

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_unshard_in_backward`: PyTorch's method.
        """
        for group in self._groups(False):
            group.configure(unshard_in_backward=bool(unshard_in_backward))

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """Use ``comm`` for this unit's all-gathers (its ``allocate`` provides the buffer).

        Kind (c). ``comm`` is an :class:`hp_kernels.AllGather` (PyTorch's ``AllGather``
        subclasses qualify too).

        Args:
            comm: the all-gather implementation.

        Raises:
            TypeError: when ``comm`` is not an ``AllGather``.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_custom_all_gather`: PyTorch's method.
        """
        if not isinstance(comm, AllGather):
            raise TypeError(f"expected an hp_kernels.AllGather, got {type(comm).__name__}")
        for group in self._groups(False):
            group.configure(custom_all_gather=comm)

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Use ``comm`` for this unit's gradient reduce-scatters.

        Kind (c). ``comm`` is an :class:`hp_kernels.ReduceScatter` (PyTorch's subclasses
        qualify too).

        Args:
            comm: the reduce-scatter implementation.

        Raises:
            TypeError: when ``comm`` is not a ``ReduceScatter``.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_custom_reduce_scatter`: PyTorch's method.
        """
        if not isinstance(comm, ReduceScatter):
            raise TypeError(f"expected an hp_kernels.ReduceScatter, got {type(comm).__name__}")
        for group in self._groups(False):
            group.configure(custom_reduce_scatter=comm)

    def set_all_reduce_hook(
        self,
        hook: Callable[[torch.Tensor], None],
        *,
        stream: Any | None = None,
    ) -> None:
        """Call ``hook`` on each reduced gradient shard before its division and write-back.

        With HSDP the hook runs after the replicate-axis all-reduce, with FSDP after the
        reduce-scatter; it may modify the tensor in place. ``stream`` is a hint (kind (b)): on
        an accelerator the hook runs on that stream, ordered after the reduction and before
        the write-back; on the CPU streams do not exist, so a CPU stream is accepted, as
        PyTorch accepts it, and the hook runs in program order (logged once at debug level).

        Args:
            hook: called with the flat reduced shard (reduce dtype) of each unit.
            stream: a stream to run the hook on (None: the reduction's own stream). Plain
                FSDP only.

        Raises:
            ValueError: for a stream with native HSDP (PyTorch's message: the hook runs on
                the all-reduce stream there).

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_all_reduce_hook`: PyTorch's method.
        """
        state = self._get_fsdp_state()
        if stream is not None and any(g.mesh_info.is_hsdp for g in state.groups):
            raise ValueError("stream cannot be set when using native HSDP")
        chosen = hook
        if stream is not None and not is_accelerator(state.device):
            _log.debug(
                "set_all_reduce_hook(stream=%r): streams are no-ops on %s; the hook runs in "
                "program order after each reduction",
                stream,
                state.device,
            )
        elif stream is not None:
            hook_stream = stream if isinstance(stream, Stream) else Stream.from_native(stream)

            def on_stream(tensor: torch.Tensor) -> None:
                # The hook stream waits for the reduction, and the caller's stream for the hook.
                caller = current_stream(hook_stream.device_type)
                hook_stream.wait_stream(caller)
                hook_stream.record_tensor(tensor)
                with device_stream(hook_stream):
                    hook(tensor)
                caller.wait_stream(hook_stream)

            chosen = on_stream
        for group in state.groups:
            group.configure(all_reduce_hook=chosen)

    def set_symm_mem_for_comm(
        self, backend: Literal["NCCL"] = "NCCL", *, memory: SymmetricMemory | None = None
    ) -> None:
        """All-gather this unit's parameters into pooled symmetric-memory buffers.

        Kind (a): a capability of NCCL on accelerators of compute capability 9.0 (SM90) or
        newer; elsewhere it raises. Each buffer is allocated and rendezvoused once, then reused
        by later all-gathers of the same dtype and size (of any unit of the root) and steps;
        see ``hp_fsdp.symm_mem``.

        Args:
            backend: ``"NCCL"``, PyTorch's only option.
            memory: where the buffers come from (extension, keyword-only; default: PyTorch's
                NCCL symmetric memory).

        Raises:
            RuntimeError: when ``memory`` cannot be used by this unit (the default: not on
                such an accelerator with NCCL).
            ValueError: for another backend name; and (also an ``AssertionError``, as in
                PyTorch) when a custom all-gather or reduce-scatter is set.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_symm_mem_for_comm`: PyTorch's method.
        """
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm supports backend='NCCL', got {backend!r}")
        state = self._get_fsdp_state()
        chosen: SymmetricMemory = NCCLSymmetricMemory(backend) if memory is None else memory
        reason = chosen.unavailable(state.device, [g.mesh_info.shard_group for g in state.groups])
        if reason is not None:
            raise RuntimeError(f"set_symm_mem_for_comm {reason}")
        for group in state.groups:  # as PyTorch: symmetric memory replaces only the defaults
            ag, rs = group.options.custom_all_gather, group.options.custom_reduce_scatter
            if ag is not None and not isinstance(ag, SymmetricMemoryAllGather):
                raise FSDPUsageError(
                    "cannot call set_symm_mem() when all gather comm is custom: "
                    f"{type(ag).__name__}; set_symm_mem_for_comm replaces the default all-gather"
                )
            if rs is not None:
                raise FSDPUsageError(
                    "cannot call set_symm_mem() when reduce scatter comm is custom: "
                    f"{type(rs).__name__}"
                )
        # Looked up per all-gather: the unit joins its root's context at lazy initialization.
        comm = SymmetricMemoryAllGather(chosen, lambda: state.ctx.comm.symmetric_buffers)
        for group in state.groups:
            group.configure(custom_all_gather=comm)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate communication buffers from the process group's allocator where it has one.

        Kind (b), a hint: backends without their own allocator (gloo) keep PyTorch's fallback,
        ordinary allocations, and the call logs once at debug level.

        Args:
            enable: use the process group's allocator.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_allocate_memory_from_process_group_for_comm`.
        """
        state = self._get_fsdp_state()
        for group in state.groups:
            if not enable:
                group.configure(custom_all_gather=None)
                group.configure(custom_reduce_scatter=None)
                continue
            shard_group = group.mesh_info.shard_group
            if not pg_supports_alloc(shard_group, state.device):
                _log_hint_once(
                    state.ctx,
                    "allocate_memory_from_process_group",
                    "set_allocate_memory_from_process_group_for_comm: the "
                    f"{dist.get_backend(shard_group)} process group has no tensor allocator for "
                    f"{state.device}; buffers come from the ordinary allocator",
                )
                continue
            group.configure(custom_all_gather=ProcessGroupAllGather(shard_group))
            group.configure(custom_reduce_scatter=ProcessGroupReduceScatter(shard_group))

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Reduce-scatter zero gradients for parameters that got none in this backward.

        Kind (c). Needed when ranks take different branches of a unit (e.g. mixture of
        experts): every rank then issues the same reduce-scatter.

        Args:
            reduce_scatter_unused_params: include unused trainable parameters with zeros.
            recurse: apply to every unit under this module.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_reduce_scatter_unused_params`.
        """
        for group in self._groups(recurse):
            group.configure(reduce_scatter_unused_params=bool(reduce_scatter_unused_params))

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """Set how many gradient reductions a unit leaves in flight when it issues its own.

        Kind (c). 1 (the default) finishes the previous unit's reduction before issuing the
        next; more overlap communication longer at the cost of memory.

        Args:
            max_input_buffers: at least 1.
            recurse: apply to every unit under this module.

        Raises:
            ValueError: for a value below 1 or not an int.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_reduce_scatter_max_input_buffers`.
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise ValueError(f"max_input_buffers must be an int >= 1, got {max_input_buffers!r}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be >= 1, got {max_input_buffers}")
        for group in self._groups(recurse):
            group.configure(max_inflight_reductions=max_input_buffers)

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Issue reduce-scatters on their own process group (same ranks as the shard group).

        Kind (c). The group is created once per shard group and root, so reductions and
        all-gathers can overlap on backends that serialize one group's collectives. Collective:
        every rank must call it.

        Args:
            enable: use the separate group (False: back to the shard group).
            recurse: apply to every unit under this module.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_separate_reduce_scatter_group`.
        """
        ctx = self._get_fsdp_state().ctx
        for group in self._groups(recurse):
            group.configure(
                reduce_scatter_group=(
                    ctx.comm.separate_group(group.mesh_info.shard_group) if enable else None
                )
            )

    def set_gradient_scaling_factor(self, factor: float | torch.Tensor | None) -> None:
        """Multiply reduced gradients by ``factor`` (HyperParallel's extension).

        Applied after the reduction and division, before the cast to the parameter dtype;
        a tensor factor is read at every reduction (so it can change between steps without
        another call). None (the default) skips the multiplication entirely. Applies to this
        unit only, like PyTorch's per-unit reduction setters. Kind (c).

        Args:
            factor: None, a number, or a one-element tensor.

        Raises:
            TypeError: for another type.
            ValueError: for a tensor with more than one element.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_gradient_divide_factor`: PyTorch's
            nearest counterpart (a divisor applied through the collective).
        """
        if isinstance(factor, torch.Tensor):
            if factor.numel() != 1:
                raise ValueError(
                    f"a tensor gradient scaling factor must have one element, got {factor.shape}"
                )
        elif factor is not None and (
            isinstance(factor, bool) or not isinstance(factor, int | float)
        ):
            raise TypeError(
                f"gradient scaling factor must be None, a number or a tensor, got "
                f"{type(factor).__name__}"
            )
        value = float(factor) if isinstance(factor, int | float) else factor
        for group in self._groups(False):
            group.configure(gradient_scaling_factor=value)

    def set_reduce_op_type(self, reduce_op_type: str) -> None:
        """Choose how gradients are reduced: ``"avg"`` (default) or ``"sum"`` (HyperParallel).

        ``"sum"`` sums over all data-parallel ranks without dividing (``SUM`` collectives);
        ``"avg"`` restores the default averaging (or :meth:`set_gradient_divide_factor`'s
        factor). Applies to this unit only, like PyTorch's per-unit reduction setters.
        Kind (c).

        Args:
            reduce_op_type: ``"avg"`` or ``"sum"`` (case-insensitive).

        Raises:
            ValueError: for another value.

        See Also:
            :pt:`torch.distributed.fsdp.FSDPModule.set_gradient_divide_factor`: ``1.0`` there is
            ``"sum"`` here.
        """
        kind = reduce_op_type.lower() if isinstance(reduce_op_type, str) else reduce_op_type
        if kind not in ("avg", "sum"):
            raise ValueError(f"reduce_op_type must be 'avg' or 'sum', got {reduce_op_type!r}")
        for group in self._groups(False):
            group.configure(reduce_op_type=kind)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a state dict into the sharded parameters (``nn.Module`` semantics).

        Each entry of a sharded parameter may be a DTensor (redistributed if its placements
        differ), a plain tensor of the global shape (this rank's shard is taken), or a plain
        tensor of this rank's local shard shape; when both shapes are equal the global
        reading wins. ``strict`` and ``assign`` behave as in ``nn.Module``; with ``assign``
        the new tensors become the sharded parameters (tied ones stay tied). Kind (c).

        Args:
            state_dict: the state dict.
            strict: require exactly matching keys.
            assign: assign the loaded tensors instead of copying into the existing ones.

        Returns:
            ``NamedTuple`` with ``missing_keys`` and ``unexpected_keys``.

        See Also:
            :pt:`torch.nn.Module.load_state_dict`: the contract.
        """
        module = cast(nn.Module, self)
        groups = self._groups(True)
        for group in groups:
            group.to_sharded()
        by_param = {p.sharded_param: p for g in groups for p in g.params}
        converted: dict[str, Any] = OrderedDict(state_dict)
        metadata = getattr(state_dict, "_metadata", None)
        if metadata is not None:
            converted._metadata = metadata  # type: ignore[attr-defined]
        for name, param in module.named_parameters(remove_duplicate=False):
            sharded = by_param.get(param)
            if sharded is not None and name in converted:
                value = converted[name]
                if isinstance(value, torch.Tensor):
                    converted[name] = sharded.load_value(value)
        result = super().load_state_dict(converted, strict, assign)  # type: ignore[misc]
        if assign:
            for sharded in by_param.values():
                sharded.readopt()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients, including unreduced accumulations of no-sync micro-batches.

        Clears the sharded parameters' gradients as ``nn.Module.zero_grad`` does, plus the
        unsharded gradients accumulated under ``set_requires_gradient_sync(False)`` and HSDP
        partial reductions, so the next synced backward starts from zero. Kind (c).

        Args:
            set_to_none: set gradients to None instead of zeroing them.

        See Also:
            :pt:`torch.nn.Module.zero_grad`: the contract.
        """
        super().zero_grad(set_to_none)  # type: ignore[misc]
        for group in self._groups(True):
            group.partial_reduce_output = None
            for param in group.params:
                if getattr(param.sharded_param, "main_grad", None) is not None:
                    param.sharded_param.main_grad = None  # type: ignore[attr-defined]
                param.unsharded_accumulated_grad = None
                if param.has_unsharded_param:
                    param.unsharded_param.grad = None

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        self.reshard()
        result = super()._apply(*args, **kwargs)  # type: ignore[misc]
        with torch.no_grad():
            for group in self._get_fsdp_state().groups:
                for param in group.params:
                    param.reset_sharded_param()
        return result


HSDPModule = FSDPModule
"""HyperParallel's name for :class:`FSDPModule` (the same class)."""


def _states_of(modules: Iterable[Any]) -> list[FSDPState]:
    states: list[FSDPState] = []
    for module in modules:
        state = get_state(module) if isinstance(module, nn.Module) else None
        if state is None:
            raise TypeError(
                f"expected modules that hp_fsdp.fully_shard was applied to, got "
                f"{type(module).__name__}"
            )
        states.append(state)
    return states


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    new_cls = _CLS_TO_FSDP_CLS.get(cls)
    if new_cls is None:
        new_cls = type(
            f"FSDP{cls.__name__}", (FSDPModule, cls), {"__deepcopy__": _unimplemented_deepcopy}
        )
        _CLS_TO_FSDP_CLS[cls] = new_cls
    module.__class__ = new_cls


def get_cls_to_fsdp_cls() -> dict[type, type]:
    """The cache of generated classes: original module class to its ``FSDP<Original>`` class.

    Returns:
        The live mapping (shared by all ``fully_shard`` calls in the process).

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fully_shard.get_cls_to_fsdp_cls`.
    """
    return _CLS_TO_FSDP_CLS


@contextlib.contextmanager
def disable_fsdp_module_new_init() -> Iterator[None]:
    """Within the block, constructing an ``FSDP<Original>`` class does not call ``__init__``.

    ``FSDPModule.__new__`` builds the original class (so container indexing returns plain
    modules) and normally initializes it; code that builds instances itself (``copy``-like
    reconstruction) disables that.

    Yields:
        Nothing.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fully_shard.disable_fsdp_module_new_init`.
    """
    token = _NEW_INIT_ENABLED.set(False)
    try:
        yield
    finally:
        _NEW_INIT_ENABLED.reset(token)
