"""Per-``fully_shard`` state: forward/backward hooks, lazy root initialization, prefetching.

See Also:
    :pt:`torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState`: PyTorch's counterpart.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from hp_dtensor.device import Event, is_accelerator
from hp_fsdp._profiling import profile_range
from hp_fsdp._torch_compat import queue_engine_callback
from hp_fsdp.dynamo import run_eagerly
from hp_fsdp.param import ParamOrigin
from hp_fsdp.param_group import ParamGroup, TrainingState
from hp_fsdp.policies import MixedPrecisionPolicy
from hp_fsdp.root_state import ROOTS, RootContext
from hp_fsdp.traversal import collect_tensors, map_tensors

__all__ = ["STATE_ATTR", "FSDPState", "get_state"]

#: Attribute name under which a module keeps its :class:`FSDPState`.
STATE_ATTR = "_hp_fsdp_state"


def get_state(module: nn.Module) -> FSDPState | None:
    """Return the hp-fsdp state of ``module``, or None when it is not a unit.

    Args:
        module: any module.

    Returns:
        Its :class:`FSDPState` or None.

    See Also:
        :pt:`torch.distributed.fsdp.fully_shard.state`: PyTorch's state accessor.
    """
    state = module.__dict__.get(STATE_ATTR)
    return state if isinstance(state, FSDPState) else None


def _cast_floating(dtype: torch.dtype, tensor: torch.Tensor) -> torch.Tensor:
    if not torch.is_floating_point(tensor) or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


class FSDPState:
    """State of one ``fully_shard`` call (one unit).

    Args:
        modules: the unit's modules.
        device: the compute device.
        mp_policy: the mixed-precision policy.
        auto_reshard_after_forward: ``reshard_after_forward`` was None (root keeps unsharded).

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState`.
    """

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        auto_reshard_after_forward: bool,
    ) -> None:
        self.modules = modules
        self.device = device
        self.mp_policy = mp_policy
        self.auto_reshard_after_forward = auto_reshard_after_forward
        #: One group per data-parallel mesh (several when ``shard_placement_fn`` returns a
        #: ``ShardPlacementResult`` on another mesh, e.g. experts), in creation order.
        self.groups: list[ParamGroup] = []
        self.ctx = RootContext()
        self.is_root: bool | None = None
        #: The unit's module names under the root (profiler labels; set at lazy init).
        self.fqn = ""
        self.training_state = TrainingState.IDLE
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        self._modules_to_run: set[nn.Module] = set()
        for module in modules:
            module.__dict__[STATE_ATTR] = self
        if len(modules) == 1:
            modules[0].register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            modules[0].register_forward_hook(self._post_forward, prepend=False)
        else:
            for module in modules:
                module.register_forward_pre_hook(
                    self._group_pre_forward, prepend=True, with_kwargs=True
                )
                module.register_forward_hook(
                    self._group_post_forward_hook(module), prepend=False, always_call=True
                )

    # ------------------------------------------------------------------ lazy init
    def lazy_init(self) -> None:
        """Make the first state to run forward the root of every state below it."""
        if self.is_root is not None:
            return
        self.is_root = True
        ROOTS.add(self.ctx)
        if len(self.modules) != 1:
            raise RuntimeError(
                "the root of fully_shard must be a single module, got a list-of-modules unit "
                f"{[type(m).__name__ for m in self.modules]}; apply fully_shard to the parent"
            )
        ctx = self.ctx
        root_module = self.modules[0]
        seen: set[int] = set()
        for name, module in root_module.named_modules():
            state = get_state(module)
            if state is None:
                continue
            if module is not root_module and id(state) not in seen:
                if state.is_root is not None:
                    raise RuntimeError(
                        f"fully_shard state of {name!r} was already initialized; run the "
                        "forward of the root module first"
                    )
                state.is_root = False
            if id(state) not in seen:
                seen.add(id(state))
                ctx.states.append(state)
        if self.auto_reshard_after_forward:
            for group in self.groups:
                group.reshard_after_forward = False
                group.post_forward_info = None
        owners: dict[ParamOrigin, str] = {}
        fqns = {p: n for n, p in root_module.named_parameters()}
        module_names = {m: n for n, m in root_module.named_modules()}
        for state in ctx.states:
            state.ctx = ctx
            unit_fqn = ", ".join(module_names.get(m, "?") for m in state.modules)
            state.fqn = unit_fqn
            for group in state.groups:
                group.fqn = unit_fqn
                if len(state.groups) > 1:
                    group.fqn += f" [{group.mesh_info.mesh_label}]"
                for param in group.params:
                    param.fqn = fqns.get(param.sharded_param, param.fqn)
                    if param.origin in owners:
                        raise ValueError(
                            f"Parameter {param.fqn!r} is shared with a parameter already managed "
                            f"by another FSDP group ({owners[param.origin]!r}); for tied "
                            "parameters use fully_shard([module_a, module_b]) to place them in "
                            "one unit"
                        )
                    owners[param.origin] = group.fqn
        for state in ctx.states:
            for group in state.groups:
                group.lazy_init(ctx)

    # ------------------------------------------------------------------ forward
    def _root_pre_forward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.lazy_init()
        ctx = self.ctx
        if ctx.iter_forward_root is not None:
            return args, kwargs
        ctx.iter_forward_root = self
        ctx.current_forward_order = []
        with profile_range("FSDP::root_pre_forward"):
            streams = ctx.comm.streams_for(self.device)
            event = ctx.post_optim_event
            if not streams.active:  # no streams (CPU): program order
                ctx.post_optim_event = None
            elif event is not None:  # set_post_optim_event: wait for that event only
                ctx.post_optim_event = None
                if not isinstance(event, Event):
                    event = Event.from_native(event)
                streams.copy_in.wait_event(event)
                streams.all_gather.wait_event(event)
            else:  # the optimizer step ran on the compute stream
                compute = streams.current()
                streams.copy_in.wait_stream(compute)
                streams.all_gather.wait_stream(compute)
            if is_accelerator(self.device) and (args or kwargs):
                device = self.device
                with profile_range("FSDP::inputs_to_device"):
                    args, kwargs = map_tensors(lambda t: t.to(device), (args, kwargs))
            return args, kwargs

    def _cast_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        dtype = self.mp_policy.param_dtype
        if not self.mp_policy.cast_forward_inputs or dtype is None:
            return args, kwargs
        cast = functools.partial(_cast_floating, dtype)
        with profile_range("FSDP::cast_forward_inputs"):
            new_args, new_kwargs = map_tensors(cast, (args, kwargs))
        return new_args, new_kwargs

    def _cast_output(self, output: Any) -> Any:
        dtype = self.mp_policy.output_dtype
        if dtype is None:
            return output
        with profile_range("FSDP::cast_forward_outputs"):
            return map_tensors(functools.partial(_cast_floating, dtype), output)

    @run_eagerly
    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.training_state == TrainingState.PRE_BACKWARD:
            # Recomputation inside backward (activation checkpointing): just make sure the
            # parameters are unsharded.
            for group in self.groups:
                if not group.is_unsharded:
                    group.unshard()
                    group.wait_for_unshard()
            return self._cast_inputs(args, kwargs)
        first_in_pass = self.training_state != TrainingState.FORWARD
        self.training_state = TrainingState.FORWARD
        if first_in_pass:
            args, kwargs = self._root_pre_forward(args, kwargs)
        args, kwargs = self._cast_inputs(args, kwargs)
        for group in self.groups:
            group.unshard(group.options.unshard_async_op)  # issue every group's all-gather first
        for group in self.groups:
            args, kwargs = group.pre_forward(args, kwargs)
        if first_in_pass:
            self._forward_prefetch()
        return args, kwargs

    def _forward_prefetch(self) -> None:
        ctx = self.ctx
        position = len(ctx.current_forward_order)
        if self.groups:
            ctx.current_forward_order.append(self)
        if self.forward_prefetch is not None:
            for state in self.forward_prefetch:
                with profile_range(f"FSDP::forward_prefetch for {state.fqn}"):
                    state.prefetch(TrainingState.FORWARD)
            return
        if not self.groups:
            return
        target = self._next_unit(position)
        if target is not None and target is not self:  # implicit: no range of its own
            for group in target.groups:
                group.unshard(True)

    def _next_unit(self, position: int) -> FSDPState | None:
        """The unit to prefetch after this one's pre-forward.

        From the second iteration on: the unit that followed this one in the previous
        iteration's forward order (when that order still holds). In the first iteration there
        is no order yet, so the next unit with parameters in module registration order is
        prefetched, so that the first iteration overlaps too.
        """
        ctx = self.ctx
        previous = ctx.forward_order
        if previous:
            if position + 1 < len(previous) and previous[position] is self:
                return previous[position + 1]
            return None
        if self not in ctx.states:
            return None  # a unit run on its own
        later = ctx.states[ctx.states.index(self) + 1 :]
        return next((state for state in later if state.groups), None)

    def prefetch(self, training_state: TrainingState) -> None:
        """Issue the all-gathers of every group of this unit (explicit prefetching).

        Args:
            training_state: the pass the prefetch belongs to (forward or pre-backward).
        """
        for group in self.groups:
            with group.use_training_state(training_state):
                group.unshard(True)

    @run_eagerly
    def _post_forward(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        if self.training_state == TrainingState.PRE_BACKWARD:
            return self._cast_output(output)
        for group in self.groups:
            group.post_forward()
        output = self._register_pre_backward(output)
        self.training_state = TrainingState.IDLE
        ctx = self.ctx
        if ctx.iter_forward_root is self:
            output = self._complete_partial_units(output)
            ctx.forward_order = ctx.current_forward_order
            ctx.current_forward_order = []
            for state in ctx.states:
                for group in state.groups:
                    if group.has_pending_all_gather:
                        group.drop_pending_all_gather()
            ctx.free_all_gather_state()  # the last unit's buffers
            ctx.iter_forward_root = None
        return self._cast_output(output)

    def _complete_partial_units(self, output: Any) -> Any:
        for state in reversed(self.ctx.states):
            if state is self or not state._modules_to_run:
                continue
            for group in state.groups:
                group.post_forward()
            output = state._register_pre_backward(output)
            state.training_state = TrainingState.IDLE
            output = state._cast_output(output)
            state._modules_to_run.clear()
        return output

    @run_eagerly
    def _group_pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not self._modules_to_run:
            self._modules_to_run.update(self.modules)
        return self._pre_forward(module, args, kwargs)

    def _group_post_forward_hook(self, module: nn.Module) -> Callable[[nn.Module, Any, Any], Any]:
        @run_eagerly
        def hook(hook_module: nn.Module, inputs: Any, output: Any) -> Any:
            if module in self._modules_to_run:
                self._modules_to_run.discard(module)
                if not self._modules_to_run:
                    return self._post_forward(hook_module, inputs, output)
            return self._cast_output(output)

        return hook

    def _register_pre_backward(self, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return output

        for tensor in collect_tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(self._pre_backward)  # type: ignore[no-untyped-call]
        return output

    # ------------------------------------------------------------------ backward
    @run_eagerly
    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        self.training_state = TrainingState.PRE_BACKWARD
        self.queue_final_callback()
        # Once per backward per group (this hook fires for every output tensor): issue every
        # group's all-gather before waiting for any.
        fresh = [g for g in self.groups if g.training_state != TrainingState.PRE_BACKWARD]
        for group in fresh:
            group.start_pre_backward()
        for group in fresh:
            group.finish_pre_backward()
        if self.backward_prefetch is not None:
            for state in self.backward_prefetch:
                with profile_range(f"FSDP::backward_prefetch for {state.fqn}"):
                    state.prefetch(TrainingState.PRE_BACKWARD)
        elif fresh:
            self._default_backward_prefetch(fresh)
        return grad

    def _default_backward_prefetch(self, groups: list[ParamGroup]) -> None:
        """Prefetch the unit whose forward finished just before this one's (all its groups)."""
        indices = [i for i in (g.pop_post_forward_index() for g in groups) if i is not None]
        if not indices:
            return
        order = self.ctx.post_forward_order
        index = min(indices) - 1
        if index < 0:
            return
        modules = order[index].modules
        while index >= 0 and order[index].modules is modules:
            target = order[index]
            with (
                profile_range(f"FSDP::backward_prefetch for {target.fqn}"),
                target.use_training_state(TrainingState.PRE_BACKWARD),
            ):
                target.unshard(target.options.unshard_async_op)
            index -= 1

    def queue_final_callback(self) -> None:
        """Queue the end-of-backward callback of this state's root once per backward.

        Called from every unit's pre-backward and from a unit's post-backward: a member of a
        list-of-modules unit run on its own (``head(x)`` after a forward that skipped it) has
        no pre-backward hook, yet its reduction must finish in that backward, as in PyTorch.
        """
        ctx = self.ctx
        if not ctx.callback_queued:
            ctx.callback_queued = True
            root = ctx.states[0] if ctx.states else self
            queue_engine_callback(root._final_callback)

    @run_eagerly
    def _final_callback(self) -> None:
        with profile_range("FSDP::root_post_backward_callback"):
            self._finish_backward()

    def _finish_backward(self) -> None:
        ctx = self.ctx
        ctx.iter_forward_root = None
        for state in ctx.states:
            state._modules_to_run.clear()
            # Last group first: the order backward reaches them (inputs wrapped by each group).
            for group in reversed(state.groups):
                if group.training_state != TrainingState.POST_BACKWARD:
                    group.post_backward()
                group.training_state = TrainingState.IDLE
            state.training_state = TrainingState.IDLE
            if ctx.is_last_backward:
                for group in state.groups:
                    group.finalize_backward()
        if ctx.is_last_backward:
            ctx.finish_reductions()
            ctx.post_forward_order.clear()
        ctx.callback_queued = False

    # ------------------------------------------------------------------ recovery
    @run_eagerly
    def reset_iter_state(self) -> None:
        """Recover after an exception aborted a forward or backward (root only).

        Waits for in-flight all-gathers, discards in-flight gradient reductions (the failed
        iteration's gradients, HSDP partial reductions and no-sync accumulations are lost),
        reshards every unit and clears the per-iteration trackers.

        Raises:
            RuntimeError: when called on a unit that is not the root.
        """
        if self.is_root is False:
            raise RuntimeError(
                "reset_iter_state must be called on the root fully_shard module (the module "
                "whose forward runs first), not on a nested unit"
            )
        ctx = self.ctx
        for reduction in ctx.pending_reductions:
            reduction.discard()
        ctx.pending_reductions = []
        ctx.free_all_gather_state()
        ctx.post_reduce_events.clear()
        ctx.host_copy_events.clear()
        ctx.post_forward_order.clear()
        ctx.current_forward_order = []
        states = ctx.states or [self]
        for state in states:
            state._modules_to_run.clear()
            state.training_state = TrainingState.IDLE
            for group in state.groups:
                group.reset_iter_state()
        ctx.iter_forward_root = None
        ctx.callback_queued = False
