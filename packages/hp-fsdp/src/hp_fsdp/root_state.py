"""Per-root context: everything shared by the units of one root module for one iteration.

One :class:`RootContext` exists per root (the outermost ``fully_shard`` module that runs
forward first). Every unit under that root points at it after lazy initialization. It holds the
pending gradient reductions, the forward and post-forward orders used for prefetching, the
end-of-backward callback flag, and the process groups created once for
``reshard_after_forward=k``. Nothing here is module-global, so two models in one process do
not interact.

See Also:
    :pt:`torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPCommContext`: PyTorch's
    shared communication context.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hp_dtensor.device import Event, Stream
from hp_fsdp.collectives import AllGatherState
from hp_fsdp.mesh_info import MeshInfo, PostForwardInfo
from hp_fsdp.streams import CommStreams
from hp_fsdp.symm_mem import SymmetricBufferPools

if TYPE_CHECKING:
    from hp_fsdp.param_group import ParamGroup, PendingReduction
    from hp_fsdp.state import FSDPState

__all__ = ["ROOTS", "CommResources", "RootContext"]


class CommResources:
    """Process groups a root creates once and reuses (shared across roots by ``share_comm_ctx``).

    Attributes:
        post_forward_groups: the groups of ``reshard_after_forward=k``, per (mesh ranks, k).
        separate_groups: the reduce-scatter groups of ``set_separate_reduce_scatter_group``,
            per shard-group ranks.
        logged_hints: the best-effort hints already logged (each logs once).

    See Also:
        :pt:`torch.distributed.fsdp.share_comm_ctx`: PyTorch's shared communication context.
    """

    def __init__(self) -> None:
        self.post_forward_groups: dict[tuple[tuple[int, ...], int], PostForwardInfo] = {}
        self.separate_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self.logged_hints: set[str] = set()
        #: The communication streams (created on first use for the root's device).
        self.streams: CommStreams | None = None
        #: Pooled symmetric all-gather buffers (``set_symm_mem_for_comm``), shared by the units.
        self.symmetric_buffers = SymmetricBufferPools()

    def streams_for(self, device: torch.device) -> CommStreams:
        """The communication streams of this context, created on first use.

        Args:
            device: the compute device.

        Returns:
            The streams.
        """
        if self.streams is None:
            self.streams = CommStreams.for_device(device)
        return self.streams

    def separate_group(self, shard_group: dist.ProcessGroup) -> dist.ProcessGroup:
        """A second process group over the ranks of ``shard_group`` (created once, collective).

        Args:
            shard_group: the unit's shard group.

        Returns:
            The group reduce-scatters are issued on.
        """
        ranks = tuple(dist.get_process_group_ranks(shard_group))
        group = self.separate_groups.get(ranks)
        if group is None:
            new = dist.new_group(list(ranks), use_local_synchronization=True)
            assert new is not None
            group = new
            self.separate_groups[ranks] = group
        return group


class RootContext:
    """State shared by all units of one root.

    Attributes:
        states: every unit state under the root, in ``named_modules()`` pre-order.
        iter_forward_root: the state whose forward started this iteration's forward pass.
        callback_queued: whether the end-of-backward callback is queued.
        is_last_backward: whether the next backward finishes the iteration.
        forward_order: the units in the pre-forward order of the last completed forward pass
            (the implicit forward-prefetch order).
        current_forward_order: the same, being recorded for the forward pass in progress.
        post_forward_order: the units in post-forward order (the backward-prefetch order).
        pending_reductions: issued reduce-scatters (and HSDP all-reduces) not yet finished.
        max_inflight_reductions: how many pending reductions a unit leaves in flight when it
            issues its own.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_state.FSDPStateContext`.
    """

    def __init__(self) -> None:
        self.states: list[FSDPState] = []
        self.iter_forward_root: FSDPState | None = None
        self.callback_queued = False
        self.is_last_backward = True
        self.forward_order: list[FSDPState] = []
        self.current_forward_order: list[FSDPState] = []
        self.post_forward_order: list[ParamGroup] = []
        self.pending_reductions: list[PendingReduction] = []
        self.max_inflight_reductions = 1
        self.comm = CommResources()
        self.post_optim_event: Any | None = None
        #: Recorded after each unit's gradients were written (waited at the end of backward).
        self.post_reduce_events: list[Event] = []
        #: The last such event of each stream that copied gradients to the host without
        #: blocking (CPU offload): the host waits for these at the end of backward.
        self.host_copy_events: dict[Stream, Event] = {}
        #: The newest unit gathered in forward, kept until the next unit's copy-out so that
        #: its copy-out overlaps the next all-gather (at most two all-gathers in flight).
        self.all_gather_state: AllGatherState | None = None

    def free_all_gather_state(self) -> None:
        """Order the all-gather streams after the kept copy-out and drop its buffers."""
        state, self.all_gather_state = self.all_gather_state, None
        if state is not None and self.comm.streams is not None:
            state.free(self.comm.streams)

    def post_forward_info(self, mesh_info: MeshInfo, k: int) -> PostForwardInfo:
        """The group of ``k`` consecutive shard ranks this rank reshards to after forward.

        The groups are created on first request for a (mesh, k) pair, every rank creating every
        group in the same order, and reused by all units of this root.

        Args:
            mesh_info: the unit's mesh.
            k: the post-forward world size (a divisor of the shard size, 1 < k < shard size).

        Returns:
            This rank's :class:`PostForwardInfo`.

        See Also:
            :pt:`torch.distributed.fsdp.fully_shard`: ``reshard_after_forward`` as an int.
        """
        mesh_ranks = mesh_info.mesh.mesh.reshape(-1, mesh_info.shard_size)
        key = (tuple(int(r) for r in mesh_ranks.reshape(-1).tolist()), k)
        info = self.comm.post_forward_groups.get(key)
        if info is not None:
            return info
        me = dist.get_rank()
        mine: PostForwardInfo | None = None
        for row in mesh_ranks.reshape(-1, k).tolist():
            ranks = [int(r) for r in row]
            group = dist.new_group(ranks)
            if me in ranks:
                mine = PostForwardInfo(group=group, size=k, rank=ranks.index(me))
        if mine is None:
            raise RuntimeError(
                f"rank {me} is not in the mesh {mesh_info.mesh}; cannot reshard to {k} ranks"
            )
        self.comm.post_forward_groups[key] = mine
        return mine

    def advance_reductions(self, max_inflight: int | None = None) -> None:
        """Move every pending reduction one stage on, finishing those that complete.

        Then, while more than ``max_inflight`` remain, finish the oldest. Called by a unit's
        post-backward before it issues its own reduce-scatter, so each reduction overlaps at
        least one later unit's backward computation.

        Args:
            max_inflight: how many reductions to leave in flight (None:
                ``max_inflight_reductions``); a unit passes its
                ``set_reduce_scatter_max_input_buffers`` value.
        """
        limit = self.max_inflight_reductions if max_inflight is None else max_inflight
        pending = self.pending_reductions
        if not pending:
            return
        for reduction in pending:
            reduction.advance()
        remaining = [r for r in pending if not r.done]
        while len(remaining) > limit:
            remaining[0].finish()
            remaining.pop(0)
        self.pending_reductions = remaining

    def finish_reductions(self) -> None:
        """Wait for every pending reduction and write the reduced gradients (FIFO order)."""
        pending = self.pending_reductions
        self.pending_reductions = []
        for reduction in pending:
            reduction.finish()
        self.wait_post_reduce_events()

    def wait_post_reduce_events(self) -> None:
        """Make the compute stream wait for the written gradients; the host for host copies."""
        events, self.post_reduce_events = self.post_reduce_events, []
        for event in events:
            event.wait()
        host, self.host_copy_events = self.host_copy_events, {}
        for event in host.values():  # offloaded gradients: one host wait per stream, at the end
            event.synchronize()


#: Weak registry of the initialized roots (for ``hsdp_sync_stream()`` without a module).
ROOTS: weakref.WeakSet[RootContext] = weakref.WeakSet()
