# Triton's DSL kernels and decorators are untyped, and CI type-checks without triton installed:
# mypy: disable-error-code="untyped-decorator,no-untyped-def,import-not-found,import-untyped"
"""Triton kernels of the fused MoE op (``hp_kernels::mega_moe`` and ``::mega_moe_grad``).

Grouped GEMMs over the expert row groups with the routing permutation folded into the memory
accesses: the rows of expert ``e`` are the sorted choices ``j`` in ``[start_e, end_e)``, and a
program loads row ``j`` of the tokens straight from ``x[sorted_indices[j] // k]`` (no permuted
copy of ``x``), and stores an expert output row at its (token, choice) slot
``sorted_indices[j]`` (no inverse-permutation gather). The tile schedule lives on the device:
``tile_expert[i]`` (one ``searchsorted`` over the cumulative per-expert tile counts) names the
expert of row tile ``i``, and the grid is the host-known bound ``cdiv(T k, BLOCK_M) + E`` with the
surplus tiles masked off: no host sync, like the reference.

Forward (two launches): gate and up projections with SwiGLU in the epilogue (``gate``, ``up``
kept for the backward), then the down projection scattered to choice order; the weighted
combine of the ``k`` choices is a ``bmm`` (deterministic, as the reference).
Backward (three launches): the hidden gradient ``(p * g)[token] @ w2[e]`` with the SwiGLU
backward in the epilogue; the weight gradients (one program per expert and output tile, looping
over the expert's rows: no atomics), with ``w1``/``w3`` sharing the gathered token loads; the
row gradients ``g_gate @ w1[e] + g_up @ w3[e]`` scattered to choice order, summed over the
choices by torch.

Accumulation is float32 (``tl.dot`` with ``input_precision="ieee"`` for float32 inputs, so no
TF32); the intermediates round to the token dtype where the reference rounds. Equal to the
reference to float32 rounding (``rtol=1e-4, atol=1e-5`` in float32 on the test's data), not
bitwise: the GEMMs sum their products in another order, and the backward adds the two row
gradients before rounding. Checked under ``TRITON_INTERPRET=1`` by the interpreter tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hp_kernels._library import REFERENCE_KERNELS
from hp_kernels.moe import combine_choices, expert_counts
from hp_kernels.triton_kernels._common import INTERPRETING, cast, supported, to_f32

__all__: list[str] = []

#: (BLOCK_M rows, BLOCK_N columns, BLOCK_K reduction) of the row-group GEMMs; the interpreter
#: takes the smallest ``tl.dot`` shape (nothing to tune on a CPU).
BLOCKS = (16, 16, 16) if INTERPRETING else (64, 64, 32)


class _Schedule:
    """Device-side row tiles of the expert groups (no host read of the counts)."""

    def __init__(self, counts: torch.Tensor, num_rows: int, block_m: int) -> None:
        self.ends = torch.cumsum(counts, 0)
        self.starts = self.ends - counts
        tiles = torch.div(counts + (block_m - 1), block_m, rounding_mode="floor")
        tile_ends = torch.cumsum(tiles, 0)
        self.tile_starts = tile_ends - tiles
        self.num_tiles = triton.cdiv(num_rows, block_m) + counts.numel()
        positions = torch.arange(self.num_tiles, device=counts.device, dtype=torch.int64)
        self.tile_expert = torch.searchsorted(tile_ends, positions, right=True)


@triton.jit
def _row_tile(tile_expert, tile_starts, starts, ends, num_experts, BLOCK_M: tl.constexpr):
    """Expert, row indices and row mask of this program's row tile."""
    pid = tl.program_id(0)
    raw = tl.load(tile_expert + pid)
    live = raw < num_experts
    e = tl.minimum(raw, num_experts - 1)
    first = tl.load(starts + e) + (pid - tl.load(tile_starts + e)) * BLOCK_M
    rows = first + tl.arange(0, BLOCK_M)
    limit = tl.where(live, tl.load(ends + e), 0)  # surplus tiles: no row
    return e, rows, rows < limit


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """``acc + a @ b`` accumulated in float32; ``PRECISION="upcast"`` multiplies float32 copies.

    The interpreter's ``tl.dot`` mishandles bfloat16/float16 operands (numpy has no bfloat16), so
    under ``TRITON_INTERPRET=1`` the half-precision kernels upcast first: the products of two
    half-precision numbers are exact in float32, so this only changes the summation order a GPU's
    tensor cores use, which is not specified anyway.
    """
    if PRECISION == "upcast":
        out = tl.dot(to_f32(a), to_f32(b), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc, input_precision=PRECISION)
    return out


