"""Token dispatch and combine: moving routed tokens to the ranks that hold their experts.

Expert parallelism splits the ``E`` experts over the ``ep`` ranks of a group (rank ``r`` holds
experts ``r*E/ep .. (r+1)*E/ep - 1``). After the router, each rank holds its tokens grouped by
global expert. Dispatch:

1. exchange the per-expert token counts (a small ``all_to_all_single`` of ``E`` integers), so
   every rank knows how many rows it sends to and receives from every peer (the split sizes);
   these are read on the host once (the layer's only host sync: the receive buffer's size and
   the collective's split sizes must be known there), which also gives the rows per local
   expert for free;
2. ``all_to_all_single`` the token rows with those splits (issued asynchronously, so the caller
   can compute something else, e.g. the shared experts, before waiting);
3. regroup the received rows from (source rank, local expert) order to (local expert, source
   rank) order, so each local expert's rows are contiguous for the grouped GEMM.

Combine undoes 3 and 2 (an ``all_to_all_single`` with the splits swapped). Both directions are
differentiable: the backward of an all-to-all is the all-to-all with the splits swapped.

With tensor parallelism over the experts' hidden dimension (``ExpertTensorParallel``,
``TensorParallel``), the tokens entering the experts are replicated over the TP group and each TP
rank computes a partial sum of the output: the combine all-reduces it over TP, and the dispatch
all-reduces the input gradient over TP in the backward (Megatron's f/g pair).

See Also:
    :pt:`torch.distributed._functional_collectives.all_to_all_single_autograd`: PyTorch's
    differentiable all-to-all; TorchTitan's
    :titan:`ExpertParallel._token_dispatch`/:titan:`_token_combine <ExpertParallel._token_combine>`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from hp_dtensor import device as hp_device

__all__ = ["BackwardOverlap", "DispatchedTokens", "TokenDispatcher", "all_to_all_tokens"]


class _PendingWork:
    """The handle of an asynchronous collective a differentiable op issued."""

    def __init__(self) -> None:
        self.work: dist.Work | None = None
        self.keep: torch.Tensor | None = None

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        self.keep = None


def _all_to_all(
    tokens: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup,
    async_op: bool,
) -> tuple[torch.Tensor, dist.Work | None]:
    out = tokens.new_empty((sum(output_splits), *tokens.shape[1:]))
    work = dist.all_to_all_single(
        out,
        tokens.contiguous(),
        output_split_sizes=output_splits,
        input_split_sizes=input_splits,
        group=group,
        async_op=async_op,
    )
    return out, work


class _AllToAllTokens(torch.autograd.Function):
    """Differentiable ``all_to_all_single`` of token rows with explicit split sizes."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        tokens: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
        pending: _PendingWork | None,
    ) -> torch.Tensor:
        ctx.splits = (output_splits, input_splits)  # type: ignore[attr-defined]
        ctx.group = group  # type: ignore[attr-defined]
        out, work = _all_to_all(tokens, output_splits, input_splits, group, pending is not None)
        if pending is not None:
            pending.work = work  # the caller waits before reading ``out``
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        output_splits, input_splits = ctx.splits
        grad_in, _ = _all_to_all(grad, input_splits, output_splits, ctx.group, False)
        return grad_in, None, None, None, None


