"""De-duplicating token dispatch: a token crosses the network once per rank (or node) it needs.

The plain :class:`~hp_cp_ep.TokenDispatcher` sends one row per routed *choice*: a token whose
top-k experts include two experts of the same rank travels there twice. The de-duplicating
dispatcher sends one row per (token, destination): the receiving rank fans it out to its local
experts, weights the experts' outputs and sums them before sending one row back.

With a node axis (the ``ep`` ranks split into ``inter`` nodes of ``intra`` ranks, rank
``a * intra + b``), dispatch has two stages, as in HyperParallel's two-stage dispatcher and
DeepEP's: stage 1 sends a token once per destination *node*, to the rank of that node with the
sender's intra index (one inter-node transfer per node, not per rank); stage 2 forwards it inside
the node, once per destination rank. Combine runs the stages backwards, summing at each hop, so
the inter-node bytes of the combine equal the dispatch's.

Each row carries its token, its ``k`` routing weights and its ``k`` global expert ids (bit-cast
to the token dtype, so one collective per stage moves everything). Bytes sent by a rank, per
stage, for ``U`` units of ``dim`` elements of ``e`` bytes:

- plain: ``C * dim * e`` where ``C`` counts the routed choices (one row each);
- de-duplicated: ``U * (dim + 2k) * e`` with ``U <= C`` the distinct (token, destination) pairs.

Under tensor parallelism over the experts' hidden units (``ExpertTensorParallel(dedup=True)``,
``tp_group``), every TP rank sends the same tokens over its own EP group (the ranks of its TP
index), fans them out and in locally, and sends back its *partial* sums: weighting, fan-in and
the all-to-alls are linear, so the TP all-reduce runs once, after the combine, on the ``T``
tokens (``T * dim`` elements; the plain dispatcher reduces its received rows, one per choice).
In the backward the tokens' and weights' gradients, partial on each TP rank, are all-reduced
before the dispatch (``T * (dim + k)``; plain: one row of ``dim`` per choice).

Host syncs: one per forward, as for the plain dispatcher (all split sizes of both stages, read
at once after two small count exchanges over the inter and intra groups); none in the backward.

See Also:
    :class:`hp_cp_ep.TokenDispatcher`: the plain dispatcher;
    :pt:`torch.distributed.all_to_all_single`: the collective of each stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hp_cp_ep.ep.dispatch import (
    BackwardOverlap,
    TokenDispatcher,
    _AllToAllTokens,
    _CopyToTensorParallel,
    _PendingWork,
    _ReduceFromTensorParallel,
    _send_back,
)
from hp_cp_ep.ep.router import count_choices

__all__ = ["DedupDispatch", "DedupTokenDispatcher", "DeredundencyTokenDispatcher"]

_ID_DTYPE_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Flat indices of the ``count`` true entries of ``mask`` (``[G, N]``), in row-major order.

    ``count`` is known on the host, so there is no ``nonzero`` (a host sync).
    """
    flat = (~mask).reshape(-1).to(torch.int8)
    return torch.sort(flat, stable=True).indices[:count]


def _member_mask(targets: torch.Tensor, size: int) -> torch.Tensor:
    """``[N, size]`` bool: row ``n`` has some entry of ``targets[n]`` equal to ``g``.

    Entries outside ``[0, size)`` (dropped choices, other nodes) mark nothing.
    """
    clipped = torch.where((targets >= 0) & (targets < size), targets, size)
    mask = torch.zeros(targets.shape[0], size + 1, dtype=torch.bool, device=targets.device)
    return mask.scatter_(1, clipped, True)[:, :size]


@dataclass
class _Stage:
    """One hop: which rows were sent (by index) and the split sizes, to run it backwards."""

    group: dist.ProcessGroup | None
    source_rows: torch.Tensor  # row of the hop's input each sent unit copies
    input_splits: list[int]
    output_splits: list[int]
    num_inputs: int


class DedupDispatch:
    """The handle :meth:`DedupTokenDispatcher.dispatch_tokens` returns: wait, then compute.

    Attributes:
        num_tokens_per_expert: ``[E_local]`` int64 rows per local expert.
        sizes: The same counts as Python ints (read on the host by the dispatch anyway).
        units_sent: Rows this rank sent per stage (one row per distinct destination).

    See Also:
        :class:`hp_cp_ep.DispatchedTokens`: the plain dispatcher's handle.
    """

    def __init__(self) -> None:
        self.num_tokens_per_expert: torch.Tensor
        self.sizes: list[int] = []
        self.units_sent: list[list[int]] = []
        self._stages: list[_Stage] = []
        self._payload: torch.Tensor
        self._pending = _PendingWork()
        self._finish: Any = None
        self._rows: torch.Tensor | None = None
        self._row_unit: torch.Tensor
        self._row_weight: torch.Tensor
        self._num_units = 0
        self._score_before = False

    def wait(self) -> torch.Tensor:
        """The rows of the local experts, grouped by local expert (blocks until they arrived)."""
        if self._rows is None:
            self._pending.wait()
            self._rows = self._finish()
        return self._rows


