"""A unit's gradient reduction in flight: reduce-scatter, HSDP all-reduce, write-back.

See Also:
    :pt:`torch.distributed.fsdp._fully_shard._fsdp_collectives.foreach_reduce`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hp_dtensor.device import Event, Stream
from hp_dtensor.device import stream as device_stream
from hp_fsdp._torch_compat import no_grad_call
from hp_fsdp.collectives import (
    apply_gradient_scaling_factor,
    owned_storage,
)
from hp_fsdp.mesh_info import MeshInfo
from hp_fsdp.param import ShardedParam
from hp_fsdp.streams import CommStreams
from hp_kernels import post_reduce

if TYPE_CHECKING:
    from hp_fsdp.param_group import ParamGroup

__all__ = ["PendingReduction", "pack_layouts"]


def pack_layouts(
    stream: Stream | None,
    params: list[ShardedParam],
    grads: list[torch.Tensor],
    *,
    dim0_only: bool = False,
) -> list[int]:
    """Put each gradient in its reduce-scatter layout, in place in ``grads``; the shard dims.

    The gradients are produced on the compute stream and read on ``stream`` (None: no
    streams). No reference to them outlives this call (the caller's list is the only one,
    cleared by the collective's copy-in), so each is freed as soon as it is packed.
    ``dim0_only`` (every parameter sharded on dim 0) packs them as they are, without asking
    each parameter.
    """
    if stream is not None:
        for grad in grads:
            stream.record_tensor(grad)
    if dim0_only:
        return [0] * len(grads)
    layouts = [p.reduce_scatter_layout(g) for p, g in zip(params, grads, strict=True)]
    grads[:] = [t for t, _ in layouts]
    return [d for _, d in layouts]


class PendingReduction:
    """An issued gradient reduction of one unit, finished later (overlapping backward).

    Stages: the reduce-scatter is in flight; then (HSDP) the all-reduce over the replicate
    axis is in flight; then the reduced shards are divided, cast and written as the sharded
    parameters' ``.grad`` (accumulated when a gradient exists).

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_collectives.foreach_reduce`.
    """

    def __init__(
        self,
        group: ParamGroup,
        params: list[ShardedParam],
        rs_input: torch.Tensor,
        rs_output: torch.Tensor,
        work: dist.Work | None,
        post_divide: float | None,
        all_reduce_op: dist.ReduceOp.RedOpType,
        do_all_reduce: bool,
        *,
        mesh_info: MeshInfo | None = None,
        streams: CommStreams | None = None,
        event: Event | None = None,
    ) -> None:
        self.group = group
        self._streams = streams or CommStreams.for_device(rs_output.device)
        #: Recorded after the collective in flight was issued (on its stream).
        self._event = event
        self._mesh_info = mesh_info or group.mesh_info
        self.params = params
        self._rs_input: torch.Tensor | None = rs_input
        self._output = rs_output
        self._work = work
        self._post_divide = post_divide
        self._all_reduce_op = all_reduce_op
        self._do_all_reduce = do_all_reduce
        self._stage = 0  # 0: reduce-scatter in flight, 1: all-reduce in flight, 2: done

    @property
    def done(self) -> bool:
        """Whether the reduced gradients have been written."""
        return self._stage == 2

    @property
    def streams_ordered(self) -> bool:
        """Whether device streams order this reduction's stages (accelerators)."""
        return self._streams.device_ordered

    def advance(self) -> None:
        """Run one stage: wait for the collective in flight and start the next step."""
        if self._stage == 2:
            return
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._stage == 0:
            self._rs_input = None  # the reduce-scatter no longer reads it
            group = self.group
            mesh_info = self._mesh_info
            if mesh_info.is_hsdp:
                output = self._output
                if mesh_info is group.mesh_info and group.partial_reduce_output is not None:
                    with self._streams.on(self._streams.reduce_scatter):
                        output += group.partial_reduce_output
                    group.partial_reduce_output = None
                if not self._do_all_reduce:
                    group.partial_reduce_output = owned_storage(output)
                    self._stage = 2
                    return
                assert mesh_info.replicate_group is not None
                streams = self._streams
                if not streams.active:  # no streams (CPU): the collective's work orders it
                    self._work = dist.all_reduce(
                        output,
                        op=self._all_reduce_op,
                        group=mesh_info.replicate_group,
                        async_op=True,
                    )
                    self._stage = 1
                    return
                if self._event is not None:  # the all-reduce waits for the reduce-scatter only
                    streams.all_reduce.wait_event(self._event)
                with device_stream(streams.all_reduce):
                    streams.mark("all_reduce")
                    streams.all_reduce.record_tensor(output)
                    self._work = streams.order_on_stream(
                        dist.all_reduce(
                            output,
                            op=self._all_reduce_op,
                            group=mesh_info.replicate_group,
                            async_op=True,
                        )
                    )
                self._event = streams.all_reduce.record_event(streams.new_event("all_reduce"))
                self._stage = 1
                return
        self._write_grads()
        self._stage = 2

    def discard(self) -> None:
        """Wait for the collective in flight and drop the result (``reset_iter_state``)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._rs_input = None
        self._stage = 2

    def finish(self) -> None:
        """Run all remaining stages."""
        while self._stage != 2:
            self.advance()

    @no_grad_call
    def _write_grads(self) -> None:
        """Divide, cast and write the reduced gradients off the compute stream."""
        streams = self._streams
        post = streams.all_reduce if self._stage == 1 else streams.reduce_scatter
        if not streams.active:  # no streams (CPU): program order, nothing to wait for
            self._write_grads_on_stream(post)
            return
        with device_stream(post):
            streams.mark("post_reduce")
            host_copies = self._write_grads_on_stream(post)
        done = post.record_event(streams.new_event("post_reduce"))
        ctx = self.group.ctx
        if ctx is None:
            done.wait()
            if host_copies:
                done.synchronize()
            return
        # The root's end of backward makes the compute stream (the optimizer) wait for these
        # gradients only, and the host wait for the copies to the host once per stream: the
        # last event recorded on a stream completes after everything queued there before it.
        ctx.post_reduce_events.append(done)
        if host_copies:
            ctx.host_copy_events[post] = done

    def _write_grads_on_stream(self, stream: Stream) -> bool:
        """Write the reduced gradients (the current stream is ``stream``).

        Returns:
            Whether gradients were copied to the host without a host wait yet.
        """
        output = self._output
        group = self.group
        if group.options.all_reduce_hook is not None:
            group.options.all_reduce_hook(output)
        orig_dtype = group.orig_dtype
        main_grad = group.mp_policy.apply_grad_on_fp32_main_grad
        if main_grad:
            orig_dtype = torch.float32  # finish in float32; cast per parameter below
        post_divide = self._post_divide
        scale = group.options.gradient_scaling_factor
        float_scale: float | None = None
        if isinstance(scale, torch.Tensor):
            if post_divide is not None:
                output = post_reduce(output, divide_factor=post_divide, inplace=True)
                post_divide = None
            apply_gradient_scaling_factor(output, scale)
        elif scale is not None:
            float_scale = float(scale)
        if orig_dtype is not None and output.dtype != orig_dtype:
            output = post_reduce(
                output, divide_factor=post_divide, scale=float_scale, out_dtype=orig_dtype
            )
        elif post_divide is not None or float_scale is not None:
            output = post_reduce(output, divide_factor=post_divide, scale=float_scale, inplace=True)
        if not main_grad and any(p.sharded_param.grad is None for p in self.params):
            output = owned_storage(output)  # new gradients view it: free the reduction buffer
        new_grads: list[torch.Tensor] = []
        host_copies = False
        offset = 0
        for param in self.params:
            new_grad = param.reduced_shard_view(output, offset)
            offset += param.padded_sharded_numel
            if param.offload_to_cpu:  # asynchronous: no host wait per parameter
                host = stream.copy_to_host(new_grad)
                host_copies = host_copies or host is not new_grad
                new_grad = host
            new_grads.append(new_grad)
        if host_copies and (
            main_grad
            or any(
                p.sharded_param.grad is not None
                or getattr(p.sharded_param, "_post_accumulate_grad_hooks", None)
                for p in self.params
            )
        ):
            # The host reads the copies right away (accumulation, hooks): one wait for the unit.
            stream.record_event(self._streams.new_event("host_copy")).synchronize()
            host_copies = False
        for param, new_grad in zip(self.params, new_grads, strict=True):
            sharded = param.sharded_param
            if main_grad:
                param.accumulate_main_grad(new_grad)
            elif sharded.grad is not None:
                grad = sharded.grad
                if not isinstance(grad, DTensor):
                    raise TypeError(
                        f"the gradient of the sharded parameter {param.fqn!r} must be a DTensor "
                        f"to accumulate into, got {type(grad).__name__}"
                    )
                grad._local_tensor += new_grad
            else:
                sharded.grad = param.to_sharded_dtensor(new_grad)
            hooks = getattr(sharded, "_post_accumulate_grad_hooks", None)
            if hooks:
                for hook in hooks.values():
                    hook(sharded)
        return host_copies
