"""Muon for sharded parameters: every matrix orthogonalised once, on its owner rank.

Muon orthogonalises each 2-D update with a Newton-Schulz iteration, which needs the whole
matrix. Instead of gathering every matrix on every rank (N times the work), each matrix has one
*owner* rank in the process group of its parameter's mesh, chosen once by a greedy balance of the
Newton-Schulz cost ``m * n * min(m, n)`` (largest first, to the least loaded rank; a rank that
already holds the whole matrix is preferred, so expert-parallel experts stay where they are). A
step then costs, per mesh:

1. the momentum and Nesterov updates, element-wise on the local shards (the momentum buffer is a
   DTensor sharded like the parameter);
2. one ``all_to_all_single`` that sends every shard of the update to the owner of its matrix
   (cast to the gather dtype: bf16 by default, as Moonlight does; the iteration starts by
   rounding to bf16 anyway, so bf16 and fp32 give the same result and bf16 halves the bytes);
3. Newton-Schulz on the owned matrices only (1/N of the work);
4. one ``all_to_all_single`` that returns every rank its part of each result (bf16: the
   iteration's output dtype), replicas included (HSDP);
5. weight decay and the shape-adjusted learning rate, element-wise on the local shards.

Both all-to-alls are issued asynchronously: the AdamW groups (on the local shards) and the
matrices a rank holds whole are computed while the gather is in flight. With ``bucket_size``
the matrices of a group are split into buckets of whole parameters, each with its pair of
all-to-alls, pipelined (a bucket's gather flies while the previous one is orthogonalised) and
balanced together (the owners' load carries over from bucket to bucket).

Where the data live comes from each rank's own shard boxes (DTensor placements: ``Shard``,
uneven shards, ``_StridedShard`` of FSDP x TP, ``Replicate``), exchanged once when a plan is
built. A 3-D parameter is a stack of matrices along dim 0 (``GroupedExperts``' ``w1/w2/w3``):
each expert matrix is its own unit with its own owner. Plain tensors are orthogonalised locally.

Parameter groups with ``use_muon=False`` (1-D parameters, embeddings, output heads in the usual
recipe) are stepped with AdamW's update rule and AdamW's state layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from hp_dtensor._torch_compat import (
    compute_local_shape_and_global_offset,
    flatten_mesh,
    local_tensor,
)

__all__ = ["Muon", "get_hyper_optimizer"]

_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_GATHER_DTYPES = (torch.bfloat16, torch.float32)


def _orthogonalize(
    matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """Quintic Newton-Schulz iteration towards the nearest semi-orthogonal matrix (in bf16).

    Works on a bf16 copy: ``matrix`` itself is never modified.
    """
    a, b, c = coefficients
    wide = matrix.size(0) <= matrix.size(1)
    x = matrix.to(torch.bfloat16, copy=True)
    if not wide:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x if wide else x.T


def _newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """Matrix-multiply FLOPs of :func:`_orthogonalize` on a ``rows x cols`` matrix.

    Per iteration, with ``r = min(rows, cols)`` and ``c = max(rows, cols)``: the Gram matrix
    (``2 r^2 c``), its square (``2 r^3``) and the product with ``x`` (``2 r^2 c``).
    """
    r, c = min(rows, cols), max(rows, cols)
    return steps * (4 * r * r * c + 2 * r * r * r)


def _lr_scale(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))  # "match_rms_adamw" (Moonlight)


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t) if isinstance(t, DTensor) else t


def _grad_like(p: torch.Tensor) -> torch.Tensor:
    """``p.grad`` laid out like ``p`` (a gradient left ``Partial`` is reduced here)."""
    grad = p.grad
    assert grad is not None
    if isinstance(p, DTensor) and isinstance(grad, DTensor) and grad.placements != p.placements:
        grad = grad.redistribute(p.device_mesh, p.placements)
    return grad


def _as_stack(t: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor as a stack of one matrix; 3-D tensors are stacks already."""
    return t.unsqueeze(0) if t.ndim == 2 else t


# ----------------------------------------------------------------------------------------------
# The plan: who owns which matrix, who sends what to whom
# ----------------------------------------------------------------------------------------------


