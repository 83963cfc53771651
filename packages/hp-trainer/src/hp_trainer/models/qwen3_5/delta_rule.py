"""Gated DeltaNet's token mixing: the causal depthwise convolution and the gated delta rule.

The gated delta rule keeps, per value head, a ``(key_dim, value_dim)`` state ``S`` and reads
and writes it once per token::

    S_t = a_t * S_{t-1}                  (decay, a_t = exp(g_t) in (0, 1])
    u_t = beta_t * (v_t - S_t^T k_t)     (the part of v_t the state does not predict yet)
    S_t = S_t + k_t u_t^T                (delta-rule write, learning rate beta_t)
    o_t = S_t^T q_t

:func:`gated_delta_rule_recurrent` runs exactly that, token by token (the reference).
:func:`~hp_trainer.models.qwen3_5.delta_rule.gated_delta_rule_chunked` is the parallel form used
for training: inside a chunk of
``C`` tokens the writes ``u`` solve one unit lower-triangular ``C x C`` system (the delta rule's
dependence of each write on the earlier ones of the chunk) and every output is one matrix
product, so only ``S / C`` sequential steps remain, carrying the state from chunk to chunk.
Both take queries and keys already activated; they L2-normalize them and scale the queries by
``key_dim ** -0.5`` (as Qwen3.5 does), and compute in float32.

Writing the unrolled chunk: with ``G_t`` the cumulative decay from the chunk start to ``t`` and
``S_0`` the state entering the chunk, ``S_t = G_t S_0 + sum_{i<=t} (G_t / G_i) k_i u_i^T``, so
``(I + A) U = diag(beta) V - diag(beta G) K S_0`` with ``A[t, i] = beta_t (G_t / G_i) k_t . k_i``
for ``i < t``; ``O = diag(G) Q S_0 + ((Q K^T) o (G_t / G_i))_{i<=t} U`` and the state leaving the
chunk is ``G_C S_0 + (K o G_C / G)^T U``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "causal_depthwise_conv",
    "delta_rule_flops_per_token",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
]


def causal_depthwise_conv(
    x: torch.Tensor, weight: torch.Tensor, *, document_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """SiLU of a causal depthwise convolution along the sequence (Gated DeltaNet's short conv).

    Output ``t`` of channel ``c`` is ``silu(sum_j weight[c, j] * x[t - K + 1 + j, c])`` with
    positions before the sequence (and, with ``document_ids``, positions of an earlier document)
    taken as zero.

    Args:
        x: ``(batch, seq, channels)`` input.
        weight: ``(channels, K)`` per-channel kernel (``K`` taps, the last one at ``t``).
        document_ids: Keyword-only; ``(batch, seq)`` document of each position of packed
            samples (None: one sequence).

    Returns:
        ``(batch, seq, channels)`` output in ``x``'s dtype.

    See Also:
        :pt:`torch.nn.functional.conv1d` (``groups = channels``).
    """
    seq = x.shape[1]
    taps = weight.shape[-1]
    if document_ids is not None:  # tap by tap, each masked to the position's own document
        xw = x.to(weight.dtype)
        out = xw * weight[:, taps - 1]
        for back in range(1, min(taps, seq)):
            same = (document_ids[:, back:] == document_ids[:, :-back]).unsqueeze(-1)
            shifted = F.pad(xw[:, :-back] * same, (0, 0, back, 0))
            out = out + shifted * weight[:, taps - 1 - back]
        return F.silu(out).to(x.dtype)
    out = F.conv1d(
        x.transpose(1, 2).to(weight.dtype),
        weight.unsqueeze(1),
        padding=taps - 1,
        groups=weight.shape[0],
    )[..., :seq]
    return F.silu(out).transpose(1, 2).to(x.dtype)


def _l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + 1e-6)


def _heads_first(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """``(B, H, S, ...)`` float32 tensors, keys and queries shared by groups of value heads."""
    group = v.shape[2] // k.shape[2]
    if group > 1:  # value head j reads key/query head j // group
        q = q.repeat_interleave(group, dim=2)
        k = k.repeat_interleave(group, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))
    q = _l2_normalize(q) * q.shape[-1] ** -0.5
    return q, _l2_normalize(k), v, g, beta


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.shape != k.shape or q.dim() != 4 or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"expected q and k of shape (batch, seq, key_heads, key_dim) and v of shape "
            f"(batch, seq, value_heads, value_dim), got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if v.shape[2] % k.shape[2]:
        raise ValueError(
            f"value heads {v.shape[2]} must be a multiple of the key heads {k.shape[2]}"
        )


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, one token at a time (the reference of the chunked form).

    Args:
        q: ``(batch, seq, key_heads, key_dim)`` queries (L2-normalized and scaled here).
        k: Keys, same shape (L2-normalized here).
        v: ``(batch, seq, value_heads, value_dim)`` values; ``value_heads`` a multiple of
            ``key_heads``.
        g: ``(batch, seq, value_heads)`` log decays (``<= 0``).
        beta: ``(batch, seq, value_heads)`` write strengths in ``[0, 1]``.
        initial_state: Keyword-only; ``(batch, value_heads, key_dim, value_dim)`` state before
            the first token (None: zeros).
        document_ids: Keyword-only; ``(batch, seq)`` document of each position of packed
            samples: the state restarts from zero at the first token of every document after
            the first (None: one sequence).

    Returns:
        The outputs ``(batch, seq, value_heads, value_dim)`` in ``v``'s dtype and the final
        float32 state.

    Raises:
        ValueError: For shapes that do not fit together.

    See Also:
        ``transformers.models.qwen3_5.modeling_qwen3_5.torch_recurrent_gated_delta_rule``.
    """
    _check(q, k, v)
    q, k, vf, g, beta = _heads_first(q, k, v, g, beta)
    batch, heads, seq, key_dim = k.shape
    state = (
        vf.new_zeros(batch, heads, key_dim, vf.shape[-1])
        if initial_state is None
        else initial_state.float()
    )
    outs = []
    for t in range(seq):
        if document_ids is not None and t > 0:  # a new document starts from an empty state
            keep = document_ids[:, t] == document_ids[:, t - 1]
            state = state * keep.to(state.dtype)[:, None, None, None]
        state = state * g[:, :, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, :, t])
        write = beta[:, :, t, None] * (vf[:, :, t] - predicted)
        state = state + k[:, :, t, :, None] * write[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    out = torch.stack(outs, dim=2) if outs else vf
    return out.transpose(1, 2).to(v.dtype), state


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule in its chunked parallel form (training): equal to the recurrent one.

    Chunks of ``min(chunk_size, seq)`` tokens (the last padded with tokens that neither decay
    nor write); per chunk one triangular solve and a few matrix products, then one sequential
    state update per chunk.

    Args:
        q: ``(batch, seq, key_heads, key_dim)`` queries (L2-normalized and scaled here).
        k: Keys, same shape (L2-normalized here).
        v: ``(batch, seq, value_heads, value_dim)`` values.
        g: ``(batch, seq, value_heads)`` log decays (``<= 0``).
        beta: ``(batch, seq, value_heads)`` write strengths.
        chunk_size: Keyword-only; tokens per chunk (positive).
        initial_state: Keyword-only; state before the first token (None: zeros).
        document_ids: Keyword-only; ``(batch, seq)`` document of each position of packed
            samples: the state restarts at every document (None: one sequence). Inside a chunk
            only pairs of one document interact; a chunk reads the state it is handed only for
            the tokens that continue the previous chunk's last document, and hands on only
            what its last document wrote.

    Returns:
        The outputs ``(batch, seq, value_heads, value_dim)`` in ``v``'s dtype and the final
        float32 state ``(batch, value_heads, key_dim, value_dim)``.

    Raises:
        ValueError: For shapes that do not fit together or a non-positive ``chunk_size``.

    See Also:
        ``transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule``; the
        chunked algorithm of Yang et al., "Gated Delta Networks" (2024).
    """
    _check(q, k, v)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    q, k, vf, g, beta = _heads_first(q, k, v, g, beta)
    batch, heads, seq, key_dim = k.shape
    value_dim = vf.shape[-1]
    size = max(1, min(chunk_size, seq))
    pad = (-seq) % size
    if pad:  # padded tokens: no decay (g = 0), no write (beta = 0), zero keys and queries
        q, k, vf = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, vf))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    chunks = (seq + pad) // size
    q, k, vf = (t.reshape(batch, heads, chunks, size, -1) for t in (q, k, vf))
    g, beta = (t.reshape(batch, heads, chunks, size) for t in (g, beta))
    same: torch.Tensor | None = None  # (B, 1, n, C, C): query t and key i in one document
    continues: torch.Tensor | None = None  # (B, 1, n, C): token continues the handed state
    if document_ids is not None:
        docs = F.pad(document_ids, (0, pad), mode="replicate") if pad else document_ids
        docs = docs.reshape(batch, 1, chunks, size)
        same = docs[..., :, None] == docs[..., None, :]
        before = torch.cat([docs[..., :1, :1], docs[..., :-1, -1:]], dim=-2)  # last doc handed
        continues = docs == before

    log_decay = g.cumsum(dim=-1)  # log G_t inside each chunk
    lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    # G_t / G_i for i <= t, 0 above the diagonal (masked before exp: no overflow)
    ratio = torch.where(lower, log_decay[..., :, None] - log_decay[..., None, :], -torch.inf).exp()
    decay_from_start = log_decay.exp()
    k_to_end = k * (log_decay[..., -1:] - log_decay).exp()[..., None]
    chunk_decay = log_decay[..., -1].exp()[..., None, None]
    if same is not None and continues is not None:
        ratio = ratio * same
        decay_from_start = decay_from_start * continues
        k_to_end = k_to_end * same[..., -1, :, None]  # written by the last token's document
        chunk_decay = chunk_decay * continues[..., -1, None, None]
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2) * ratio).tril(-1)
    system = system + torch.eye(size, dtype=system.dtype, device=system.device)
    rhs = torch.cat([vf * beta[..., None], k_beta * decay_from_start[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    writes, state_keys = solved[..., :value_dim], solved[..., value_dim:]
    scores = q @ k.transpose(-1, -2) * ratio
    q_decayed = q * decay_from_start[..., None]

    state = (
        vf.new_zeros(batch, heads, key_dim, value_dim)
        if initial_state is None
        else initial_state.float()
    )
    outs = []
    for c in range(chunks):
        u = writes[:, :, c] - state_keys[:, :, c] @ state
        outs.append(q_decayed[:, :, c] @ state + scores[:, :, c] @ u)
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2).reshape(batch, heads, chunks * size, value_dim)[:, :, :seq]
    return out.transpose(1, 2).to(v.dtype), state


def delta_rule_flops_per_token(
    value_heads: int, key_dim: int, value_dim: int, chunk_size: int, seq_len: int
) -> int:
    """Training FLOPs per token of
    :func:`~hp_trainer.models.qwen3_5.delta_rule.gated_delta_rule_chunked` (forward + 2x backward).

    Per chunk of ``C = min(chunk_size, seq_len)`` tokens and value head, the matrix products
    are ``beta K K^T`` and ``Q K^T`` (``2 C^2 d_k`` each), ``scores @ U`` (``2 C^2 d_v``), the
    triangular solve with ``d_v + d_k`` right-hand sides (``C^2 (d_v + d_k)``), and the state
    reads and write ``Kd S``, ``Q S``, ``K^T U`` (``2 C d_k d_v`` each). Per token that is
    ``C (5 d_k + 3 d_v) + 6 d_k d_v``, times 3 for training, times the value heads.

    Args:
        value_heads: Value heads of the layer.
        key_dim: Key (and query) head size.
        value_dim: Value head size.
        chunk_size: Tokens per chunk.
        seq_len: Training sequence length.

    Returns:
        FLOPs per token.
    """
    size = max(1, min(chunk_size, seq_len))
    per_head = size * (5 * key_dim + 3 * value_dim) + 6 * key_dim * value_dim
    return 3 * value_heads * per_head
