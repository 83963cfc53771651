"""One ``fully_shard`` unit: its parameters, unshard/reshard, and gradient reduction.

A unit all-gathers all its parameters with one collective and reduce-scatters all their
gradients with one collective (plus one all-reduce over the replicate axis for HSDP).

See Also:
    :pt:`torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup`: PyTorch's class.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function

from hp_dtensor.device import DEVICE_TYPE_CPU, DEVICE_TYPE_META
from hp_fsdp._profiling import NO_RANGE, profiler_enabled
from hp_fsdp._torch_compat import (
    current_graph_task_id,
    disable_functorch,
    functorch_transforms_active,
    unsafe_preserve_version_counter,
)
from hp_fsdp.collectives import (
    AllGatherResult,
    AllGatherState,
    discard_all_gather,
    divide_factors,
    issue_all_gather,
    issue_reduce_scatter,
    reduce_scatter_in_place,
    wait_all_gather,
)
from hp_fsdp.dynamo import run_eagerly
from hp_fsdp.group_options import GroupOptions
from hp_fsdp.mesh_info import DataParallelMeshDims, MeshInfo, PostForwardInfo, _dim_names
from hp_fsdp.param import (
    ParamModuleInfo,
    ShardedParam,
    ShardedState,
    register_sharded,
    register_unsharded,
    unsharded_outs,
)
from hp_fsdp.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from hp_fsdp.post_backward import PostBackwardTrigger
from hp_fsdp.reduction import PendingReduction, pack_layouts
from hp_fsdp.reshard_policy import resolve_reshard_after_forward
from hp_fsdp.streams import CommStreams
from hp_fsdp.training_state import TrainingState
from hp_fsdp.traversal import collect_tensors, map_tensors

if TYPE_CHECKING:
    from hp_fsdp.root_state import RootContext

__all__ = [
    "GroupOptions",
    "ParamGroup",
    "PendingReduction",
    "TrainingState",
    "resolve_reshard_after_forward",
]

_log = logging.getLogger("hp_fsdp")


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _outside_functorch(method: _Method) -> _Method:
    """Run ``method`` with functorch transforms (``torch.func.jvp``, ``vmap``) switched off.

    Communication buffers are plain tensors whose storage is freed and refilled; inside a
    transform they would be wrapped, and wrappers have no storage.
    """

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not functorch_transforms_active():
            return method(*args, **kwargs)
        with disable_functorch():
            return method(*args, **kwargs)

    return cast(_Method, run)


def _param_module_infos(
    params: list[nn.Parameter], modules: tuple[nn.Module, ...]
) -> list[ParamModuleInfo]:
    """Where each parameter is registered (first registration, plus tied ones)."""
    wanted = set(params)
    infos: dict[nn.Parameter, ParamModuleInfo] = {}
    for root in modules:
        for sub in root.modules():
            for name, param in list(sub._parameters.items()):
                if param is None or param not in wanted:
                    continue
                info = infos.get(param)
                if info is None:
                    infos[param] = ParamModuleInfo(sub, name)
                elif (sub, name) != (info.module, info.name):
                    info.shared.append((sub, name))
    return [infos[p] for p in params]


def _replicate_mesh_info(mesh_info: MeshInfo) -> MeshInfo:
    """The mesh info of ``replicate_params``: kept whole, all-reduced over every DP rank."""
    dims = mesh_info.dp_mesh_dims
    if dims is None:
        return MeshInfo(mesh_info.mesh, replicate_only=True)
    every_dp_dim = (*_dim_names(dims.replicate), *_dim_names(dims.shard))
    return MeshInfo(
        mesh_info.mesh,
        replicate_only=True,
        spmd_mesh=mesh_info.spmd_mesh,
        dp_mesh_dims=DataParallelMeshDims(replicate=every_dp_dim),
    )


class ParamGroup:
    """The parameters of one ``fully_shard`` call and their communication.

    Args:
        params: the parameters, in the unit's order.
        modules: the unit's modules (one, or several for a list-of-modules unit).
        mesh_info: the data-parallel mesh.
        device: the compute device.
        reshard_after_forward: resolved policy (bool or int k).
        shard_dims: one shard dim per parameter.
        mp_policy: the mixed-precision policy.
        offload_policy: the offload policy.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup`.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        modules: tuple[nn.Module, ...],
        mesh_info: MeshInfo,
        device: torch.device,
        reshard_after_forward: bool | int,
        shard_dims: list[int],
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
        replicated: frozenset[nn.Parameter] = frozenset(),
    ) -> None:
        offload = isinstance(offload_policy, CPUOffloadPolicy)
        #: CPU offload: the shards are copied to the device before the all-gather.
        self._offload = offload
        replicate_info = _replicate_mesh_info(mesh_info) if replicated else None
        pin = offload and isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory
        infos = _param_module_infos(params, modules)
        self.params = [
            ShardedParam(
                p,
                info,
                replicate_info if replicate_info is not None and p in replicated else mesh_info,
                device,
                dim,
                offload,
                pin,
            )
            for p, info, dim in zip(params, infos, shard_dims, strict=True)
        ]
        # replicate_params: kept whole, all-reduced; the others are gathered and reduce-scattered
        self._gathered = [p for p in self.params if not p.mesh_info.replicate_only]
        self._replicated = [p for p in self.params if p.mesh_info.replicate_only]
        #: A gathered parameter has an all-gather extension (fixed at construction).
        self._extended = any(p.extension is not None for p in self._gathered)
        #: Every parameter is sharded on dim 0: gradients are packed as they are.
        self._dim0_only = all(p.shard_dim == 0 for p in self.params)
        self._local_pending = False
        if not isinstance(reshard_after_forward, bool) and any(
            p.is_tensor_parallel for p in self.params
        ):
            raise NotImplementedError(
                "reshard_after_forward as an int is not supported with DTensor (tensor-parallel) "
                "parameters; use True or False"
            )
        self.modules = modules
        self.mesh_info = mesh_info
        self.device = device
        self.mp_policy = mp_policy
        self.offload_policy = offload_policy
        self.reshard_after_forward: bool | int = reshard_after_forward
        #: Per-unit settings, replaced as a whole by :meth:`configure` (FSDPModule setters).
        self.options = GroupOptions()
        self.post_forward_info: PostForwardInfo | None = None
        self.ctx: RootContext | None = None
        self.training_state = TrainingState.IDLE
        self.sharded_state = ShardedState.SHARDED
        self.partial_reduce_output: torch.Tensor | None = None
        self.orig_dtype: torch.dtype | None = None
        self.reduce_dtype: torch.dtype | None = None
        self.fqn = ""
        self._ag: AllGatherResult | None = None
        self._ag_parts: list[AllGatherResult] = []  # comm_fusion=False: one per parameter
        self._flat_shard: torch.Tensor | None = None
        self._ag_from_post_forward = False
        self._ag_bytes = False
        #: What each gathered parameter contributed to the pending all-gather.
        self._ag_inputs: list[list[torch.Tensor]] = []
        self._own_streams: CommStreams | None = None
        self._post_forward_indices: list[int] = []
        #: Per reduce-scatter group: whether its backend reduces in place.
        self._rs_in_place: dict[dist.ProcessGroup, bool] = {}
        self._initialized = False
        self._register_state_dict_hooks()

    def _register_state_dict_hooks(self) -> None:
        """Reshard before a state dict is saved or loaded through any module holding a parameter.

        After a forward under ``no_grad`` (or with ``reshard_after_forward=False``) the
        unsharded parameters are registered; saving must still see the sharded DTensors, and
        loading (also through a parent that is not a fully_shard module) must write into them.
        """
        holders = dict.fromkeys(
            m
            for p in self.params
            for m in (p.module_info.module, *(shared for shared, _ in p.module_info.shared))
        )

        def to_sharded_hook(*args: Any, **kwargs: Any) -> None:
            self.to_sharded()

        for module in holders:
            module.register_state_dict_pre_hook(to_sharded_hook)  # type: ignore[no-untyped-call]
            module._register_load_state_dict_pre_hook(to_sharded_hook)  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------ init
    def lazy_init(self, ctx: RootContext | None) -> None:
        """Finish initialization once the model's parallelism is final (idempotent).

        Args:
            ctx: the root context (None when unsharding before the first forward).

        Raises:
            RuntimeError: when parameters are still on the meta device, or not on the CPU
                under CPU offload.
            ValueError: for non-uniform original or reduce dtypes among trainable parameters.
        """
        if ctx is not None and self.ctx is not ctx:
            self.ctx = ctx
            k = self.reshard_after_forward
            if not isinstance(k, bool):
                self.post_forward_info = ctx.post_forward_info(self.mesh_info, k)
        if self._initialized:
            return
        for param in self.params:
            param.reset_sharded_param()
        on_meta = [p.fqn for p in self.params if p.sharded_param.device.type == DEVICE_TYPE_META]
        if on_meta:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, but "
                f"the following were still on meta device: {on_meta}; call "
                "module.to_empty(device=...) and initialize them (e.g. "
                "hp_dtensor.init_parameters) first"
            )
        if isinstance(self.offload_policy, CPUOffloadPolicy):
            off_cpu = [p.fqn for p in self.params if p.sharded_param.device.type != DEVICE_TYPE_CPU]
            if off_cpu:
                raise RuntimeError(
                    f"CPU offload needs the sharded parameters on the CPU, but {off_cpu} are not"
                )
        mp = self.mp_policy
        for param in self.params:
            param.init_dtypes(mp.param_dtype, mp.reduce_dtype)
            param.mp_policy = mp
        trainable = [p for p in self.params if p.sharded_param.requires_grad]
        orig = {p.orig_dtype for p in trainable}
        reduce = {p.reduce_dtype for p in trainable}
        if len(orig) > 1:
            raise ValueError(
                f"fully_shard needs one dtype for the trainable parameters of a unit, got {orig}"
            )
        if len(reduce) > 1:
            raise ValueError(
                f"fully_shard needs one reduce dtype for the parameters of a unit, got {reduce}"
            )
        self.orig_dtype = next(iter(orig)) if trainable else None
        self.reduce_dtype = next(iter(reduce)) if trainable else None
        self._initialized = True
        if self.options.comm_fusion_zero_copy:
            self._init_flat_shard()

    @torch.no_grad()
    def _init_flat_shard(self) -> None:
        """Move every padded local shard into one flat buffer (the all-gather input)."""
        dtypes = {p.padded_shard.dtype for p in self.params}
        if len(dtypes) != 1 or any(p.offload_to_cpu or p.extension for p in self.params):
            raise ValueError(
                "comm_fusion_zero_copy needs one parameter dtype per unit, no CPU offload and no "
                f"fsdp_pre_all_gather tensor subclass, got dtypes {dtypes}"
            )
        total = sum(p.padded_sharded_numel for p in self.params)
        flat = torch.empty(total, dtype=dtypes.pop(), device=self.device)
        offset = 0
        for param in self.params:
            param.rebase_padded_shard(flat.narrow(0, offset, param.padded_sharded_numel))
            offset += param.padded_sharded_numel
        self._flat_shard = flat

    def _zero_copy_input(self) -> torch.Tensor | None:
        """The flat shard buffer when it can be all-gathered as is, else None."""
        flat = self._flat_shard
        if (
            flat is None
            or self.options.custom_all_gather is not None
            or not self.options.comm_fusion
        ):
            return None
        if self._replicated or self._ag_bytes:
            return None
        if self.params[0].compute_dtype != flat.dtype:
            return None
        ptr = flat.untyped_storage().data_ptr()
        if any(p.padded_shard.untyped_storage().data_ptr() != ptr for p in self.params):
            return None  # a shard was re-materialized (to_empty, load with assign)
        return flat

    # ------------------------------------------------------------------ unshard
    @property
    def is_unsharded(self) -> bool:
        """Whether the unsharded parameters are registered."""
        return self.sharded_state == ShardedState.UNSHARDED

    @property
    def has_pending_all_gather(self) -> bool:
        """Whether an all-gather was issued and not yet waited for."""
        return self._ag is not None

    @_outside_functorch
    def unshard(self, async_op: bool = False) -> None:
        """Issue this unit's all-gather (a no-op when unsharded or already issued).

        Args:
            async_op: kept for PyTorch's signature; the collective is always issued
                asynchronously and waited for in :meth:`wait_for_unshard`.
        """
        if self._ag is not None or self._local_pending or self.is_unsharded or not self.params:
            return
        if (
            self.training_state == TrainingState.PRE_BACKWARD
            and not self.options.unshard_in_backward
        ):
            return  # set_unshard_in_backward(False): backward reads no parameter values
        self._local_pending = bool(self._replicated)
        if not self._gathered:
            return
        with self.profile_range("FSDP::all_gather"):
            self._issue_all_gather()

    def _issue_all_gather(self) -> None:
        from_post_forward = self.sharded_state == ShardedState.SHARDED_POST_FORWARD
        if from_post_forward:
            assert self.post_forward_info is not None
            group = self.post_forward_info.group
            world_size, rank = self.post_forward_info.size, self.post_forward_info.rank
        else:
            group = self.mesh_info.shard_group
            world_size, rank = self.mesh_info.shard_size, self.mesh_info.shard_rank
        dtype = self._gathered[0].compute_dtype
        streams = self.comm_streams()
        active = streams if streams.active else None
        # Parameters gathered in several dtypes (e.g. frozen low-precision weights beside
        # trainable ones, or a tensor subclass's int8 data and fp32 scale) travel as raw
        # bytes in one collective, as in PyTorch.
        self._ag_bytes = self._extended or (
            len({p.compute_dtype for p in self._gathered}) > 1 and self.options.comm_fusion
        )
        with streams.on(streams.copy_in):  # host-to-device copies and casts off compute
            if from_post_forward or self._extended or self._offload:
                per_param = [p.all_gather_inputs() for p in self._gathered]
            else:  # the padded shards as they are (ShardedParam.all_gather_inputs, inlined)
                per_param = [[p._padded_shard] for p in self._gathered]
            self._ag_inputs = per_param
            if self._ag_bytes:
                per_param = [
                    [
                        (t if p.extension is not None else t.to(p.compute_dtype)).view(torch.uint8)
                        for t in inputs
                    ]
                    for p, inputs in zip(self._gathered, per_param, strict=True)
                ]
                dtype = torch.uint8
            inputs = [t for ts in per_param for t in ts]
        if not self.options.comm_fusion:  # one collective per parameter (debugging)
            self._ag_parts = [
                issue_all_gather(
                    inps,
                    torch.uint8 if self._ag_bytes else p.compute_dtype,
                    group,
                    world_size,
                    rank,
                    self.device,
                    True,
                    self.options.custom_all_gather,
                    streams=active,
                )
                for p, inps in zip(self._gathered, per_param, strict=True)
            ]
            self._ag = self._ag_parts[0]
        elif (flat := self._zero_copy_input()) is not None and not from_post_forward:
            with streams.on(streams.all_gather):  # no copy-in: gather the shards as they are
                streams.mark("all_gather")
                output = torch.empty(
                    world_size * flat.numel(), dtype=flat.dtype, device=flat.device
                )
                work = dist.all_gather_single(output, flat, group=group, async_op=True)
                work = streams.order_on_stream(work)
            event = (
                streams.all_gather.record_event(streams.new_event("all_gather"))
                if streams.active
                else None
            )
            splits = [p.padded_sharded_numel for p in self._gathered]
            self._ag = AllGatherResult(output, splits, world_size, work, event)
        else:
            self._ag = issue_all_gather(
                inputs,
                dtype,
                group,
                world_size,
                rank,
                self.device,
                True,
                self.options.custom_all_gather,
                streams=active,
            )
        self._ag_from_post_forward = from_post_forward

    @_outside_functorch
    def wait_for_unshard(self) -> None:
        """Wait for the issued all-gather and register the unsharded parameters."""
        result = self._ag
        if result is None and not self._local_pending:
            return
        self._ag = None
        if self._local_pending:
            self._local_pending = False
            self._copy_replicated()
        if result is not None:
            with self.profile_range("FSDP::all_gather_copy_out"):
                self._wait_gathered(result)
        register_unsharded(self.params)
        self.sharded_state = ShardedState.UNSHARDED

    @torch.no_grad()
    def _copy_replicated(self) -> None:
        """The unsharded data of replicated parameters: a local copy in the compute dtype."""
        for param in self._replicated:
            if param.extension is not None:  # the subclass's inputs, as a one-rank all-gather
                inputs = param.all_gather_inputs()
                outs = param.all_gather_outputs(inputs, 1)
                with unsafe_preserve_version_counter(tuple(outs)):
                    for gathered, local in zip(outs, inputs, strict=True):
                        gathered.copy_(local)
                continue
            out = param.unsharded_out(1)
            with unsafe_preserve_version_counter((out,)):
                out.copy_(param.all_gather_input())

    def _wait_gathered(self, result: AllGatherResult) -> None:
        """Copy the gathered data out; free the buffers by event waits (see collectives)."""
        streams = self.comm_streams()
        ctx = self.ctx
        ordered = streams.active
        keep = ordered and ctx is not None and self.training_state == TrainingState.FORWARD
        if keep:  # the previous unit's buffers: free them before this copy-out
            assert ctx is not None
            ctx.free_all_gather_state()
        results = self._ag_parts or [result]
        self._copy_out(result)
        if not ordered:  # no device streams: program order; the buffers die here
            return
        event = streams.current().record_event(streams.new_event("all_gather_copy_out"))
        state = AllGatherState(list(results), event)
        if keep:  # kept until the next unit's copy-out, which overlaps this unit's all-gather
            assert ctx is not None
            ctx.all_gather_state = state
        else:
            state.free(streams)

    def _copy_out(self, result: AllGatherResult) -> None:
        world_size = result.world_size
        if (
            not self._extended
            and not self._ag_bytes
            and not self._ag_parts
            and (self._dim0_only or self._ag_from_post_forward)
        ):  # every parameter's buffer is written as it is (the common case, one call)
            self._ag_inputs = []
            wait_all_gather(result, unsharded_outs(self._gathered))
            return
        outs: list[list[torch.Tensor]] = []
        regroup: list[tuple[ShardedParam, torch.Tensor, torch.Tensor]] = []
        inputs, self._ag_inputs = self._ag_inputs, []
        for param, param_inputs in zip(self._gathered, inputs, strict=True):
            param_outs = (
                [param.unsharded_out(world_size)]
                if param.extension is None
                else param.all_gather_outputs(param_inputs, world_size)
            )
            if param.shard_dim != 0 and not self._ag_from_post_forward:
                (out,) = param_outs
                staging = torch.empty_like(out)
                regroup.append((param, staging, out))
                param_outs = [staging]
            outs.append([o.view(torch.uint8) for o in param_outs] if self._ag_bytes else param_outs)
        if self._ag_parts:
            parts, self._ag_parts = self._ag_parts, []
            for part, param_outs in zip(parts, outs, strict=True):
                wait_all_gather(part, param_outs)
        else:
            wait_all_gather(result, [o for param_outs in outs for o in param_outs])
        if regroup:
            with (
                torch.no_grad(),
                unsafe_preserve_version_counter(tuple(t for _, _, t in regroup)),
            ):
                for param, staging, target in regroup:
                    blocks = staging.view(world_size, *param.padded_sharded_size).unbind(0)
                    if any(
                        param.chunk_length(r) != block.size(param.shard_dim)
                        for r, block in enumerate(blocks)
                    ):  # uneven split of an inner dim: drop each chunk's padding
                        blocks = tuple(
                            block.narrow(param.shard_dim, 0, param.chunk_length(r))
                            for r, block in enumerate(blocks)
                        )
                    full = param.orig_size
                    torch.cat(blocks, dim=param.shard_dim, out=target[: full.numel()].view(full))

    def drop_pending_all_gather(self) -> None:
        """Wait for a prefetched all-gather that will not be used and discard it."""
        self._local_pending = False
        result = self._ag
        if result is None:
            return
        self._ag = None
        self._ag_inputs = []
        parts, self._ag_parts = self._ag_parts or [result], []
        streams = self.comm_streams()
        for part in parts:
            discard_all_gather(part, streams)

    @_outside_functorch
    def reshard(self) -> None:
        """Free the unsharded parameters (after forward: per ``reshard_after_forward``)."""
        if self.training_state == TrainingState.FORWARD:
            if self.reshard_after_forward is False:
                return
            info = self.post_forward_info
            if info is not None and not isinstance(self.reshard_after_forward, bool):
                if self.is_unsharded:
                    for param in self.params:
                        param.to_sharded_post_forward(info.size, info.rank)
                    self.sharded_state = ShardedState.SHARDED_POST_FORWARD
                return
        self.to_sharded()

    @_outside_functorch
    def to_sharded(self) -> None:
        """Register the sharded parameters and free all unsharded storage."""
        if self.sharded_state == ShardedState.SHARDED:
            return
        register_sharded(self.params)
        self.sharded_state = ShardedState.SHARDED

    @contextlib.contextmanager
    def use_training_state(self, state: TrainingState) -> Iterator[None]:
        """Temporarily set the training state.

        Args:
            state: the state inside the block.

        Yields:
            Nothing.
        """
        old = self.training_state
        self.training_state = state
        try:
            yield
        finally:
            self.training_state = old

    # ------------------------------------------------------------------ forward
    def pre_forward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Unshard, and hook the inputs so that backward reaches :meth:`post_backward`.

        Args:
            args: forward positional inputs.
            kwargs: forward keyword inputs.

        Returns:
            The inputs (tensors that need grad wrapped by the post-backward trigger).
        """
        with self.profile_range("FSDP::pre_forward"):
            entering = self.training_state != TrainingState.FORWARD
            self.training_state = TrainingState.FORWARD
            self.unshard(self.options.unshard_async_op)
            self.wait_for_unshard()
            if entering and torch.is_grad_enabled():
                args, kwargs = self._register_post_backward(args, kwargs)
            return args, kwargs

    def _register_post_backward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        inputs = [t for t in collect_tensors((args, kwargs)) if t.requires_grad]
        if not inputs:
            return args, kwargs
        outs = iter(PostBackwardTrigger.apply(self, *inputs))  # type: ignore[no-untyped-call]
        new_args, new_kwargs = map_tensors(
            lambda t: next(outs) if t.requires_grad else t, (args, kwargs)
        )
        return new_args, new_kwargs

    def post_forward(self) -> None:
        """Reshard per policy and record the post-forward order (outside backward)."""
        if current_graph_task_id() == -1:
            with self.profile_range("FSDP::post_forward"):
                self.reshard()
                ctx = self.ctx
                if ctx is not None and torch.is_grad_enabled():  # no backward after no_grad
                    self._post_forward_indices.append(len(ctx.post_forward_order))
                    ctx.post_forward_order.append(self)
        self.training_state = TrainingState.IDLE

    # ------------------------------------------------------------------ backward
    def start_pre_backward(self) -> None:
        """Enter backward (once per backward): issue the all-gather unless told not to."""
        self.training_state = TrainingState.PRE_BACKWARD
        if self.options.unshard_in_backward:
            with self.profile_range("FSDP::pre_backward"):
                self.unshard()

    def finish_pre_backward(self) -> None:
        """Wait for the all-gather issued by :meth:`start_pre_backward`."""
        if self.options.unshard_in_backward:
            with self.profile_range("FSDP::pre_backward"):
                self.wait_for_unshard()

    def pop_post_forward_index(self) -> int | None:
        """This group's latest position in the root's post-forward order (None: not recorded).

        Returns:
            The index into ``ctx.post_forward_order``, removed from this group's record.
        """
        if not self._post_forward_indices or self.ctx is None:
            return None
        return self._post_forward_indices.pop()

    def configure(self, **changes: Any) -> None:
        """Replace :attr:`options` by a copy with ``changes`` (names of :class:`GroupOptions`).

        Args:
            **changes: the settings to change.
        """
        self.options = dataclasses.replace(self.options, **changes)

    def comm_streams(self) -> CommStreams:
        """The root's communication streams (own no-op/new streams before lazy init).

        Returns:
            The streams.
        """
        if self.ctx is not None:
            return self.ctx.comm.streams_for(self.device)
        if self._own_streams is None:
            self._own_streams = CommStreams.for_device(self.device)
        return self._own_streams

    def profile_range(self, label: str) -> AbstractContextManager[object]:
        """A profiler range named like PyTorch's (``"FSDP::pre_forward (layers.0)"``).

        Args:
            label: PyTorch's label, e.g. ``"FSDP::all_gather"``.

        Returns:
            The ``torch.profiler.record_function`` context while a profiler records, else a
            shared no-op context (no op dispatched, no label built).
        """
        if not profiler_enabled():
            return NO_RANGE
        return record_function(f"{label} ({self.fqn})" if self.fqn else label)

    @run_eagerly
    def post_backward(self) -> None:
        """Reshard and reduce this unit's gradients (idempotent within one backward)."""
        self.training_state = TrainingState.POST_BACKWARD
        with self.profile_range("FSDP::post_backward_accumulate"):
            for param in self.params:
                if param.unsharded_accumulated_grad is not None:
                    param.accumulate_unsharded_grad_if_needed()
        with self.profile_range("FSDP::post_backward_reshard"):
            taken = self._take_grads_and_reshard()
        if taken is None:
            return
        ctx = self.ctx
        if ctx is not None and not ctx.callback_queued and ctx.states:
            # No pre-backward hook ran (a list unit's member used on its own): the root's
            # end-of-backward callback still finishes this backward's reductions.
            ctx.states[0].queue_final_callback()
        if ctx is not None and ctx.pending_reductions:
            with (  # PyTorch's label keeps the parentheses for the root (empty fqn)
                record_function(f"FSDP::post_backward_rs_wait ({self.fqn})")
                if profiler_enabled()
                else NO_RANGE
            ):
                ctx.advance_reductions(self.options.max_inflight_reductions)
        with_grad, grads = taken
        del taken  # ``grads`` is the only reference: the copy-in frees each gradient
        if not grads:
            return
        with self.profile_range("FSDP::post_backward_reduce"):
            self._issue_reductions(with_grad, grads)

    def _take_grads_and_reshard(
        self,
    ) -> tuple[list[ShardedParam], list[torch.Tensor]] | None:
        """Take the unsharded gradients to reduce and reshard (None: no reduction this time)."""
        if not self.options.reduce_grads and not self.options.sharded_accumulated_grad:
            if self.options.reshard_after_backward:
                self.to_sharded()
            for param in self.params:
                param.to_accumulated_grad_if_needed()
            return None
        with_grad: list[ShardedParam] = []
        grads: list[torch.Tensor] = []
        for param in self.params:
            if param._unsharded_param is None:  # not unsharded yet (has_unsharded_param)
                continue
            grad = param.take_unsharded_grad()
            if grad is None and self.options.reduce_scatter_unused_params:
                if not param.sharded_param.requires_grad:
                    continue
                grad = torch.zeros(param.orig_size, dtype=param.compute_dtype, device=self.device)
            if grad is not None:
                with_grad.append(param)
                grads.append(grad)
        if self.options.reshard_after_backward:
            self.to_sharded()
        return with_grad, grads

    def _issue_reductions(self, with_grad: list[ShardedParam], grads: list[torch.Tensor]) -> None:
        """Issue the reduce-scatter (and the all-reduce of replicated parameters)."""
        ctx = self.ctx
        replicated = [
            (p, g) for p, g in zip(with_grad, grads, strict=True) if p in self._replicated
        ]
        if replicated:
            kept = [
                (p, g) for p, g in zip(with_grad, grads, strict=True) if p not in self._replicated
            ]
            grads.clear()  # the caller's list: keep one reference per gradient
            with_grad = [p for p, _ in kept]
            grads = [g for _, g in kept]
            del kept
        if not grads:
            reductions = []
        elif self.options.comm_fusion:
            reductions = [self._issue_reduction(with_grad, grads)]
        else:  # one collective per parameter (debugging)
            reductions = [
                self._issue_reduction([p], [g]) for p, g in zip(with_grad, grads, strict=True)
            ]
            grads.clear()
        if replicated:
            reductions.append(
                self._issue_all_reduce([p for p, _ in replicated], [g for _, g in replicated])
            )
        for reduction in reductions:
            if ctx is None:
                reduction.finish()
                continue
            if reduction.streams_ordered:
                # Device streams order the stages: issue the HSDP all-reduce right away (it
                # waits on the all-reduce stream for the reduce-scatter event, not the host).
                reduction.advance()
            ctx.pending_reductions.append(reduction)

    def _issue_reduction(
        self, params: list[ShardedParam], grads: list[torch.Tensor]
    ) -> PendingReduction:
        dtypes = {g.dtype for g in grads}
        if len(dtypes) != 1:
            raise RuntimeError(f"fully_shard expects one gradient dtype per unit, got {dtypes}")
        reduce_dtype = self.reduce_dtype or grads[0].dtype
        mesh_info = self.mesh_info
        streams = self.comm_streams()
        rs_stream = streams.reduce_scatter
        if streams.active:  # the gradients come from the compute stream
            rs_stream.wait_stream(streams.current())
        factor = (
            1.0 if self.options.reduce_op_type == "sum" else self.options.gradient_divide_factor
        )
        pre, post, rs_op, ar_op = divide_factors(
            reduce_dtype,
            mesh_info.shard_size,
            mesh_info.replicate_size,
            factor,
            self.options.force_sum_reduction,
        )
        rs_group = self.options.reduce_scatter_group or mesh_info.shard_group
        in_place = self._rs_in_place.get(rs_group)
        if in_place is None:  # asked once per group: the backend does not change
            in_place = self._rs_in_place[rs_group] = reduce_scatter_in_place(rs_group, self.device)
        if in_place and self._reduced_shard_kept(params, reduce_dtype):
            # The reduced shard itself becomes new ``.grad`` storage: written into a row of the
            # input it would have to be copied out of that row (to free the input), so it gets
            # its own buffer, as in PyTorch (no select and clone of the row per unit and step).
            in_place = False
        with streams.on(rs_stream):
            streams.mark("reduce_scatter")
            shard_dims = pack_layouts(
                rs_stream if streams.active else None, params, grads, dim0_only=self._dim0_only
            )
            rs_input, rs_output, work = issue_reduce_scatter(
                grads,
                shard_dims,
                reduce_dtype,
                rs_group,
                mesh_info.shard_size,
                rs_op,
                pre,
                self.options.custom_reduce_scatter,
                in_place=in_place,
            )
            work = streams.order_on_stream(work)
        event = (
            rs_stream.record_event(streams.new_event("reduce_scatter")) if streams.active else None
        )
        # Sharded accumulation: a no-sync micro-batch reduce-scatters and keeps the shard
        # (HSDP: without the replicate-axis all-reduce, done on the synced micro-batch).
        do_all_reduce = self.options.all_reduce_grads and self.options.reduce_grads
        return PendingReduction(
            self,
            params,
            rs_input,
            rs_output,
            work,
            post,
            ar_op,
            do_all_reduce,
            streams=streams,
            event=event,
        )

    def _reduced_shard_kept(self, params: list[ShardedParam], reduce_dtype: torch.dtype) -> bool:
        """Whether the reduce-scatter output will outlive the reduction as it is.

        It does when it becomes new sharded gradients (a parameter without ``.grad``, no cast
        to another dtype, no fp32 main gradient) or the partial reduction of a no-all-reduce
        HSDP micro-batch; else it is read once (accumulated, cast) and an in-place
        reduce-scatter saves a buffer. Asked at issue time: if ``.grad`` changes before the
        write, the write still copies what it must (``owned_storage``).
        """
        if self.mp_policy.apply_grad_on_fp32_main_grad or reduce_dtype != self.orig_dtype:
            return False
        if self.mesh_info.is_hsdp and not (
            self.options.all_reduce_grads and self.options.reduce_grads
        ):
            return True
        # A loop, not any(genexpr): no generator frame per parameter on the hot path.
        for param in params:  # noqa: SIM110
            if param.sharded_param.grad is None:
                return True
        return False

    def reset_iter_state(self) -> None:
        """Drop in-flight all-gathers, gradients and accumulations; reshard (after a failure)."""
        self.drop_pending_all_gather()
        self.to_sharded()
        self.training_state = TrainingState.IDLE
        self.partial_reduce_output = None
        self._post_forward_indices.clear()
        for param in self.params:
            param.unsharded_accumulated_grad = None
            if param.has_unsharded_param:
                param.unsharded_param.grad = None

    def _issue_all_reduce(
        self, params: list[ShardedParam], grads: list[torch.Tensor]
    ) -> PendingReduction:
        """Pack the gradients of replicated parameters; all-reduce them (``replicate_params``)."""
        reduce_dtype = self.reduce_dtype or grads[0].dtype
        mesh_info = params[0].mesh_info
        factor = (
            1.0 if self.options.reduce_op_type == "sum" else self.options.gradient_divide_factor
        )
        pre, post, _, ar_op = divide_factors(
            reduce_dtype, 1, mesh_info.replicate_size, factor, self.options.force_sum_reduction
        )
        packed, output, _ = issue_reduce_scatter(
            grads,
            [p.shard_dim for p in params],
            reduce_dtype,
            mesh_info.shard_group,
            1,
            dist.ReduceOp.SUM,
            pre,
        )
        return PendingReduction(
            self, params, packed, output, None, post, ar_op, True, mesh_info=mesh_info
        )

    def finalize_backward(self) -> None:
        """End-of-backward cleanup: drop unused prefetches and backward-prefetch indices."""
        self.drop_pending_all_gather()
        self._post_forward_indices.clear()