@dataclass
class _Unit:
    """One matrix: expert ``expert`` (0 for a 2-D parameter) of entry ``entry`` of a mesh plan."""

    entry: int
    expert: int
    rows: int
    cols: int
    owner: int = -1
    # pieces the owner assembles: (source rank, row0, col0, rows, cols), in a fixed order
    pieces: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    # (rank, row0, col0, rows, cols, local expert) of every rank holding a part of the matrix
    holders: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)


@dataclass
class _MeshPlan:
    """The static plan of the Muon parameters that share one process group (or none)."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    entries: list[tuple[int, int]]  # (group index, parameter index) into param_groups
    units: list[_Unit]
    owned: list[int]  # indices into units: those held whole here first, then in unit order
    # gather: per destination rank, the (entry, local expert) slabs this rank sends
    gather_send: list[list[tuple[int, int]]]
    gather_send_counts: list[int]
    # gather: per source rank, (unit, row0, col0, rows, cols) this rank receives
    gather_recv: list[list[tuple[int, int, int, int, int]]]
    gather_recv_counts: list[int]
    # scatter: per destination rank, (unit, row0, col0, rows, cols) of owned results sent
    scatter_send: list[list[tuple[int, int, int, int, int]]]
    scatter_send_counts: list[int]
    # scatter: per source rank, the (entry, local expert) slabs this rank receives
    scatter_recv: list[list[tuple[int, int]]]
    scatter_recv_counts: list[int]
    needs_gather: bool
    needs_scatter: bool
    # this rank's (rank, row0, col0, rows, cols, local expert) of each unit it holds a part of
    local_piece: dict[int, tuple[int, int, int, int, int, int]]
    # owned unit -> (offset in the gather's receive buffer, row0, col0, rows, cols)
    incoming: dict[int, list[tuple[int, int, int, int, int]]]


def _mesh_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """One process group over all ranks of ``mesh`` (the default group if it spans them all)."""
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD  # type: ignore[return-value]
    if mesh.ndim == 1:
        return mesh.get_group()
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError(
            f"Muon: parameters on a {mesh.ndim}-D device mesh of {mesh.size()} of "
            f"{dist.get_world_size()} ranks need mesh_dim_names (the mesh is flattened into one "
            f"process group); got an unnamed mesh {mesh}"
        )
    return flatten_mesh(mesh, "_".join(names)).get_group()


def _box(param: torch.Tensor) -> list[int]:
    """Global shape and this rank's box, in the (stack, rows, cols) view: 9 integers."""
    stack = param.shape if param.ndim == 3 else (1, *param.shape)
    if not isinstance(param, DTensor):
        return [*stack, 0, 0, 0, *stack]
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    if tuple(shape) != tuple(local_tensor(param).shape):
        raise ValueError(
            f"Muon: a parameter of shape {tuple(param.shape)} with placements "
            f"{param.placements} holds a local tensor of shape "
            f"{tuple(local_tensor(param).shape)}, not the box {tuple(shape)}; this layout "
            "is not supported"
        )
    if param.ndim == 2:
        shape, offset = (1, *shape), (0, *offset)
    return [*stack, *offset, *shape]


def _check_tiling(boxes: list[list[int]], where: str) -> None:
    """The distinct boxes of all ranks tile the global tensor (each element held once)."""
    e, r, c = boxes[0][:3]
    distinct = {tuple(b[3:]) for b in boxes if all(b[6:])}
    volume = sum(b[3] * b[4] * b[5] for b in distinct)
    spans = sorted(distinct)
    for i, a in enumerate(spans):
        for b in spans[i + 1 :]:
            if all(max(a[d], b[d]) < min(a[d] + a[d + 3], b[d] + b[d + 3]) for d in range(3)):
                raise ValueError(f"Muon: the shards of {where} overlap partially: {a} and {b}")
    if volume != e * r * c:
        raise ValueError(
            f"Muon: the shards of {where} cover {volume} of its {e * r * c} elements; this "
            "layout is not supported"
        )