@triton.jit
def _silu(v):
    return v / (1.0 + tl.exp(-v))


@triton.jit
def _gate_up_kernel(
    x,
    sorted_indices,
    probs,
    w1,
    w3,
    gate,
    up,
    hidden,
    tile_expert,
    tile_starts,
    starts,
    ends,
    num_experts,
    dim,
    hid,
    topk,
    SCALE_ROWS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e, rows, rmask = _row_tile(tile_expert, tile_starts, starts, ends, num_experts, BLOCK_M)
    DTYPE: tl.constexpr = x.dtype.element_ty
    choice = tl.load(sorted_indices + rows, mask=rmask, other=0)
    token = choice // topk
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < hid
    if SCALE_ROWS:
        weight = to_f32(tl.load(probs + choice, mask=rmask, other=0.0))
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = e * hid * dim
    for k0 in range(0, dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < dim
        a = tl.load(
            x + token[:, None] * dim + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0
        )
        if SCALE_ROWS:
            a = cast(to_f32(a) * weight[:, None], DTYPE)
        bmask = kmask[:, None] & cmask[None, :]
        b_offsets = w_base + cols[None, :] * dim + ks[:, None]
        b1 = tl.load(w1 + b_offsets, mask=bmask, other=0.0)
        b3 = tl.load(w3 + b_offsets, mask=bmask, other=0.0)
        acc_gate = _dot(a, b1, acc_gate, PRECISION)
        acc_up = _dot(a, b3, acc_up, PRECISION)
    g = cast(acc_gate, DTYPE)
    u = cast(acc_up, DTYPE)
    h = cast(to_f32(cast(_silu(to_f32(g)), DTYPE)) * to_f32(u), DTYPE)
    offsets = rows[:, None] * hid + cols[None, :]
    mask = rmask[:, None] & cmask[None, :]
    tl.store(gate + offsets, g, mask=mask)
    tl.store(up + offsets, u, mask=mask)
    tl.store(hidden + offsets, h, mask=mask)


@triton.jit
def _down_kernel(
    hidden,
    sorted_indices,
    w2,
    out,
    tile_expert,
    tile_starts,
    starts,
    ends,
    num_experts,
    dim,
    hid,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e, rows, rmask = _row_tile(tile_expert, tile_starts, starts, ends, num_experts, BLOCK_M)
    DTYPE: tl.constexpr = hidden.dtype.element_ty
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < dim
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hid, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < hid
        a = tl.load(
            hidden + rows[:, None] * hid + ks[None, :],
            mask=rmask[:, None] & kmask[None, :],
            other=0.0,
        )
        b = tl.load(
            w2 + e * dim * hid + cols[None, :] * hid + ks[:, None],
            mask=kmask[:, None] & cmask[None, :],
            other=0.0,
        )
        acc = _dot(a, b, acc, PRECISION)
    slot = tl.load(sorted_indices + rows, mask=rmask, other=0)  # the unpermute, in the store
    tl.store(
        out + slot[:, None] * dim + cols[None, :],
        cast(acc, DTYPE),
        mask=rmask[:, None] & cmask[None, :],
    )


@triton.jit
def _grad_hidden_kernel(
    grad_out,
    sorted_indices,
    probs,
    w2,
    gate,
    up,
    g_gate,
    g_up,
    tile_expert,
    tile_starts,
    starts,
    ends,
    num_experts,
    dim,
    hid,
    topk,
    WEIGHTED: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e, rows, rmask = _row_tile(tile_expert, tile_starts, starts, ends, num_experts, BLOCK_M)
    DTYPE: tl.constexpr = grad_out.dtype.element_ty
    choice = tl.load(sorted_indices + rows, mask=rmask, other=0)
    token = choice // topk
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < hid
    if WEIGHTED:
        weight = to_f32(tl.load(probs + choice, mask=rmask, other=0.0))
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < dim
        a = tl.load(
            grad_out + token[:, None] * dim + ks[None, :],
            mask=rmask[:, None] & kmask[None, :],
            other=0.0,
        )
        if WEIGHTED:
            a = cast(to_f32(a) * weight[:, None], DTYPE)
        b = tl.load(
            w2 + e * dim * hid + ks[:, None] * hid + cols[None, :],
            mask=kmask[:, None] & cmask[None, :],
            other=0.0,
        )
        acc = _dot(a, b, acc, PRECISION)
    offsets = rows[:, None] * hid + cols[None, :]
    mask = rmask[:, None] & cmask[None, :]
    gv = to_f32(tl.load(gate + offsets, mask=mask, other=0.0))
    uv = to_f32(tl.load(up + offsets, mask=mask, other=0.0))
    gh = to_f32(cast(acc, DTYPE))
    sig = 1.0 / (1.0 + tl.exp(-gv))
    g_act = to_f32(cast(gh * uv, DTYPE))
    tl.store(g_gate + offsets, cast(g_act * sig * (1.0 + gv * (1.0 - sig)), DTYPE), mask=mask)
    tl.store(g_up + offsets, cast(gh * to_f32(cast(gv * sig, DTYPE)), DTYPE), mask=mask)


@triton.jit
def _grad_rows_kernel(
    g_gate,
    g_up,
    sorted_indices,
    w1,
    w3,
    out,
    tile_expert,
    tile_starts,
    starts,
    ends,
    num_experts,
    dim,
    hid,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e, rows, rmask = _row_tile(tile_expert, tile_starts, starts, ends, num_experts, BLOCK_M)
    DTYPE: tl.constexpr = g_gate.dtype.element_ty
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < dim
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hid, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < hid
        amask = rmask[:, None] & kmask[None, :]
        a_offsets = rows[:, None] * hid + ks[None, :]
        b_offsets = e * hid * dim + ks[:, None] * dim + cols[None, :]
        bmask = kmask[:, None] & cmask[None, :]
        a1 = tl.load(g_gate + a_offsets, mask=amask, other=0.0)
        a3 = tl.load(g_up + a_offsets, mask=amask, other=0.0)
        acc = _dot(a1, tl.load(w1 + b_offsets, mask=bmask, other=0.0), acc, PRECISION)
        acc = _dot(a3, tl.load(w3 + b_offsets, mask=bmask, other=0.0), acc, PRECISION)
    slot = tl.load(sorted_indices + rows, mask=rmask, other=0)
    tl.store(
        out + slot[:, None] * dim + cols[None, :],
        cast(acc, DTYPE),
        mask=rmask[:, None] & cmask[None, :],
    )


@triton.jit
def _weight_grad_kernel(
    g_rows,
    g_rows2,
    a_src,
    gate,
    up,
    sorted_indices,
    probs,
    out,
    out2,
    starts,
    ends,
    m_size,
    n_size,
    topk,
    G_FROM_TOKENS: tl.constexpr,
    G_WEIGHTED: tl.constexpr,
    A_SWIGLU: tl.constexpr,
    A_WEIGHTED: tl.constexpr,
    DUAL: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """``out[e] = sum_{j in e} G[j]^T A[j]`` (``[m_size, n_size]`` per expert), no atomics.

    ``G`` rows: ``g_rows[j]`` or, with ``G_FROM_TOKENS``, ``(p *) g_rows[token(j)]``; ``A`` rows:
    ``silu(gate[j]) * up[j]`` (``A_SWIGLU``) or ``(p *) a_src[token(j)]``. ``DUAL`` adds a second
    output for ``g_rows2`` (direct rows) sharing the ``A`` loads.
    """
    e = tl.program_id(0)
    DTYPE: tl.constexpr = g_rows.dtype.element_ty
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = ms < m_size
    nmask = ns < n_size
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    start = tl.load(starts + e)
    end = tl.load(ends + e)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rmask = rows < end
        choice = tl.load(sorted_indices + rows, mask=rmask, other=0)
        token = choice // topk
        if G_WEIGHTED or A_WEIGHTED:
            weight = to_f32(tl.load(probs + choice, mask=rmask, other=0.0))
        gmask = rmask[:, None] & mmask[None, :]
        if G_FROM_TOKENS:
            g = tl.load(g_rows + token[:, None] * m_size + ms[None, :], mask=gmask, other=0.0)
        else:
            g = tl.load(g_rows + rows[:, None] * m_size + ms[None, :], mask=gmask, other=0.0)
        if G_WEIGHTED:
            g = cast(to_f32(g) * weight[:, None], DTYPE)
        amask = rmask[:, None] & nmask[None, :]
        if A_SWIGLU:
            a_offsets = rows[:, None] * n_size + ns[None, :]
            gv = to_f32(tl.load(gate + a_offsets, mask=amask, other=0.0))
            uv = to_f32(tl.load(up + a_offsets, mask=amask, other=0.0))
            a = cast(to_f32(cast(_silu(gv), DTYPE)) * uv, DTYPE)
        else:
            a = tl.load(a_src + token[:, None] * n_size + ns[None, :], mask=amask, other=0.0)
            if A_WEIGHTED:
                a = cast(to_f32(a) * weight[:, None], DTYPE)
        acc = _dot(tl.trans(g), a, acc, PRECISION)
        if DUAL:
            g2 = tl.load(g_rows2 + rows[:, None] * m_size + ms[None, :], mask=gmask, other=0.0)
            acc2 = _dot(tl.trans(g2), a, acc2, PRECISION)
    offsets = e.to(tl.int64) * m_size * n_size + ms[:, None] * n_size + ns[None, :]
    mask = mmask[:, None] & nmask[None, :]
    tl.store(out + offsets, cast(acc, DTYPE), mask=mask)
    if DUAL:
        tl.store(out2 + offsets, cast(acc2, DTYPE), mask=mask)


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: IEEE float32 (no TF32) or native half precision (upcast
    to float32 in the interpreter, see ``_dot``)."""
    if dtype == torch.float32:
        return "ieee"
    return "upcast" if INTERPRETING else "tf32"


def _falls_back(x: torch.Tensor, probs: torch.Tensor | None) -> bool:
    dtypes = [x.dtype] + ([] if probs is None else [probs.dtype])
    return not supported(*dtypes) or (probs is not None and probs.dtype != x.dtype)


def mega_moe(
    x: torch.Tensor,
    expert_indices: torch.Tensor,
    probs: torch.Tensor | None,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    score_before_experts: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher of ``hp_kernels::mega_moe`` (same signature and outputs)."""
    if _falls_back(x, probs):
        result: tuple[torch.Tensor, ...] = REFERENCE_KERNELS["mega_moe"](
            x, expert_indices, probs, w1, w2, w3, score_before_experts
        )
        return result  # type: ignore[return-value]
    num_tokens, topk = expert_indices.shape
    num_experts, hid, dim = w1.shape
    n = num_tokens * topk
    flat = expert_indices.reshape(-1)
    sorted_indices = torch.sort(flat, stable=True).indices
    counts = expert_counts(flat, num_experts)
    x, w1, w2, w3 = (t.contiguous() for t in (x, w1, w2, w3))
    block_m, block_n, block_k = BLOCKS
    sched = _Schedule(counts, n, block_m)
    gate, up, hidden = (x.new_empty((n, hid)) for _ in range(3))
    per_choice = x.new_empty((n, dim))
    weighted = probs is not None and not score_before_experts
    weights = x if probs is None else probs.contiguous()
    tiles = (sched.tile_expert, sched.tile_starts, sched.starts, sched.ends, num_experts)
    blocks = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
    precision = _precision(x.dtype)
    if n and hid and dim:
        _gate_up_kernel[(sched.num_tiles, triton.cdiv(hid, block_n))](
            x, sorted_indices, weights, w1, w3, gate, up, hidden, *tiles, dim, hid, topk,
            SCALE_ROWS=score_before_experts, PRECISION=precision, **blocks,
        )  # fmt: skip
        _down_kernel[(sched.num_tiles, triton.cdiv(dim, block_n))](
            hidden, sorted_indices, w2, per_choice, *tiles, dim, hid,
            PRECISION=precision, **blocks,
        )  # fmt: skip
    elif n:
        per_choice.zero_()
        gate.zero_()
        up.zero_()
    choices = per_choice.view(num_tokens, topk, dim)
    out = combine_choices(choices, probs if weighted else None)
    saved = per_choice if weighted else x.new_empty((0,))
    return out, sorted_indices, counts, gate, up, saved


def mega_moe_grad(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    expert_indices: torch.Tensor,
    probs: torch.Tensor | None,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    sorted_indices: torch.Tensor,
    counts: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    expert_out: torch.Tensor,
    score_before_experts: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher of ``hp_kernels::mega_moe_grad`` (same signature and outputs)."""
    args = (grad_out, x, expert_indices, probs, w1, w2, w3, sorted_indices, counts, gate, up)
    if _falls_back(x, probs) or grad_out.dtype != x.dtype:
        result: tuple[torch.Tensor, ...] = REFERENCE_KERNELS["mega_moe_grad"](
            *args, expert_out, score_before_experts
        )
        return result  # type: ignore[return-value]
    num_tokens, topk = expert_indices.shape
    num_experts, hid, dim = w1.shape
    n = num_tokens * topk
    grad_out, x, w1, w2, w3, gate, up = (
        t.contiguous() for t in (grad_out, x, w1, w2, w3, gate, up)
    )
    block_m, block_n, block_k = BLOCKS
    sched = _Schedule(counts, n, block_m)
    weighted = probs is not None and not score_before_experts
    weights = x if probs is None else probs.contiguous()
    tiles = (sched.tile_expert, sched.tile_starts, sched.starts, sched.ends, num_experts)
    blocks = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
    wblocks = {"BLOCK_M": block_n, "BLOCK_N": block_n, "BLOCK_R": block_k}
    precision = _precision(x.dtype)
    g_gate, g_up = x.new_zeros((n, hid)), x.new_zeros((n, hid))
    g_choice = x.new_zeros((n, dim))
    g_w1, g_w2, g_w3 = (w.new_zeros(w.shape) for w in (w1, w2, w3))
    if n and hid and dim:
        _grad_hidden_kernel[(sched.num_tiles, triton.cdiv(hid, block_n))](
            grad_out, sorted_indices, weights, w2, gate, up, g_gate, g_up, *tiles, dim, hid,
            topk, WEIGHTED=weighted, PRECISION=precision, **blocks,
        )  # fmt: skip
        # g_w2[e] = sum_j (p g)[token j]^T swiglu(gate, up)[j]
        _weight_grad_kernel[(num_experts, triton.cdiv(dim, block_n), triton.cdiv(hid, block_n))](
            grad_out, grad_out, x, gate, up, sorted_indices, weights, g_w2, g_w2,
            sched.starts, sched.ends, dim, hid, topk,
            G_FROM_TOKENS=True, G_WEIGHTED=weighted, A_SWIGLU=True, A_WEIGHTED=False,
            DUAL=False, PRECISION=precision, **wblocks,
        )  # fmt: skip
        # g_w1[e], g_w3[e] = sum_j g_gate[j]^T x_in[j], sum_j g_up[j]^T x_in[j]
        _weight_grad_kernel[(num_experts, triton.cdiv(hid, block_n), triton.cdiv(dim, block_n))](
            g_gate, g_up, x, gate, up, sorted_indices, weights, g_w1, g_w3,
            sched.starts, sched.ends, hid, dim, topk,
            G_FROM_TOKENS=False, G_WEIGHTED=False, A_SWIGLU=False,
            A_WEIGHTED=score_before_experts, DUAL=True, PRECISION=precision, **wblocks,
        )  # fmt: skip
        _grad_rows_kernel[(sched.num_tiles, triton.cdiv(dim, block_n))](
            g_gate, g_up, sorted_indices, w1, w3, g_choice, *tiles, dim, hid,
            PRECISION=precision, **blocks,
        )  # fmt: skip
    choices = g_choice.view(num_tokens, topk, dim)
    g_probs = x.new_empty((0,))
    if weighted:
        assert probs is not None
        per_choice = expert_out.view(num_tokens, topk, dim)
        g_probs = torch.bmm(per_choice, grad_out.view(num_tokens, dim, 1)).view(probs.shape)
    if score_before_experts:
        assert probs is not None
        g_probs = (choices * x.unsqueeze(1)).sum(-1).view(probs.shape)
        g_x = (choices * probs.view(num_tokens, topk, 1)).sum(1)
    else:
        g_x = choices.sum(1)
    return g_x, g_probs, g_w1, g_w2, g_w3


def launchers() -> dict[str, object]:
    """The launcher of every op this module implements, by op name."""
    return {"mega_moe": mega_moe, "mega_moe_grad": mega_moe_grad}