class DedupTokenDispatcher(TokenDispatcher):
    """Token dispatch that sends each token once per destination rank (or node).

    A drop-in :class:`~hp_cp_ep.TokenDispatcher` for :class:`~hp_cp_ep.MoE`: the layer hands it
    the tokens with their top-k experts and weights (:meth:`dispatch_tokens`) instead of one row
    per choice, and gets back the weighted sum over the choices (:meth:`combine_tokens`). The
    outputs and gradients are those of the plain dispatcher (the same sums, in another order).
    Installed by ``ExpertParallel(dedup=True)`` and ``ExpertTensorParallel(dedup=True)``;
    HyperParallel calls it
    ``DeredundencyTokenDispatcher`` (an alias here).

    Args:
        num_local_experts: Experts held by this rank.
        ep_group: Expert-parallel group (one stage), or ``None`` (one device, or ``node_groups``).
        tp_group: Tensor-parallel group over the experts' hidden dimension, or ``None``: the
            tokens are replicated over it, each TP rank's partial outputs are summed once on
            the combined tokens (``ExpertTensorParallel(dedup=True)``).
        node_groups: Keyword-only: ``(inter, intra)`` groups of a node axis (EP rank
            ``inter_rank * intra_size + intra_rank``): two-stage dispatch, one transfer per node
            then one per rank inside it. Exclusive with ``ep_group``.
        overlap_backward: Keyword-only: as for :class:`~hp_cp_ep.TokenDispatcher` (the gated
            all-to-all is the combine's last, the inter-node one with a node axis).

    Raises:
        ValueError: Both ``ep_group`` and ``node_groups`` given.

    See Also:
        :class:`hp_cp_ep.TokenDispatcher` (one row per choice); DeepEP's internode dispatch and
        HyperParallel's ``DeredundencyTokenDispatcher`` do the same de-duplication.
    """

    #: :class:`~hp_cp_ep.MoE` calls :meth:`dispatch_tokens` / :meth:`combine_tokens`.
    dispatches_tokens = True

    def __init__(
        self,
        num_local_experts: int,
        ep_group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
        *,
        node_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
        overlap_backward: bool = False,
    ) -> None:
        if node_groups is not None and ep_group is not None:
            raise ValueError(
                "DedupTokenDispatcher takes ep_group (one stage) or node_groups=(inter, intra) "
                "(two stages), not both"
            )
        super().__init__(
            num_local_experts,
            ep_group=ep_group,
            tp_group=tp_group,
            overlap_backward=overlap_backward,
        )
        self.node_groups = node_groups
        if node_groups is not None:
            inter, intra = node_groups
            self.inter_size = dist.get_world_size(inter)
            self.intra_size = dist.get_world_size(intra)
            self.ep_size = self.inter_size * self.intra_size
        else:
            self.inter_size, self.intra_size = self.ep_size, 1

    def replicate_hot_experts(self, *args: Any, **kwargs: Any) -> Any:
        """As :meth:`hp_cp_ep.TokenDispatcher.replicate_hot_experts`; a hot expert's choices
        alternate between owner and replica by ``(token + choice)`` parity.

        Raises:
            ValueError: With a node axis (the weight fetch needs a flat EP group), and as the
                plain dispatcher's.
        """
        if self.node_groups is not None:
            raise ValueError(
                "hot-expert replication needs a flat ep_group; this DedupTokenDispatcher has a "
                "node axis (inter, intra)"
            )
        return super().replicate_hot_experts(*args, **kwargs)

    def _groups(self) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        if self.node_groups is not None:
            return self.node_groups
        return self.ep_group, None

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        """The plain row dispatch (``GroupedExperts`` called directly); not with a node axis.

        Raises:
            ValueError: With ``node_groups`` (there is no flat EP group to send rows over).
        """
        if self.node_groups is not None:
            raise ValueError(
                "DedupTokenDispatcher with a node axis dispatches tokens through MoE "
                "(dispatch_tokens); the row-level dispatch needs a flat ep_group"
            )
        return super().dispatch(*args, **kwargs)

    def _check_all_peers(self, hidden: int, device: torch.device) -> None:
        mine = torch.tensor([self.num_local_experts, hidden], dtype=torch.int64, device=device)
        for group in self._groups():
            if group is None:
                continue
            everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
            dist.all_gather(everyone, mine, group=group)
            table = [tuple(row) for row in torch.stack(everyone).tolist()]  # once
            if any(row != table[0] for row in table):
                raise ValueError(
                    "expert-parallel ranks disagree on (local experts, hidden size): "
                    f"{table} per rank; every rank must build the same MoE"
                )
        self._checked_peers = True

    def dispatch_tokens(
        self,
        tokens: torch.Tensor,
        selected_experts: torch.Tensor,
        weights: torch.Tensor,
        *,
        score_before_experts: bool = False,
    ) -> DedupDispatch:
        """Send each token once to every rank holding one of its experts.

        Args:
            tokens: ``[T, dim]`` tokens.
            selected_experts: ``[T, k]`` global expert of each choice; ``E`` (the number of
                experts) marks a dropped choice (capacity), which goes nowhere.
            weights: ``[T, k]`` routing weights, in the tokens' dtype.
            score_before_experts: Scale the expert *inputs* by the weights (else the outputs).

        Returns:
            The handle; :meth:`DedupDispatch.wait` gives the local experts' rows.

        Raises:
            ValueError: Shapes disagree, or the token dtype cannot carry the expert ids.
        """
        num_tokens, top_k = selected_experts.shape
        if (
            tokens.ndim != 2
            or tokens.shape[0] != num_tokens
            or weights.shape
            != (
                num_tokens,
                top_k,
            )
        ):
            raise ValueError(
                f"dispatch_tokens takes tokens [T, dim], selected_experts and weights [T, k]; "
                f"got {tuple(tokens.shape)}, {tuple(selected_experts.shape)}, "
                f"{tuple(weights.shape)}"
            )
        id_dtype = _ID_DTYPE_OF_SIZE.get(tokens.element_size())
        local, inter, intra = self.num_local_experts, self.inter_size, self.intra_size
        replicas = self._replicas
        if replicas is not None:  # hot experts: choices alternate between owner and replica
            selected_experts = replicas.remap_choices(selected_experts.to(torch.int64))
            local = replicas.slots
        num_experts = local * self.ep_size
        if id_dtype is None or num_experts >= torch.iinfo(id_dtype).max:
            raise ValueError(
                f"DedupTokenDispatcher carries expert ids in the token dtype {tokens.dtype}: "
                f"{num_experts} experts do not fit (use 2-, 4- or 8-byte floats)"
            )
        outer, inner = self._groups()
        if outer is not None and not self._checked_peers:
            self._check_all_peers(tokens.shape[-1], tokens.device)
        me_outer = dist.get_rank(outer) if outer is not None else 0
        me_inner = dist.get_rank(inner) if inner is not None else 0
        ep_rank = me_outer * intra + me_inner
        ids = selected_experts.to(torch.int64)
        dim = tokens.shape[-1]
        carried = torch.cat([tokens, weights.to(tokens.dtype)], dim=1)
        if self.tp_group is not None:
            # each TP rank's slice of the experts gives a partial gradient of the tokens and of
            # the weights (they scale partial inputs or outputs): summed over TP in the backward
            carried = _CopyToTensorParallel.apply(carried, self.tp_group)  # type: ignore[no-untyped-call]
        payload = torch.cat([carried, ids.to(id_dtype).view(tokens.dtype)], dim=1)

        # -- counts (device only): units and choices per destination, then two small exchanges
        rank_of = ids // local  # dropped: ep_size
        node_of = rank_of // intra  # dropped: inter
        to_node = _member_mask(node_of, inter)  # [T, inter]
        to_rank = _member_mask(rank_of, inter * intra)  # [T, ep]
        choices = count_choices(ids, num_experts + 1)[:num_experts]  # bin E: dropped
        table = torch.cat(
            [
                to_node.sum(0).view(inter, 1),
                to_rank.sum(0).view(inter, intra),
                choices.view(inter, intra * local),
            ],
            dim=1,
        ).to(torch.int64)
        if outer is not None:
            received = torch.empty_like(table)
            dist.all_to_all_single(received, table.contiguous(), group=outer)
        else:
            received = table
        relay_units = received[:, 1 : 1 + intra].sum(0)  # stage-2 rows this rank forwards, per j
        relay_choices = received[:, 1 + intra :].sum(0).view(intra, local)
        second = torch.cat([relay_units.view(intra, 1), relay_choices], dim=1)
        if inner is not None:
            final = torch.empty_like(second)
            dist.all_to_all_single(final, second.contiguous(), group=inner)
        else:
            final = second
        # The one host sync: every split size of both stages and the rows per local expert.
        host = torch.cat(
            [table[:, 0], received[:, 0], relay_units, final[:, 0], final[:, 1:].sum(0)]
        ).tolist()
        send1, recv1 = host[:inter], host[inter : 2 * inter]
        send2, recv2 = host[2 * inter : 2 * inter + intra], host[2 * inter + intra : -local]
        sizes = [int(n) for n in host[-local:]]
        self.last_received_rows = sum(sizes)

        handle = DedupDispatch()
        handle.num_tokens_per_expert = final[:, 1:].sum(0)
        handle.sizes = sizes
        handle.units_sent = [send1] + ([send2] if inner is not None else [])
        units1 = _positions(to_node.t(), sum(send1)) % max(num_tokens, 1)
        stage1 = _Stage(outer, units1, send1, recv1, num_tokens)
        handle._stages.append(stage1)
        sent1 = payload.index_select(0, units1)
        if outer is not None:
            got1 = _AllToAllTokens.apply(sent1, recv1, send1, outer, handle._pending)  # type: ignore[no-untyped-call]
        else:
            got1 = sent1

        def finish() -> torch.Tensor:
            got = got1
            if inner is not None:  # stage 2: forward inside the node, once per rank
                got_ids = got[:, dim + top_k :].contiguous().view(id_dtype).to(torch.int64)
                got_rank = got_ids // local
                target = torch.where(got_rank // intra == me_outer, got_rank % intra, intra)
                count = sum(send2)
                units2 = _positions(_member_mask(target, intra).t(), count) % max(got.shape[0], 1)
                handle._stages.append(_Stage(inner, units2, send2, recv2, got.shape[0]))
                got = _AllToAllTokens.apply(  # type: ignore[no-untyped-call]
                    got.index_select(0, units2), recv2, send2, inner, None
                )
            # fan out: one row per (unit, local choice), grouped by local expert
            got_ids = got[:, dim + top_k :].contiguous().view(id_dtype).to(torch.int64)
            mine = got_ids - ep_rank * local
            key = torch.where((mine >= 0) & (mine < local), mine, local).reshape(-1)
            order = torch.sort(key, stable=True).indices[: sum(sizes)]
            handle._row_unit = order // top_k
            handle._num_units = got.shape[0]
            handle._row_weight = got[:, dim : dim + top_k].reshape(-1).index_select(0, order)
            rows: torch.Tensor = got[:, :dim].index_select(0, handle._row_unit)
            if score_before_experts:
                rows = rows * handle._row_weight.unsqueeze(-1)
            return rows

        handle._finish = finish
        handle._score_before = score_before_experts
        return handle

    def combine_tokens(
        self,
        expert_out: torch.Tensor,
        handle: DedupDispatch,
        *,
        overlap: BackwardOverlap | None = None,
    ) -> torch.Tensor:
        """Weight, sum and return the experts' outputs: ``[T, dim]``, each token's choices summed.

        Args:
            expert_out: ``[rows, dim]`` outputs of the local experts, in the order of
                :meth:`DedupDispatch.wait`'s rows.
            handle: The dispatch being undone.
            overlap: Keyword-only: a :class:`~hp_cp_ep.BackwardOverlap` whose backward runs
                while the backward all-to-all of the last stage is in flight.
        """
        if not handle._score_before:
            expert_out = expert_out * handle._row_weight.unsqueeze(-1)
        out = expert_out.new_zeros((handle._num_units, expert_out.shape[-1]))
        out = out.index_add(0, handle._row_unit, expert_out)
        for stage in reversed(handle._stages):
            if stage.group is not None:
                gated = overlap if stage is handle._stages[0] else None
                out = _send_back(out, stage.input_splits, stage.output_splits, stage.group, gated)
            elif overlap is not None:
                overlap.attach(None)
            summed = out.new_zeros((stage.num_inputs, out.shape[-1]))
            out = summed.index_add(0, stage.source_rows, out)
        if self.tp_group is not None:
            # weighting, fan-in and all-to-all are linear: the TP ranks' partial sums travel
            # back as they are and are summed once here, on the T tokens (the fewest rows)
            out = _ReduceFromTensorParallel.apply(out, self.tp_group)  # type: ignore[no-untyped-call]
        return out


#: HyperParallel's name for :class:`DedupTokenDispatcher`.
DeredundencyTokenDispatcher = DedupTokenDispatcher