def _build_plan(
    group: dist.ProcessGroup | None,
    entries: list[tuple[int, int]],
    params: list[torch.Tensor],
    load: list[int] | None = None,
) -> _MeshPlan:
    """Exchange the shard boxes once, assign owners, and derive this rank's sends/receives.

    ``load`` is the Newton-Schulz cost already given to each rank of the group by the plans of
    earlier buckets (updated in place), so the balance holds over all of them.
    """
    mine = torch.tensor([_box(p) for p in params], dtype=torch.int64)
    if group is None:
        size, rank = 1, 0
        all_boxes = [mine]
    else:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        device = _local(params[0]).device
        count = torch.tensor([len(params)], dtype=torch.int64, device=device)
        counts = [torch.empty_like(count) for _ in range(size)]
        dist.all_gather(counts, count, group=group)
        numbers = torch.cat(counts).tolist()  # one host read, when the plan is built
        if len(set(numbers)) != 1:
            raise ValueError(
                f"Muon: the ranks of one mesh step different numbers of matrices with a "
                f"gradient ({numbers}); every rank of a mesh must hold the same parameters"
            )
        mine_dev = mine.to(device)
        gathered = [torch.empty_like(mine_dev) for _ in range(size)]
        dist.all_gather(gathered, mine_dev, group=group)
        all_boxes = [t.cpu() for t in gathered]
    boxes = [[all_boxes[q][k].tolist() for q in range(size)] for k in range(len(params))]
    for k, per_rank in enumerate(boxes):
        shapes = {tuple(b[:3]) for b in per_rank}
        if len(shapes) != 1:
            raise ValueError(
                f"Muon: matrix {k} of a mesh has different global shapes on its ranks "
                f"({sorted(shapes)}); every rank of a mesh must hold the same parameters"
            )
        _check_tiling(per_rank, f"a parameter of shape {tuple(params[k].shape)}")

    # the units and their holders
    units: list[_Unit] = []
    for k, per_rank in enumerate(boxes):
        n_stack, rows, cols = per_rank[0][:3]
        for e in range(n_stack):
            unit = _Unit(entry=k, expert=e, rows=rows, cols=cols)
            for q, b in enumerate(per_rank):
                e0, r0, c0, ne, nr, nc = b[3:]
                if e0 <= e < e0 + ne and nr and nc:
                    unit.holders.append((q, r0, c0, nr, nc, e - e0))
            units.append(unit)

    # owners: largest cost first, to the least loaded rank (full holders preferred)
    if load is None:
        load = [0] * size
    order = sorted(
        range(len(units)),
        key=lambda i: (-units[i].rows * units[i].cols * min(units[i].rows, units[i].cols), i),
    )
    for i in order:
        unit = units[i]
        full = [h[0] for h in unit.holders if h[3] == unit.rows and h[4] == unit.cols]
        candidates = full or list(range(size))
        owner = min(candidates, key=lambda q: (load[q], q))
        unit.owner = owner
        load[owner] += unit.rows * unit.cols * min(unit.rows, unit.cols)

    # sources of the pieces: the owner where it holds the piece, otherwise one holder per piece
    gather_send: list[list[tuple[int, int]]] = [[] for _ in range(size)]
    gather_send_counts = [0] * size
    gather_recv: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(size)]
    gather_recv_counts = [0] * size
    scatter_send: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(size)]
    scatter_send_counts = [0] * size
    scatter_recv: list[list[tuple[int, int]]] = [[] for _ in range(size)]
    scatter_recv_counts = [0] * size
    needs_gather = needs_scatter = False
    owned: list[int] = []
    for i, unit in enumerate(units):
        owner = unit.owner
        by_piece: dict[tuple[int, int, int, int], list[tuple[int, int]]] = {}
        for q, r0, c0, nr, nc, el in unit.holders:
            by_piece.setdefault((r0, c0, nr, nc), []).append((q, el))
        for n, (key, holders) in enumerate(sorted(by_piece.items())):
            local = [h for h in holders if h[0] == owner]
            src, el = local[0] if local else holders[(i + n) % len(holders)]
            unit.pieces.append((src, *key))
            if src != owner:
                needs_gather = True
                numel = key[2] * key[3]
                if src == rank:
                    gather_send[owner].append((unit.entry, el))
                    gather_send_counts[owner] += numel
                if owner == rank:
                    gather_recv[src].append((i, *key))
                    gather_recv_counts[src] += numel
        for q, r0, c0, nr, nc, el in unit.holders:
            if q == owner:
                continue
            needs_scatter = True
            if owner == rank:
                scatter_send[q].append((i, r0, c0, nr, nc))
                scatter_send_counts[q] += nr * nc
            if q == rank:
                scatter_recv[owner].append((unit.entry, el))
                scatter_recv_counts[owner] += nr * nc
        if owner == rank:
            owned.append(i)
    local_piece = {i: h for i, unit in enumerate(units) for h in unit.holders if h[0] == rank}
    incoming: dict[int, list[tuple[int, int, int, int, int]]] = {}
    at = 0
    for src in range(size):
        for i, r0, c0, nr, nc in gather_recv[src]:
            incoming.setdefault(i, []).append((at, r0, c0, nr, nc))
            at += nr * nc

    def whole_here(i: int) -> bool:
        piece = local_piece.get(i)
        return piece is not None and piece[3:5] == (units[i].rows, units[i].cols)

    owned.sort(key=lambda i: not whole_here(i))  # no wait for the gather: first
    return _MeshPlan(
        group=group,
        size=size,
        rank=rank,
        entries=entries,
        units=units,
        owned=owned,
        gather_send=gather_send,
        gather_send_counts=gather_send_counts,
        gather_recv=gather_recv,
        gather_recv_counts=gather_recv_counts,
        scatter_send=scatter_send,
        scatter_send_counts=scatter_send_counts,
        scatter_recv=scatter_recv,
        scatter_recv_counts=scatter_recv_counts,
        needs_gather=needs_gather,
        needs_scatter=needs_scatter,
        local_piece=local_piece,
        incoming=incoming,
    )