class _AllToAllAsyncBackward(torch.autograd.Function):
    """:class:`_AllToAllTokens` (synchronous forward) whose backward all-to-all is *issued*.

    The backward starts the all-to-all of the gradient and returns its receive buffer at once;
    :class:`_WaitInBackward`, placed just before this op in the forward, waits for it before the
    gradient is read, so whatever autograd runs in between overlaps with the transfer.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        tokens: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
        pending: _PendingWork,
    ) -> torch.Tensor:
        ctx.splits = (output_splits, input_splits)  # type: ignore[attr-defined]
        ctx.group = group  # type: ignore[attr-defined]
        ctx.pending = pending  # type: ignore[attr-defined]
        out, _ = _all_to_all(tokens, output_splits, input_splits, group, False)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        output_splits, input_splits = ctx.splits
        grad = grad.contiguous()
        grad_in, work = _all_to_all(grad, input_splits, output_splits, ctx.group, True)
        ctx.pending.work = work
        ctx.pending.keep = grad  # the send buffer lives until the wait
        return grad_in, None, None, None, None


class _WaitInBackward(torch.autograd.Function):
    """Identity forward; the backward waits for the pending all-to-all of its gradient.

    Its second output, an empty tensor, is the *gate*: a branch that consumes it (see
    :class:`BackwardOverlap`) must finish its backward before this wait runs.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, pending: _PendingWork
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.pending = pending  # type: ignore[attr-defined]
        return x.view_as(x), x.new_zeros(0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _gate: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.pending.wait()
        return grad, None


class _SideBranch(torch.autograd.Function):
    """The output of a branch computed on detached inputs, its backward run when gated.

    The branch's graph hangs off ``detached``; this node's backward runs it (a nested backward,
    as reentrant activation checkpointing does) and returns the input gradient, then the gate's
    (empty) gradient releases the :class:`_WaitInBackward` that depends on it.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        gate: torch.Tensor,
        inputs: torch.Tensor,
        branch: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        # ``branch`` (detached input, output) is not a tensor argument: autograd must not link
        # this node to the branch's graph, which only the nested backward below runs.
        branch_out = branch[1]
        ctx.branch = branch  # type: ignore[attr-defined]
        ctx.gate_shape = gate.shape  # type: ignore[attr-defined]
        return branch_out.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        detached, branch_out = ctx.branch
        ctx.branch = None
        if branch_out.requires_grad:
            torch.autograd.backward(branch_out, grad)
        grad_in = detached.grad if detached.requires_grad else None
        gate_grad = grad.new_zeros(ctx.gate_shape)
        return gate_grad, grad_in, None


class BackwardOverlap:
    """A branch (the shared experts) whose backward overlaps the combine's backward all-to-all.

    Built before the dispatch's wait (its forward overlaps the dispatch all-to-all, as always);
    the combine attaches it behind the gate of its last all-to-all, so in the backward the
    order is: the combine's gradient all-to-all is issued, the branch's backward runs, then the
    wait, then the experts' backward. Without a pending all-to-all (one device) the branch is
    attached ungated (same values).

    Args:
        inputs: The branch's input (its gradient is returned through :attr:`output`).
        branch: The function of ``inputs``, e.g. the shared experts module.

    See Also:
        HyperParallel's ``_AsyncA2ALazyBwd`` (lazily waited backward all-to-all);
        :pt:`torch.utils.checkpoint.checkpoint` runs nested backwards the same way (reentrant).
    """

    def __init__(self, inputs: torch.Tensor, branch: Any) -> None:
        self.inputs = inputs
        self._detached = inputs.detach().requires_grad_(inputs.requires_grad)
        self._raw: torch.Tensor = branch(self._detached)
        self._output: torch.Tensor | None = None

    def attach(self, gate: torch.Tensor | None) -> None:
        """Link the branch's output behind ``gate`` (called by the combine, once)."""
        if gate is None:  # a throwaway leaf: the node must join the graph through the params
            gate = self.inputs.new_zeros(0).requires_grad_(self._raw.requires_grad)
        branch = (self._detached, self._raw)
        self._output = _SideBranch.apply(gate, self.inputs, branch)  # type: ignore[no-untyped-call]

    @property
    def output(self) -> torch.Tensor:
        """The branch's output, differentiable in ``inputs`` and the branch's parameters."""
        if self._output is None:
            self.attach(None)
        assert self._output is not None
        return self._output


def _send_back(
    tokens: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup,
    overlap: BackwardOverlap | None,
) -> torch.Tensor:
    """The combine's all-to-all; with ``overlap``, its backward is issued early and gated."""
    if overlap is None:
        plain: torch.Tensor = _AllToAllTokens.apply(  # type: ignore[no-untyped-call]
            tokens, output_splits, input_splits, group, None
        )
        return plain
    pending = _PendingWork()
    tokens, gate = _WaitInBackward.apply(tokens, pending)  # type: ignore[no-untyped-call]
    overlap.attach(gate)
    out: torch.Tensor = _AllToAllAsyncBackward.apply(  # type: ignore[no-untyped-call]
        tokens, output_splits, input_splits, group, pending
    )
    return out


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over the TP group in the backward."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce (sum) of partial outputs over the TP group; identity backward."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None


def _agree(ok: bool, group: dist.ProcessGroup, device: torch.device) -> list[bool]:
    """Every rank's ``ok`` flag, gathered on every rank (so all ranks raise together)."""
    flags = torch.full((1,), 1 if ok else 0, dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(flags) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flags, group=group)
    return [bool(f) for f in torch.cat(gathered).tolist()]  # one host read


def all_to_all_tokens(
    tokens: torch.Tensor,
    input_splits: list[int],
    output_splits: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` of token rows, split sizes exchanged or verified.

    Rank ``r`` sends ``tokens[sum(input_splits[:p]) : ... + input_splits[p]]`` to each peer ``p``
    and receives the rows every peer sends it, in peer order. Without ``output_splits`` they are
    exchanged first (a small all-to-all of the split sizes). With ``output_splits`` given, the
    sizes are checked collectively against what the peers will send: when any rank's sizes
    disagree, *every* rank raises (no rank is left waiting in the data all-to-all).

    Args:
        tokens: ``[N, ...]`` rows, ``N == sum(input_splits)``.
        input_splits: Rows sent to each rank of ``group``.
        output_splits: Rows received from each rank; ``None`` exchanges them.
        group: Process group (default: the world).

    Returns:
        ``[sum(output_splits), ...]`` received rows. Differentiable in ``tokens``.

    Raises:
        ValueError: On every rank, when some rank's splits have the wrong length, do not add up
            to its rows, or disagree with its peers' (the message names the ranks).

    See Also:
        :pt:`torch.distributed._functional_collectives.all_to_all_single_autograd`.
    """
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None
    world = dist.get_world_size(pg)
    rank = dist.get_rank(pg)
    local_problem = ""
    if len(input_splits) != world or (output_splits is not None and len(output_splits) != world):
        local_problem = f"split lists must have {world} entries (one per rank of the group)"
    elif sum(input_splits) != tokens.shape[0]:
        local_problem = f"input_splits sum to {sum(input_splits)} but tokens has {tokens.shape[0]}"
    # the backend's device (nccl needs accelerator tensors even for split sizes)
    device = tokens.device
    sent = torch.zeros(world, dtype=torch.int64, device=device)
    if not local_problem:
        sent = torch.tensor(input_splits, dtype=torch.int64, device=device)
    expected = torch.empty_like(sent)
    dist.all_to_all_single(expected, sent, group=pg)
    received = [int(v) for v in expected.tolist()]
    if output_splits is None:
        oks = _agree(not local_problem, pg, device)
        output_splits = received
    else:
        if not local_problem and list(output_splits) != received:
            local_problem = (
                f"output_splits {list(output_splits)} disagree with the sizes the peers send "
                f"{received}"
            )
        oks = _agree(not local_problem, pg, device)
    if not all(oks):
        bad = [r for r, ok in enumerate(oks) if not ok]
        detail = f" (this rank {rank}: {local_problem})" if local_problem else ""
        raise ValueError(f"all_to_all_tokens: split sizes are inconsistent on ranks {bad}{detail}")
    out: torch.Tensor = _AllToAllTokens.apply(tokens, output_splits, list(input_splits), pg, None)  # type: ignore[no-untyped-call]
    return out


@dataclass
class _DispatchState:
    """What ``combine`` needs to undo one ``dispatch``."""

    input_splits: list[int]
    output_splits: list[int]
    regroup: torch.Tensor | None  # (source, expert) -> (expert, source) row order
    pending: _PendingWork
    order: torch.Tensor | None = None  # hot-expert replication: sent row -> source row


class DispatchedTokens:
    """The result of :meth:`TokenDispatcher.dispatch`: wait for it, then run the experts.

    Attributes:
        num_tokens_per_expert: ``[E_local]`` int64 rows per local expert (known at issue time).
        sizes: The same counts as Python ints when the dispatch read them on the host anyway
            (under expert parallelism, or with ``drop_tail``), else ``None``: a per-expert loop
            can split the rows without another host sync.

    See Also:
        :pt:`torch.distributed.Work`: the handle of the asynchronous all-to-all waited on here.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        num_tokens_per_expert: torch.Tensor,
        state: _DispatchState | None,
        *,
        sizes: list[int] | None = None,
    ) -> None:
        self._tokens = tokens
        self.num_tokens_per_expert = num_tokens_per_expert
        self.sizes = sizes
        self._state = state

    def wait(self) -> torch.Tensor:
        """The rows of the local experts, grouped by local expert (blocks until they arrived)."""
        if self._state is not None:
            self._state.pending.wait()
            if self._state.regroup is not None:
                return self._tokens.index_select(0, self._state.regroup)
        return self._tokens


class TokenDispatcher:
    """Moves expert inputs to the ranks holding their experts and the outputs back.

    One object per experts module (set by the expert-parallel styles as
    ``experts.token_dispatcher``), so several MoE layers never share dispatch state. Without
    groups it is the identity (one device).

    Args:
        num_local_experts: Experts held by this rank.
        ep_group: Expert-parallel group (tokens exchanged by all-to-all), or ``None``.
        tp_group: Tensor-parallel group over the experts' hidden dimension, or ``None``.
        overlap_backward: Keyword-only extension: in :class:`~hp_cp_ep.MoE`, issue the
            combine's backward all-to-all asynchronously and run the shared experts' backward
            before waiting for it (see :class:`BackwardOverlap`). Off: the light variant (the
            forward dispatch overlaps the shared experts; the backward all-to-alls block), as
            TorchTitan's default and ``minimal_async_ep`` paths.

    See Also:
        TorchTitan's :titan:`ExpertParallel` / :titan:`ExpertTensorParallel` token dispatch.
    """

    def __init__(
        self,
        num_local_experts: int,
        ep_group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
        *,
        overlap_backward: bool = False,
    ) -> None:
        if not isinstance(overlap_backward, bool):
            raise TypeError(
                f"overlap_backward must be a bool, got {type(overlap_backward).__name__}"
            )
        self.overlap_backward = overlap_backward
        self.num_local_experts = num_local_experts
        self.ep_group = ep_group
        self.tp_group = tp_group
        self.ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        self._checked_peers = False
        self._replicas: Any = None
        self.last_received_rows = 0
        """Rows this rank's experts received in the last dispatch (read on the host anyway)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> TokenDispatcher:
        # Process groups cannot be copied: a deep copy of a parallelized model (EMA weights,
        # a reference copy) communicates over the same groups.
        clone = copy.copy(self)
        memo[id(self)] = clone
        return clone

    def _check_peers(self, hidden: int, device: torch.device) -> None:
        """Once: every EP rank must hold as many experts and the same hidden size."""
        assert self.ep_group is not None
        mine = torch.tensor([self.num_local_experts, hidden], dtype=torch.int64, device=device)
        everyone = [torch.zeros_like(mine) for _ in range(self.ep_size)]
        dist.all_gather(everyone, mine, group=self.ep_group)
        table = [tuple(row) for row in torch.stack(everyone).tolist()]  # one host read
        if any(row != table[0] for row in table):
            raise ValueError(
                "expert-parallel ranks disagree on (local experts, hidden size): "
                f"{table} per rank; every rank must build the same MoE"
            )
        self._checked_peers = True

    def dispatch(
        self,
        tokens: torch.Tensor,
        num_tokens_per_expert: torch.Tensor,
        *,
        drop_tail: bool = False,
    ) -> DispatchedTokens:
        """Send ``tokens`` (grouped by global expert) to their experts' ranks.

        The split sizes are exchanged and read on the host once (the one host sync of the
        dispatch: the receive buffer size must be known); the token all-to-all is issued
        asynchronously. Call :meth:`DispatchedTokens.wait` before reading the rows. Without an
        expert-parallel group the dispatch is the identity and reads nothing on the host (unless
        ``drop_tail``).

        Args:
            tokens: ``[N, dim]`` rows grouped by global expert.
            num_tokens_per_expert: ``[E]`` rows per global expert (``E = ep * E_local``).
            drop_tail: Extension: ``tokens`` may hold more rows than ``num_tokens_per_expert``
                counts (capacity-dropped rows, sorted last); the extra rows are not sent. Without
                expert parallelism this reads the counts on the host (one sync) to know how many
                rows are kept.

        Raises:
            ValueError: ``num_tokens_per_expert`` has the wrong length, or (under expert
                parallelism) counts a different number of rows than ``tokens`` holds (more
                than it holds with ``drop_tail``).
        """
        expected = self.num_local_experts * self.ep_size
        if num_tokens_per_expert.numel() != expected:
            raise ValueError(
                f"num_tokens_per_expert has {num_tokens_per_expert.numel()} entries, expected "
                f"{expected} (ep={self.ep_size} x {self.num_local_experts} local experts)"
            )
        if self.tp_group is not None:
            tokens = _CopyToTensorParallel.apply(tokens, self.tp_group)  # type: ignore[no-untyped-call]
        if self.ep_group is None:
            if not drop_tail:
                return DispatchedTokens(tokens, num_tokens_per_expert, None)
            sizes = [int(n) for n in num_tokens_per_expert.tolist()]  # the one host sync
            return DispatchedTokens(tokens[: sum(sizes)], num_tokens_per_expert, None, sizes=sizes)
        if not self._checked_peers:
            self._check_peers(tokens.shape[-1], tokens.device)
        ep, local = self.ep_size, self.num_local_experts
        replicas = self._replicas
        if replicas is not None:  # rows of hot experts split between owner and replica slots
            slot_counts, source_start = replicas.slot_counts(num_tokens_per_expert)
            local = replicas.slots
            counts = slot_counts.view(ep, local)
        else:
            counts = num_tokens_per_expert.to(torch.int64).view(ep, local)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts.contiguous(), group=self.ep_group)
        # The one host sync: rows sent to each peer, and rows received per (peer, local expert).
        host = torch.cat([counts.sum(1), received.reshape(-1)]).tolist()
        input_splits = [int(n) for n in host[:ep]]
        from_peer = [host[ep + p * local : ep + (p + 1) * local] for p in range(ep)]
        output_splits = [int(sum(row)) for row in from_peer]
        sizes = [int(sum(row[j] for row in from_peer)) for j in range(local)]
        sent = sum(input_splits)
        if sent != tokens.shape[0] and (not drop_tail or sent > tokens.shape[0]):
            raise ValueError(
                f"num_tokens_per_expert counts {sent} rows but tokens has {tokens.shape[0]}"
                + ("" if drop_tail else " (pass drop_tail=True to leave trailing rows unsent)")
            )
        tokens = tokens[:sent]
        order = None
        if replicas is not None:
            order = _regroup_index_from(slot_counts, source_start, sent)
            tokens = tokens.index_select(0, order)
        self.last_received_rows = sum(output_splits)
        pending = _PendingWork()
        out = _AllToAllTokens.apply(tokens, output_splits, input_splits, self.ep_group, pending)  # type: ignore[no-untyped-call]
        regroup = _regroup_index(received, sum(output_splits)) if local > 1 else None
        state = _DispatchState(input_splits, output_splits, regroup, pending, order)
        return DispatchedTokens(out, received.sum(0), state, sizes=sizes)

    def combine(
        self,
        expert_out: torch.Tensor,
        dispatched: DispatchedTokens,
        *,
        overlap: BackwardOverlap | None = None,
    ) -> torch.Tensor:
        """Return the experts' outputs to the ranks (and row order) their tokens came from.

        Args:
            expert_out: The local experts' outputs, in the order of the dispatched rows.
            dispatched: The dispatch being undone.
            overlap: Keyword-only extension: a :class:`BackwardOverlap` (the shared experts)
                whose backward runs while this combine's backward all-to-all is in flight.
        """
        if self.tp_group is not None:
            expert_out = _ReduceFromTensorParallel.apply(expert_out, self.tp_group)  # type: ignore[no-untyped-call]
        state = dispatched._state
        if state is None:
            if overlap is not None:
                overlap.attach(None)
            return expert_out
        if state.regroup is not None:
            inverse = torch.empty_like(state.regroup)
            inverse[state.regroup] = torch.arange(
                state.regroup.numel(), device=inverse.device, dtype=inverse.dtype
            )
            expert_out = expert_out.index_select(0, inverse)
        assert self.ep_group is not None
        out = _send_back(
            expert_out, state.input_splits, state.output_splits, self.ep_group, overlap
        )
        if state.order is not None:  # back to the rows' original (global expert) order
            out = out.new_zeros(out.shape).index_copy(0, state.order, out)
        return out

    def replicate_hot_experts(
        self, tokens_per_expert: torch.Tensor | Sequence[float], num_replicas: int
    ) -> list[tuple[int, int]]:
        """Give the ``num_replicas`` most loaded experts a copy on the least loaded ranks.

        From then on each rank splits its rows for a hot expert evenly between the owner and
        the replica (the owner takes the odd row), the replica's weights are fetched from the
        owner in each forward (one all-to-all of ``K`` experts' weights, differentiable: the
        replica's gradient is summed into the owner's in the backward), so training is the
        same as without replication. The plan is computed on the host from ``tokens_per_expert``,
        which must be the same on every rank (the group's load, as
        :func:`hp_cp_ep.update_expert_bias` returns it); it is checked collectively (one small
        all-gather). ``num_replicas=0`` removes the replicas.

        Args:
            tokens_per_expert: ``[E]`` load of every expert (e.g. ``ExpertLoad.tokens_per_expert``).
            num_replicas: ``K`` experts to replicate, ``0 <= K <= E``.

        Returns:
            The plan: ``(expert, replica rank)`` pairs, most loaded expert first.

        Raises:
            ValueError: No expert-parallel group, ``K`` out of range, a load of the wrong length,
                or ranks that computed different plans (on every rank).

        See Also:
            :func:`hp_cp_ep.plan_hot_expert_replicas`: the placement rule.
        """
        from hp_cp_ep.ep.replication import HotExpertReplicas, plan_hot_expert_replicas

        if self.ep_group is None:
            raise ValueError("replicate_hot_experts needs an expert-parallel group (ep > 1)")
        loads = (
            [float(v) for v in tokens_per_expert.tolist()]  # a host read, once per re-plan
            if isinstance(tokens_per_expert, torch.Tensor)
            else [float(v) for v in tokens_per_expert]
        )
        plan = plan_hot_expert_replicas(loads, self.ep_size, num_replicas)
        _check_same_plan(plan, len(loads), self.ep_group)
        self._replicas = None
        if plan:  # its index tables built now, outside the step (no host sync in the forward)
            replicas = HotExpertReplicas(plan, self.num_local_experts, self.ep_size, self.ep_group)
            replicas._device_tables(_group_device(self.ep_group))
            self._replicas = replicas
        return plan

    @property
    def hot_expert_replicas(self) -> list[tuple[int, int]]:
        """The current replication plan, ``(expert, replica rank)`` pairs (empty when none)."""
        return [] if self._replicas is None else list(self._replicas.plan)

    def local_weights(self, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's expert weights for the experts' compute: its own, then its replicas'.

        Without replication the weights as given (``[E_local, ...]`` each); with it
        ``[E_local + R, ...]`` where the ``R`` replica slots hold the hot experts' weights
        fetched from their owners (differentiably) and zeros in unused slots.
        """
        if self._replicas is None:
            return weights
        fetched: tuple[torch.Tensor, ...] = self._replicas.fetch(weights)
        return fetched


def _regroup_index_from(
    counts: torch.Tensor, source_start: torch.Tensor, total: int
) -> torch.Tensor:
    """Gather index laying out blocks of ``counts[i]`` rows from ``source_start[i]``, in order.

    ``total`` (``counts.sum()``, known on the host) sizes the expansion: no host sync.
    """
    starts = torch.cumsum(counts, 0) - counts
    positions = torch.arange(total, device=counts.device)
    shift = source_start - starts
    return positions + torch.repeat_interleave(shift, counts, output_size=total)


def _group_device(group: dist.ProcessGroup) -> torch.device:
    """The device whose tensors ``group``'s collectives take (host for gloo)."""
    if str(dist.get_backend(group)) == hp_device.BACKEND_GLOO:
        return torch.device(hp_device.DEVICE_TYPE_CPU)
    return hp_device.get_device()


def _check_same_plan(
    plan: list[tuple[int, int]], num_experts: int, group: dist.ProcessGroup
) -> None:
    """Every rank of ``group`` computed the same replication plan, or all raise."""
    device = _group_device(group)
    flat = [len(plan), *(v for pair in plan for v in pair)]
    mine = torch.full((2 * num_experts + 1,), -1, dtype=torch.int64, device=device)
    mine[: len(flat)] = torch.tensor(flat, dtype=torch.int64, device=device)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, mine, group=group)
    rows = [tuple(row) for row in torch.stack(table).tolist()]  # once per re-plan
    if any(row != rows[0] for row in rows):
        raise ValueError(
            "replicate_hot_experts: ranks computed different plans (give every rank the same "
            "tokens_per_expert, e.g. the group's ExpertLoad)"
        )


def _regroup_index(received: torch.Tensor, total: int) -> torch.Tensor:
    """Row order taking (source rank, local expert) blocks to (local expert, source rank).

    ``received[s, j]`` rows arrived from source ``s`` for local expert ``j``, in ``s``-major
    order; the result lists, for each ``j`` then ``s``, the rows of block ``(s, j)``. ``total``
    (``received.sum()``, known on the host from the split sizes) sizes the expansions, so no
    host sync is needed.
    """
    sizes = received.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes  # start of block (s, j), s-major
    blocks = torch.arange(sizes.numel(), device=sizes.device)
    order = blocks.view(received.shape).t().reshape(-1)  # j-major blocks
    lengths = sizes.index_select(0, order)
    # within-block offset of each output row: its position minus the start of its (j, s) block
    shift = starts.index_select(0, order) - (torch.cumsum(lengths, 0) - lengths)
    positions = torch.arange(total, device=sizes.device)
    return positions + torch.repeat_interleave(shift, lengths, output_size=total)
