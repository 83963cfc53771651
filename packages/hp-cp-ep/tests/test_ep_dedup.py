"""De-duplicating token dispatch: outputs, gradients, bytes and host syncs against the plain one.

Oracle: the same MoE parallelized with the plain :class:`TokenDispatcher` (itself checked against
one process in ``test_ep_parallel.py``), same weights, different tokens on every rank, a gate
skewed so that most tokens pick expert 0 and one of its rank-mates. Bytes are the rows each rank
sends to its peers in the token all-to-alls, checked against the formula computed here from the
routing of every rank's batch (every rank can rebuild every batch).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from hp_cp_ep import (
    DedupTokenDispatcher,
    DeredundencyTokenDispatcher,
    ExpertParallel,
    MoE,
    MoEArgs,
)
from hp_dtensor.testing import count_host_syncs, distributed

DIM, HIDDEN, TOKENS = 32, 16, 12
EXACT: dict[str, Any] = {"rtol": 1e-6, "atol": 1e-6}


def _skewed_moe(num_experts: int, hot: tuple[int, int] = (0, 1), **overrides: Any) -> MoE:
    """Same weights everywhere; experts ``hot`` (on one rank) take most choices, the last none."""
    torch.manual_seed(0)
    options: dict[str, Any] = {
        "num_experts": num_experts,
        "top_k": 2,
        "num_shared_experts": 1,
        "score_before_experts": False,
        "route_norm": True,
    }
    options.update(overrides)
    moe = MoE(MoEArgs(**options), DIM, HIDDEN)
    with torch.no_grad():
        gate = moe.router.gate.weight
        for expert in hot:
            gate[expert] = gate[expert].abs() + 0.5
        if num_experts - 1 not in hot:
            gate[-1] = -gate[-1].abs() - 0.5
    return moe


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.rand(TOKENS, DIM, generator=gen), torch.randn(TOKENS, DIM, generator=gen)


class _TokenBytes:
    """Spy on ``all_to_all_single``: bytes of floating rows sent to *other* ranks, per call."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self._real = dist.all_to_all_single

    def __enter__(self) -> _TokenBytes:
        real = self._real

        def spy(output: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if inp.dtype.is_floating_point:
                group = kwargs.get("group")
                me = dist.get_rank(group)
                splits = kwargs.get("input_split_sizes")
                per_row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
                rows = sum(n for p, n in enumerate(splits) if p != me) if splits else 0
                self.calls.append(rows * per_row)
            return real(output, inp, *args, **kwargs)

        dist.all_to_all_single = spy  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_to_all_single = self._real


def _run(moe: MoE, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    moe.zero_grad()
    out = moe(x.clone().requires_grad_())
    (out * target).sum().backward()
    grads = {}
    for name, param in moe.named_parameters():
        grad = param.grad
        grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return out.detach(), grads


def _parity(
    mesh: Any, num_experts: int, hot: tuple[int, int] = (0, 1), **overrides: Any
) -> tuple[list[int], list[int]]:
    """Dedup vs plain EP on ``mesh``: outputs and gradients within 1e-6; the bytes of each."""
    rank = dist.get_rank()
    reference = _skewed_moe(num_experts, hot, **overrides)
    plain, dedup = copy.deepcopy(reference), copy.deepcopy(reference)
    flat = mesh if mesh.ndim == 1 else None
    if flat is None:  # the plain oracle on the flattened EP ranks, in the same order
        flat = init_device_mesh("cpu", (mesh.size(),), mesh_dim_names=("ep",))
    parallelize_module(plain.experts, flat, ExpertParallel())
    parallelize_module(dedup.experts, mesh, ExpertParallel(dedup=True))
    assert isinstance(dedup.experts.token_dispatcher, DedupTokenDispatcher)
    w1 = dedup.experts.w1
    assert isinstance(w1, DTensor)
    assert w1.to_local().shape[0] == num_experts // mesh.size()
    torch.testing.assert_close(w1.full_tensor(), reference.experts.w1, **EXACT)
    x, target = _batch(rank)
    with _TokenBytes() as plain_bytes:
        expected_out, expected = _run(plain, x, target)
    with _TokenBytes() as dedup_bytes:
        out, grads = _run(dedup, x, target)
    torch.testing.assert_close(out, expected_out, **EXACT)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], **EXACT, msg=name)
    return plain_bytes.calls, dedup_bytes.calls


def _routing(moe: MoE, rank: int) -> torch.Tensor:
    selected: torch.Tensor = moe.router(_batch(rank)[0])[1]
    return selected