def _exchange(
    plan: _MeshPlan,
    send: torch.Tensor,
    send_counts: list[int],
    recv_counts: list[int],
) -> tuple[torch.Tensor, dist.Work]:
    """One ``all_to_all_single`` over the plan's group (counts in elements), issued async."""
    recv = send.new_empty(sum(recv_counts))
    work = dist.all_to_all_single(
        recv, send, recv_counts, send_counts, group=plan.group, async_op=True
    )
    assert work is not None
    return recv, work


def _cat(pieces: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)


@dataclass
class _MeshStep:
    """One step's tensors of one mesh plan, between the phases of :meth:`Muon.step`."""

    plan: _MeshPlan
    groups: list[dict[str, Any]]
    params: list[torch.Tensor]
    grads: list[torch.Tensor]  # local gradients as (stack, rows, cols)
    bufs: list[torch.Tensor]  # local momentum buffers (updated) as (stack, rows, cols)
    sent: torch.Tensor | None = None  # kept alive until the collective completes
    received: torch.Tensor | None = None
    work: dist.Work | None = None
    # (entry, local matrix, result) of the owned matrices' parts that stay on this rank
    local_results: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)


class Muon(torch.optim.Optimizer):
    """Muon (momentum + Newton-Schulz orthogonalization) that divides the work over ranks.

    Same signature, defaults and update rule as ``torch.optim.Muon``. For DTensor parameters
    each matrix is orthogonalised once, on an owner rank of its mesh (owners balanced by the
    Newton-Schulz cost); per step and mesh (and ``bucket_size`` bucket), one
    ``all_to_all_single`` brings the update's shards to the owners and one returns the results,
    whatever the number of parameters. Extensions:
    per group, ``use_muon=False`` steps that group with AdamW (keys ``betas``, ``eps``,
    ``weight_decay``, ``lr``; defaults from the keyword-only ``adamw_betas``/``adamw_eps``);
    3-D parameters are stacks of matrices along dim 0 (expert weights), each orthogonalised on
    its own with the learning rate adjusted for the matrix shape.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate.
        weight_decay: Decoupled weight decay.
        momentum: Momentum factor.
        nesterov: Use Nesterov momentum.
        ns_coefficients: Coefficients ``(a, b, c)`` of the quintic Newton-Schulz polynomial.
        eps: Floor of the norm the update is divided by before the iteration.
        ns_steps: Newton-Schulz iterations (< 100).
        adjust_lr_fn: ``None``/``"original"`` (``sqrt(max(1, rows/cols))``) or
            ``"match_rms_adamw"`` (``0.2 * sqrt(max(rows, cols))``).
        adamw_betas: Keyword-only: default ``betas`` of ``use_muon=False`` groups.
        adamw_eps: Keyword-only: default ``eps`` of ``use_muon=False`` groups.
        gather_dtype: Keyword-only: dtype of the update's shards sent to the owners,
            ``torch.bfloat16`` (default, half the bytes) or ``torch.float32``. The iteration
            rounds its input to bf16 first, so both give the same result.
        bucket_size: Keyword-only: at most this many elements of matrices (whole parameters,
            one at least) per pair of all-to-alls; the buckets are pipelined (the next one's
            gather flies while one is orthogonalised) and bound the buffers alive at once.
            ``None`` (default): one bucket per process group.

    Raises:
        ValueError: A Muon group holds a parameter that is neither 2-D nor 3-D (give it a
            group with ``use_muon=False``), a hyper-parameter is out of range, ``gather_dtype``
            is not bf16 or fp32, or ``bucket_size`` is not a positive integer.
        TypeError: ``gather_dtype`` is not a ``torch.dtype``.

    See Also:
        :pt:`torch.optim.Muon`: PyTorch's single-process Muon; HyperParallel's Muon via
        ``get_hyper_optimizer``; TorchTitan's :titan:`DistMuon`.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = _NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        gather_dtype: torch.dtype = torch.bfloat16,
        bucket_size: int | None = None,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Muon: lr must be >= 0, got {lr}")
        if momentum < 0:
            raise ValueError(f"Muon: momentum must be >= 0, got {momentum}")
        if weight_decay < 0:
            raise ValueError(f"Muon: weight_decay must be >= 0, got {weight_decay}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(
                f"Muon: adjust_lr_fn must be None, 'original' or 'match_rms_adamw', "
                f"got {adjust_lr_fn!r}"
            )
        if len(ns_coefficients) != 3:
            raise ValueError(f"Muon: ns_coefficients needs 3 values, got {ns_coefficients}")
        if not 0 <= ns_steps < 100:
            raise ValueError(f"Muon: ns_steps must be in [0, 100), got {ns_steps}")
        if not isinstance(gather_dtype, torch.dtype):
            raise TypeError(
                f"Muon: gather_dtype must be a torch.dtype (torch.bfloat16 or torch.float32), "
                f"got {type(gather_dtype).__name__} {gather_dtype!r}"
            )
        if gather_dtype not in _GATHER_DTYPES:
            raise ValueError(
                f"Muon: gather_dtype must be torch.bfloat16 or torch.float32, got {gather_dtype}"
            )
        if bucket_size is not None and (
            isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1
        ):
            raise ValueError(
                f"Muon: bucket_size must be None or an integer >= 1 (elements), got {bucket_size!r}"
            )
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "use_muon": True,
        }
        super().__init__(params, defaults)
        self.gather_dtype = gather_dtype
        self.bucket_size = bucket_size
        self._plans: dict[tuple[tuple[int, int], ...], list[_MeshPlan]] = {}
        self._last_plans: list[_MeshPlan] = []
        for group in self.param_groups:
            if not group["use_muon"]:
                group.setdefault("betas", adamw_betas)
                group.setdefault("adamw_eps", adamw_eps)
                continue
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(
                        f"Muon: parameter of shape {tuple(p.shape)} is not 2-D (or a 3-D stack "
                        "of matrices); put it in a group with use_muon=False (AdamW) or use "
                        "get_hyper_optimizer()"
                    )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Take one optimization step.

        Args:
            closure: Re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, if any.

        See Also:
            :pt:`torch.optim.Muon.step`.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon_step()
        return loss

    def __getstate__(self) -> dict[str, Any]:
        # the plans hold process groups: rebuilt at the next step, never pickled or copied
        extra = {"gather_dtype": self.gather_dtype, "bucket_size": self.bucket_size}
        return {**super().__getstate__(), **extra}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("gather_dtype", torch.bfloat16)
        self.__dict__.setdefault("bucket_size", None)
        self._plans = {}
        self._last_plans = []

    def work_division(self) -> dict[str, int]:
        """This rank's share of the Muon work, from the plan of the last step.

        Returns:
            ``matrices`` (the matrices of the meshes this rank belongs to), ``owned`` (those
            this rank orthogonalises), ``ns_flops`` and ``ns_flops_total`` (Newton-Schulz
            matrix-multiply FLOPs of this rank and of all those matrices), ``gather_bytes`` and
            ``scatter_bytes`` (sent by this rank to other ranks per step) and ``collectives``
            (per step).

        See Also:
            :pt:`torch.optim.Muon`: the same arithmetic in one process.
        """
        keys = ("matrices", "owned", "ns_flops", "ns_flops_total", "gather_bytes")
        out = dict.fromkeys((*keys, "scatter_bytes", "collectives"), 0)
        gather_size = torch.empty((), dtype=self.gather_dtype).element_size()
        for plan in self._last_plans:
            steps = [self.param_groups[g]["ns_steps"] for g, _ in plan.entries]
            for unit in plan.units:
                flops = _newton_schulz_flops(unit.rows, unit.cols, steps[unit.entry])
                out["matrices"] += 1
                out["ns_flops_total"] += flops
                if unit.owner == plan.rank:
                    out["owned"] += 1
                    out["ns_flops"] += flops
            others = [q for q in range(plan.size) if q != plan.rank]
            out["gather_bytes"] += gather_size * sum(plan.gather_send_counts[q] for q in others)
            out["scatter_bytes"] += 2 * sum(plan.scatter_send_counts[q] for q in others)
            out["collectives"] += int(plan.needs_gather) + int(plan.needs_scatter)
        return out

    # ------------------------------------------------------------------------------------------

    def _plans_for(
        self, entries: list[tuple[int, int]], params: list[torch.Tensor]
    ) -> list[_MeshPlan]:
        key = tuple(entries)
        plans = self._plans.get(key)
        if plans is None:
            groups: dict[DeviceMesh, dist.ProcessGroup] = {}
            buckets: dict[Any, tuple[list[tuple[int, int]], list[torch.Tensor]]] = {}
            for entry, p in zip(entries, params, strict=True):
                group = None  # one process holds it all: no communication
                if isinstance(p, DTensor) and p.device_mesh.size() > 1:
                    mesh = p.device_mesh
                    if mesh not in groups:
                        groups[mesh] = _mesh_group(mesh)
                    group = groups[mesh]
                bucket = buckets.setdefault(group, ([], []))
                bucket[0].append(entry)
                bucket[1].append(p)
            plans = []
            for group, (bucket_entries, bucket_params) in buckets.items():
                size = 1 if group is None else dist.get_world_size(group)
                load = [0] * size  # carried over the group's buckets
                for lo, hi in self._bucket_bounds(bucket_params):
                    plans.append(
                        _build_plan(group, bucket_entries[lo:hi], bucket_params[lo:hi], load)
                    )
            self._plans[key] = plans
        return plans

    def _bucket_bounds(self, params: list[torch.Tensor]) -> list[tuple[int, int]]:
        """Consecutive runs of parameters of at most ``bucket_size`` elements (one at least)."""
        if self.bucket_size is None:
            return [(0, len(params))]
        bounds, lo, total = [], 0, 0
        for i, p in enumerate(params):
            if i > lo and total + p.numel() > self.bucket_size:
                bounds.append((lo, i))
                lo, total = i, 0
            total += p.numel()
        bounds.append((lo, len(params)))
        return bounds

    def _muon_step(self) -> None:
        """Muon on every ``use_muon`` group, AdamW on the others while the gathers fly."""
        entries: list[tuple[int, int]] = []
        params: list[torch.Tensor] = []
        for g, group in enumerate(self.param_groups):
            if not group["use_muon"]:
                continue
            for i, p in enumerate(group["params"]):
                if p.grad is not None:
                    entries.append((g, i))
                    params.append(p)
        plans = self._plans_for(entries, params) if entries else []
        self._last_plans = plans
        # a pipeline over the buckets: bucket k + 1's gather flies while bucket k is
        # orthogonalised, bucket k - 1's results are applied once bucket k's scatter is issued
        steps = [self._start(plans[0])] if plans else []  # momentum; gather issued
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_group(group)
        for k in range(len(plans)):
            if k + 1 < len(plans):
                steps.append(self._start(plans[k + 1]))
            self._orthogonalize_owned(steps[k])  # waits for its gather; scatter issued
            if k > 0:
                self._finish(steps[k - 1])  # waits for its scatter; the local step
        if steps:
            self._finish(steps[-1])

    def _momentum(
        self, group: dict[str, Any], p: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Momentum on the local shard; returns the local gradient and buffer as stacks."""
        grad = _grad_like(p)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buf = _local(state["momentum_buffer"])
        g = _local(grad)
        buf.lerp_(g, 1 - group["momentum"])
        return _as_stack(g), _as_stack(buf)

    @staticmethod
    def _update(
        mesh_step: _MeshStep, k: int, el: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The (Nesterov) update of local matrix ``el`` of entry ``k``, written into ``out``.

        Into a bf16 ``out`` it is computed in fp32 and rounded once, as ``.to`` would.
        """
        group = mesh_step.groups[k]
        g, buf = mesh_step.grads[k][el], mesh_step.bufs[k][el]
        if group["nesterov"]:
            return torch.lerp(g, buf, group["momentum"], out=out)
        return buf if out is None else out.copy_(buf)

    def _start(self, plan: _MeshPlan) -> _MeshStep:
        """Momentum on the local shards, then the gather to the owners (issued, not awaited)."""
        groups = [self.param_groups[g] for g, _ in plan.entries]
        params = [self.param_groups[g]["params"][i] for g, i in plan.entries]
        grads, bufs = [], []
        for group, p in zip(groups, params, strict=True):
            g, buf = self._momentum(group, p)
            grads.append(g)
            bufs.append(buf)
        mesh_step = _MeshStep(plan, groups, params, grads, bufs)
        if plan.needs_gather:
            # the updates of the matrices owned elsewhere, written straight into the send buffer
            send = torch.empty(
                sum(plan.gather_send_counts), dtype=self.gather_dtype, device=bufs[0].device
            )
            at = 0
            for dst in range(plan.size):
                for k, el in plan.gather_send[dst]:
                    shape = bufs[k].shape[1:]
                    self._update(mesh_step, k, el, out=send[at : at + shape.numel()].view(shape))
                    at += shape.numel()
            mesh_step.sent = send
            mesh_step.received, mesh_step.work = _exchange(
                plan, send, plan.gather_send_counts, plan.gather_recv_counts
            )
        return mesh_step

    def _orthogonalize_owned(self, mesh_step: _MeshStep) -> None:
        """Newton-Schulz on the owned matrices (those held whole here first), scatter issued."""
        plan = mesh_step.plan
        device = mesh_step.bufs[0].device
        results: dict[int, torch.Tensor] = {}
        for i in plan.owned:
            unit = plan.units[i]
            group = mesh_step.groups[unit.entry]
            local = plan.local_piece.get(i)
            if local is not None and local[3] == unit.rows and local[4] == unit.cols:
                full = self._update(mesh_step, unit.entry, local[5])  # held whole: no wait
            else:
                if mesh_step.work is not None:
                    mesh_step.work.wait()
                    mesh_step.work = None
                full = torch.empty(unit.rows, unit.cols, dtype=self.gather_dtype, device=device)
                if local is not None:
                    _, r0, c0, nr, nc, el = local
                    self._update(mesh_step, unit.entry, el, out=full[r0 : r0 + nr, c0 : c0 + nc])
                received = mesh_step.received
                for at, r0, c0, nr, nc in plan.incoming.get(i, ()):
                    assert received is not None
                    full[r0 : r0 + nr, c0 : c0 + nc] = received[at : at + nr * nc].view(nr, nc)
            results[i] = _orthogonalize(
                full, group["ns_coefficients"], group["ns_steps"], group["eps"]
            )
        if mesh_step.work is not None:  # nothing needed it: still completed before the next step
            mesh_step.work.wait()
            mesh_step.work = None
        mesh_step.received = None
        for i, piece in plan.local_piece.items():
            if i in results:  # a part of an owned matrix that stays here
                _, r0, c0, nr, nc, el = piece
                result = results[i][r0 : r0 + nr, c0 : c0 + nc]
                mesh_step.local_results.append((plan.units[i].entry, el, result))
        if plan.needs_scatter:
            pieces = [
                results[i][r0 : r0 + nr, c0 : c0 + nc].reshape(-1)
                for dst in range(plan.size)
                for i, r0, c0, nr, nc in plan.scatter_send[dst]
            ]
            send = _cat(pieces, torch.bfloat16, device)
            mesh_step.sent = send
            mesh_step.received, mesh_step.work = _exchange(
                plan, send, plan.scatter_send_counts, plan.scatter_recv_counts
            )

    def _finish(self, mesh_step: _MeshStep) -> None:
        """Decoupled weight decay, then each result added to its local shard as it arrives."""
        plan = mesh_step.plan
        stacks, alphas = [], []
        for group, p in zip(mesh_step.groups, mesh_step.params, strict=True):
            lr = float(group["lr"])
            p_local = _local(p)
            p_local.mul_(1 - lr * group["weight_decay"])
            stacks.append(_as_stack(p_local))
            alphas.append(-lr * _lr_scale(group["adjust_lr_fn"], p.shape[-2], p.shape[-1]))
        for k, el, result in mesh_step.local_results:
            stacks[k][el].add_(result, alpha=alphas[k])
        if mesh_step.work is not None:
            mesh_step.work.wait()
            back = mesh_step.received
            assert back is not None
            at = 0
            for src in range(plan.size):
                for k, el in plan.scatter_recv[src]:
                    slab = stacks[k][el]
                    slab.add_(back[at : at + slab.numel()].view(slab.shape), alpha=alphas[k])
                    at += slab.numel()
        # this bucket's buffers go now (a bucket_size bounds what is alive at once)
        mesh_step.grads, mesh_step.bufs, mesh_step.local_results = [], [], []
        mesh_step.sent = mesh_step.received = None

    def _adamw_group(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            # element-wise: the local shards give the same numbers without DTensor dispatch
            params.append(_local(p))
            grads.append(_local(_grad_like(p)))
            exp_avgs.append(_local(state["exp_avg"]))
            exp_avg_sqs.append(_local(state["exp_avg_sq"]))
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=False,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["adamw_eps"],
            maximize=False,
        )


def _is_embedding_or_head(name: str, module: nn.Module) -> bool:
    if isinstance(module, nn.Embedding):
        return True
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("output", "lm_head", "head")


def _is_expert_stack(module: nn.Module, p: torch.Tensor) -> bool:
    """A 3-D weight of an experts module (``num_experts`` matrices stacked on dim 0)."""
    num_experts = getattr(module, "num_experts", None)
    return p.ndim == 3 and isinstance(num_experts, int) and p.shape[0] == num_experts


def get_hyper_optimizer(
    model: nn.Module,
    *,
    lr: float = 1e-3,
    weight_decay: float = 0.1,
    adamw_lr: float | None = None,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float | None = None,
    **muon_kwargs: Any,
) -> Muon:
    """Build Muon for a model the usual way: hidden matrices to Muon, the rest to AdamW.

    Muon takes the 2-D matrices of the hidden layers and the 3-D weights of experts modules
    (modules with an integer ``num_experts`` equal to the weight's first dimension, such as
    ``GroupedExperts``; each expert matrix is orthogonalised on its own). Embeddings and output
    heads (``nn.Embedding`` modules; modules named ``output``, ``lm_head`` or ``head``) and
    every other parameter go to one ``use_muon=False`` group.

    Args:
        model: The model (plain, FSDP-, TP- or EP-sharded).
        lr: Muon's learning rate.
        weight_decay: Muon's weight decay.
        adamw_lr: AdamW's learning rate (``lr`` by default).
        adamw_betas: AdamW's betas.
        adamw_eps: AdamW's epsilon.
        adamw_weight_decay: AdamW's weight decay (``weight_decay`` by default).
        **muon_kwargs: Other :class:`~hp_trainer.Muon` arguments (``momentum``, ``ns_steps``,
            ``gather_dtype``, ...).

    Returns:
        One optimizer over all trainable parameters.

    See Also:
        HyperParallel's ``get_hyper_optimizer``; :pt:`torch.optim.Muon` (its docstring's recipe).
    """
    hidden: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    seen: set[nn.Parameter] = set()  # tied weights are stepped once
    for mod_name, module in model.named_modules():
        special = _is_embedding_or_head(mod_name, module)
        for p in module.parameters(recurse=False):
            if p.requires_grad and p not in seen:
                seen.add(p)
                muon = not special and (p.ndim == 2 or _is_expert_stack(module, p))
                (hidden if muon else rest).append(p)
    groups: list[dict[str, Any]] = [{"params": hidden}]
    if rest:
        groups.append(
            {
                "params": rest,
                "use_muon": False,
                "lr": lr if adamw_lr is None else adamw_lr,
                "weight_decay": weight_decay if adamw_weight_decay is None else adamw_weight_decay,
            }
        )
    return Muon(
        groups,
        lr=lr,
        weight_decay=weight_decay,
        adamw_betas=adamw_betas,
        adamw_eps=adamw_eps,
        **muon_kwargs,
    )