def _flat_bytes(
    num_experts: int, top_k: int, rank: int, world: int, hot: tuple[int, int] = (0, 1)
) -> tuple[list[int], list[int]]:
    """Bytes of the four token all-to-alls (dispatch, combine, their backwards), plain and dedup.

    Plain: one row of ``DIM`` per routed choice. Dedup: the dispatch rows carry the token, ``k``
    weights and ``k`` ids, the combine's rows the summed output only. A rank sends its own
    tokens in the dispatch and the combine's backward, its peers' in the other two.
    """
    moe = _skewed_moe(num_experts, hot, top_k=top_k)
    dest = [_routing(moe, r) // (num_experts // world) for r in range(world)]
    out_choices = int((dest[rank] != rank).sum())
    in_choices = sum(int((dest[q] == rank).sum()) for q in range(world) if q != rank)
    out_units = sum(int((dest[rank] == p).any(dim=1).sum()) for p in range(world) if p != rank)
    in_units = sum(int((dest[q] == rank).any(dim=1).sum()) for q in range(world) if q != rank)
    row, full_row = DIM * 4, (DIM + 2 * top_k) * 4
    plain = [out_choices * row, in_choices * row, out_choices * row, in_choices * row]
    return plain, [out_units * full_row, in_units * row, out_units * row, in_units * full_row]


def _fewer_in_total(plain: list[int], dedup: list[int]) -> None:
    """Summed over the ranks, the dedup moves fewer bytes in each of the four all-to-alls.

    (A rank whose outgoing tokens share no rank pays the ``2k`` columns of weights and ids.)
    """
    totals = torch.tensor([plain, dedup], dtype=torch.int64)
    dist.all_reduce(totals)
    assert bool((totals[1] < totals[0]).all()), totals.tolist()


@distributed(world_size=2)
def test_dedup_matches_plain_ep2_and_sends_fewer_bytes() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    plain, dedup = _parity(mesh, 4, hot=(2, 3))  # rank 1's two experts take most choices
    want_plain, want_dedup = _flat_bytes(4, 2, rank, world, hot=(2, 3))
    assert (plain, dedup) == (want_plain, want_dedup)
    _fewer_in_total(plain, dedup)
    # score before the experts, softmax, capacity drops
    _parity(mesh, 4, score_before_experts=True, score_func="softmax", capacity_factor=1.0)
    # the alias is the same class
    assert DeredundencyTokenDispatcher is DedupTokenDispatcher


@distributed(world_size=3)
def test_dedup_matches_plain_ep3() -> None:
    mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("ep",))
    rank = dist.get_rank()
    plain, dedup = _parity(mesh, 6, top_k=3, num_shared_experts=0, use_grouped_mm=False)
    want_plain, want_dedup = _flat_bytes(6, 3, rank, 3)
    assert (plain, dedup) == (want_plain, want_dedup)
    _fewer_in_total(plain, dedup)


@distributed(world_size=4)
def test_dedup_matches_plain_ep4_and_node_axis_2x2() -> None:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    plain, dedup = _parity(mesh, 8, top_k=3)
    want_plain, want_dedup = _flat_bytes(8, 3, rank, 4)
    assert (plain, dedup) == (want_plain, want_dedup)
    _fewer_in_total(plain, dedup)
    nodes = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))
    plain, dedup = _parity(nodes, 8, top_k=3)
    # stage 1 (inter-node): one row per (token, other node); stage 2 (intra-node): the relay
    # forwards, once per (token, rank of its node), the rows of every source with its intra index
    a, b = divmod(rank, 2)
    experts_per_rank, k = 2, 3
    row = (DIM + 2 * k) * 4
    mine = _routing(_skewed_moe(8, top_k=k), rank) // experts_per_rank
    inter_units = int(((mine // 2) == 1 - a).any(dim=1).sum())
    intra_units = 0
    for source_node in range(2):
        theirs = _routing(_skewed_moe(8, top_k=k), source_node * 2 + b) // experts_per_rank
        intra_units += int((theirs == a * 2 + (1 - b)).any(dim=1).sum())
    assert dedup[:2] == [inter_units * row, intra_units * row], (dedup, inter_units, intra_units)
    cross_node_plain = int(((mine // 2) != a).sum()) * DIM * 4
    _fewer_in_total([cross_node_plain], dedup[:1])  # inter-node bytes: fewer than the plain's
    # capacity over the EP group needs a flat group: refused with the node axis, not ignored
    grouped = _skewed_moe(8, top_k=3, capacity_factor=1.0, capacity_scope="ep_group")
    parallelize_module(grouped.experts, nodes, ExpertParallel(dedup=True))
    with pytest.raises(ValueError, match="has a node axis"):
        grouped(_batch(rank)[0])


def _syncs(moe: MoE) -> tuple[int, int, dict[str, int]]:
    x, target = _batch(dist.get_rank())
    (moe(x) * target).sum().backward()  # the first forward checks the peers once
    with count_host_syncs() as forward:
        out = moe(x)
    with count_host_syncs() as backward:
        (out * target).sum().backward()
    return forward.total, backward.total, dict(forward.by_op)


@distributed(world_size=4)
def test_dedup_keeps_one_host_sync_per_forward() -> None:
    for shape in [(4,), (2, 2)]:
        mesh = init_device_mesh("cpu", shape)
        configs: list[dict[str, Any]] = [{}, {"capacity_factor": 1.0, "score_before_experts": True}]
        for overrides in configs:
            moe = _skewed_moe(8, top_k=3, **overrides)
            parallelize_module(moe.experts, mesh, ExpertParallel(dedup=True))
            forward, backward, by_op = _syncs(moe)
            assert (forward, backward, by_op) == (1, 0, {"tolist": 1}), (shape, overrides)


def test_dedup_one_device_and_errors() -> None:
    reference = _skewed_moe(4, top_k=3)
    moe = copy.deepcopy(reference)
    moe.experts.token_dispatcher = DedupTokenDispatcher(4)
    x, target = _batch(0)
    out, grads = _run(moe, x, target)
    expected_out, expected = _run(reference, x, target)
    torch.testing.assert_close(out, expected_out, **EXACT)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], **EXACT, msg=name)
    with pytest.raises(ValueError, match="selected_experts and weights"):
        DedupTokenDispatcher(4).dispatch_tokens(x, torch.zeros(5, 2, dtype=torch.long), x)
    with pytest.raises(ValueError, match="carries expert ids"):
        DedupTokenDispatcher(4).dispatch_tokens(
            x.to(torch.float8_e4m3fn), torch.zeros(TOKENS, 1, dtype=torch.long), x[:, :1]
        )
    with pytest.raises(TypeError, match="dedup must be a bool"):
        ExpertParallel(dedup=1)  # type: ignore[arg-type]
    assert ExpertParallel().dedup is False
