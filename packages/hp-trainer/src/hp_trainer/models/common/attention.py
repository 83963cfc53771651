"""Attention masks described once and lowered per backend: SDPA, FlexAttention, varlen.

A layer says *which* positions a query sees with a :class:`MaskSpec` (causal, documents of a
packed sample, a sliding window, Llama 4's chunks, a bidirectional prefix); the model builds one
:class:`AttentionMasks` per forward from the batch's document ids, and every layer calls
:func:`attention` with its spec. Each backend gets the mask in its own form, built once per
batch and spec and shared by every layer that uses the spec:

- ``sdpa``: SDPA's own causal path when the spec is plain causal, else a dense boolean
  ``(batch, 1, seq, seq)`` mask (one byte per pair: the form that forces SDPA's math or
  memory-efficient kernel, so it is used only where the mask needs it);
- ``flex``: a FlexAttention ``BlockMask`` from the spec's ``mask_mod`` (memory in blocks, not
  ``seq x seq``);
- ``varlen``: cumulative sequence lengths of the segments (documents, cut at chunk edges) for
  a variable-length kernel with a sliding window; torch's ``varlen_attn`` where the device has
  one (the flash kernel: CUDA, half precision), a reference (one SDPA call per segment)
  elsewhere.

Attention sinks (gpt-oss) are a learned logit per head added to every query's softmax
denominator; every backend takes them (``sinks``), exactly: SDPA through one extra zero key
whose additive bias is the sink, FlexAttention and varlen by rescaling with the log-sum-exp,
``out * sigmoid(lse - sink)``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F

from hp_cp_ep.cp import context_parallel_attention
from hp_dtensor.device import is_accelerator
from hp_trainer.models.common.document_mask import block_causal_mask

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMasks",
    "MaskSpec",
    "attention",
    "backend_error",
    "reference_attention",
]

logger = logging.getLogger(__name__)

AttentionBackend = Literal["sdpa", "flex", "varlen"]
ATTENTION_BACKENDS: tuple[str, ...] = ("sdpa", "flex", "varlen")


@dataclass(frozen=True, kw_only=True)
class MaskSpec:
    """Which keys a query sees: the rules combine (a key is seen when every rule allows it).

    Args:
        causal: A query sees keys at its position and before.
        documents: A query sees keys of its own document only (the batch's document ids).
        sliding_window: A query sees only the ``sliding_window`` most recent positions (itself
            included); None: no window. Needs ``causal``.
        chunk_size: A query sees keys of its own chunk of ``chunk_size`` positions only
            (Llama 4's chunked attention); None: no chunks.
        prefix_length: Every query also sees the first ``prefix_length`` positions (a
            bidirectional prefix, prefix-LM); None: none. Needs ``causal``.

    Raises:
        ValueError: If a size is not a positive integer, or a window or prefix is given
            without ``causal``.

    See Also:
        :titan:`torchtitan.models.attention.get_document_mask_mod`: one of TorchTitan's
        FlexAttention mask functions, which this spec replaces.
    """

    causal: bool = True
    documents: bool = False
    sliding_window: int | None = None
    chunk_size: int | None = None
    prefix_length: int | None = None

    def __post_init__(self) -> None:
        for name in ("sliding_window", "chunk_size", "prefix_length"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"MaskSpec.{name} must be a positive int or None, got {value!r}")
        if not self.causal and (self.sliding_window is not None or self.prefix_length is not None):
            raise ValueError(
                "MaskSpec.sliding_window and MaskSpec.prefix_length need causal=True, got "
                f"sliding_window={self.sliding_window}, prefix_length={self.prefix_length}"
            )

    @property
    def plain_causal(self) -> bool:
        """True when the spec is the causal mask and nothing else."""
        return self == MaskSpec()

    def visible(
        self,
        q_idx: torch.Tensor,
        kv_idx: torch.Tensor,
        q_doc: torch.Tensor | None = None,
        kv_doc: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Elementwise rule: True where the query at ``q_idx`` sees the key at ``kv_idx``.

        Written with tensor operations only, so the same rule builds a dense mask by
        broadcasting and serves as FlexAttention's ``mask_mod``.

        Args:
            q_idx: Query positions.
            kv_idx: Key positions (broadcastable against ``q_idx``).
            q_doc: Document ids of the queries (needed when ``documents``).
            kv_doc: Document ids of the keys (needed when ``documents``).

        Returns:
            A boolean tensor of the broadcast shape.
        """
        seen = torch.ones_like(q_idx >= kv_idx)
        if self.causal:
            past = kv_idx <= q_idx
            if self.prefix_length is not None:
                past = past | (kv_idx < self.prefix_length)
            seen = seen & past
        if self.sliding_window is not None:
            seen = seen & (q_idx - kv_idx < self.sliding_window)
        if self.chunk_size is not None:
            seen = seen & (q_idx // self.chunk_size == kv_idx // self.chunk_size)
        if self.documents:
            assert q_doc is not None
            assert kv_doc is not None
            seen = seen & (q_doc == kv_doc)
        return seen

    def dense(self, seq_len: int, document_ids: torch.Tensor | None, device: Any) -> torch.Tensor:
        """The spec as a dense boolean mask.

        Args:
            seq_len: Sequence length.
            document_ids: ``(batch, seq)`` document ids (needed when ``documents``).
            device: Device of the mask.

        Returns:
            ``(batch, 1, seq, seq)`` when ``documents``, else ``(1, 1, seq, seq)``.
        """
        if self.documents and self == MaskSpec(documents=True) and document_ids is not None:
            return block_causal_mask(document_ids)  # the documents' own mask, as before
        pos = torch.arange(seq_len, device=device)
        q_idx, kv_idx = pos.view(-1, 1), pos.view(1, -1)
        if self.documents:
            if document_ids is None:
                raise ValueError("MaskSpec(documents=True) needs the batch's document_ids")
            q_doc, kv_doc = document_ids.unsqueeze(-1), document_ids.unsqueeze(-2)
            return self.visible(q_idx, kv_idx, q_doc, kv_doc).unsqueeze(1)
        return self.visible(q_idx, kv_idx).view(1, 1, seq_len, seq_len)

    def varlen_error(self) -> str | None:
        """Why a variable-length kernel cannot express this spec, or None when it can."""
        if not self.causal:
            return "varlen attention is causal within each segment (got causal=False)"
        if self.prefix_length is not None:
            return (
                f"varlen attention cannot express a bidirectional prefix (prefix_length="
                f"{self.prefix_length}): use the sdpa or flex backend"
            )
        return None


def backend_error(backend: str, *, device_type: str, training: bool) -> str | None:
    """Why ``backend`` cannot run here, naming the alternative, or None when it can.

    Args:
        backend: ``sdpa``, ``flex`` or ``varlen``.
        device_type: The accelerator type (``cpu`` when there is none).
        training: Whether a backward is needed.

    Returns:
        The reason, or None.
    """
    if backend not in ATTENTION_BACKENDS:
        return f"unknown attention backend {backend!r}; expected one of {ATTENTION_BACKENDS}"
    if backend == "flex" and device_type == "cpu" and training:
        return (
            "FlexAttention has no backward on CPU in torch 2.13 (forward only): train with "
            "attn_backend 'sdpa' or 'varlen' on CPU, or use an accelerator"
        )
    return None


class AttentionMasks:
    """The masks of one batch, lowered per spec for one backend, shared by every layer.

    Built once per forward by the model (before the first layer) and passed to every
    :func:`attention` call; each spec is lowered the first time a layer asks for it.

    Args:
        backend: ``sdpa``, ``flex`` or ``varlen``.
        seq_len: Sequence length of the batch.
        batch_size: Samples in the batch (default: the rows of ``document_ids``, else 1).
        document_ids: ``(batch, seq)`` document ids of packed samples, or None.
        device: Device of the activations.

    Raises:
        ValueError: For an unknown backend, or a batch size that is not the rows of
            ``document_ids``.
    """

    def __init__(
        self,
        backend: str,
        seq_len: int,
        *,
        batch_size: int | None = None,
        document_ids: torch.Tensor | None = None,
        device: Any = None,
    ) -> None:
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention backend {backend!r}; expected one of {ATTENTION_BACKENDS}"
            )
        rows = None if document_ids is None else document_ids.shape[0]
        if batch_size is not None and rows is not None and batch_size != rows:
            raise ValueError(
                f"batch_size {batch_size} differs from the {rows} rows of document_ids"
            )
        self.backend = backend
        self.seq_len = seq_len
        self.batch_size = batch_size or rows or 1
        self.document_ids = document_ids
        self.device = device if document_ids is None else document_ids.device
        self._lowered: dict[MaskSpec, Any] = {}

    def lowered(self, spec: MaskSpec) -> Any:
        """The spec in this backend's form (cached for the batch).

        Args:
            spec: The layer's mask.

        Returns:
            ``sdpa``: None (plain causal) or a dense bool mask; ``flex``: a ``BlockMask``;
            ``varlen``: a ``_Segments``.

        Raises:
            ValueError: If the spec needs document ids the batch lacks, or ``varlen`` cannot
                express it.
        """
        if spec.documents and self.document_ids is None:
            raise ValueError("a MaskSpec with documents=True needs the batch's document_ids")
        if spec not in self._lowered:
            self._lowered[spec] = self._lower(spec)
        return self._lowered[spec]

    def _lower(self, spec: MaskSpec) -> Any:
        if self.backend == "sdpa":
            if spec.plain_causal:
                return None
            return spec.dense(self.seq_len, self.document_ids, self.device)
        if self.backend == "flex":
            return _block_mask(spec, self.seq_len, self.document_ids, self.device)
        reason = spec.varlen_error()
        if reason is not None:
            raise ValueError(reason)
        return _Segments.of(spec, self.batch_size, self.seq_len, self.document_ids, self.device)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    spec: MaskSpec,
    masks: AttentionMasks | None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attend with the layer's mask through the batch's backend.

    The batch's documents (when it has document ids) are added to the layer's spec: a layer
    declares its architecture's mask, the data decides the documents.

    Args:
        q: ``(batch, heads, seq, head_dim)`` queries.
        k: ``(batch, heads, seq, head_dim)`` keys (K/V heads already repeated for GQA).
        v: ``(batch, heads, seq, v_head_dim)`` values.
        spec: The layer's mask.
        masks: The batch's lowered masks; None: SDPA (its own causal path when ``spec`` is
            plain causal, the path context parallelism redirects); inside a context-parallel
            step any other spec, or sinks, go to the context-parallel engine
            (:func:`hp_cp_ep.context_parallel_attention`) with the step's documents.
        sinks: Optional ``(heads,)`` attention-sink logits (gpt-oss).
        scale: Softmax scale (default ``head_dim ** -0.5``).

    Returns:
        ``(batch, heads, seq, v_head_dim)``.

    See Also:
        :pt:`torch.nn.functional.scaled_dot_product_attention`,
        :pt:`torch.nn.attention.flex_attention.flex_attention`: the kernels behind ``sdpa`` and
        ``flex``.
    """
    if masks is None:
        if not spec.plain_causal or sinks is not None:
            # inside a context-parallel step the engine takes the spec and the sinks (SDPA's
            # arguments could only carry them as a dense mask of the whole sequence)
            routed = context_parallel_attention(q, k, v, mask=spec, sinks=sinks, scale=scale)
            if routed is not None:
                return routed
        dense = None if spec.plain_causal else spec.dense(q.shape[-2], None, q.device)
        return _sdpa(q, k, v, dense, sinks, scale)
    if masks.document_ids is not None and not spec.documents:
        spec = dataclasses.replace(spec, documents=True)
    lowered = masks.lowered(spec)
    if masks.backend == "sdpa":
        return _sdpa(q, k, v, lowered, sinks, scale)
    if masks.backend == "flex":
        return _flex(q, k, v, lowered, sinks, scale)
    segments: _Segments = lowered
    return segments.attend(q, k, v, sinks, scale)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    spec: MaskSpec,
    document_ids: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention written out (scores, mask, softmax with the sink column): the oracle.

    Args:
        q: ``(batch, heads, seq, head_dim)`` queries.
        k: Keys, as ``q``.
        v: ``(batch, heads, seq, v_head_dim)`` values.
        spec: The mask.
        document_ids: ``(batch, seq)`` document ids when ``spec.documents``.
        sinks: Optional ``(heads,)`` sink logits.
        scale: Softmax scale (default ``head_dim ** -0.5``).

    Returns:
        ``(batch, heads, seq, v_head_dim)``; rows that see no key are zeros.
    """
    seq = q.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    seen = spec.dense(seq, document_ids, q.device)
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], dim=-1)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)[..., :seq]
    return weights @ v


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    if sinks is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return _sdpa_with_sinks(q, k, v, mask, sinks, scale)


def _sdpa_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    # One extra key of zeros (its score is 0) and value of zeros (it adds nothing to the
    # output) whose additive bias is the sink: the softmax denominator gains exp(sink) exactly.
    B, H, S, _ = q.shape
    if mask is None:
        mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril().view(1, 1, S, S)
    bias = torch.zeros(mask.shape[0], H, S, S + 1, dtype=q.dtype, device=q.device)
    bias[..., :S].masked_fill_(~mask, float("-inf"))
    sink_column = sinks.to(q.dtype).view(1, H, 1, 1).expand(mask.shape[0], H, S, 1)
    bias = torch.cat([bias[..., :S], sink_column], dim=-1)
    k = torch.cat([k, k.new_zeros(B, H, 1, k.shape[-1])], dim=-2)
    v = torch.cat([v, v.new_zeros(B, H, 1, v.shape[-1])], dim=-2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


def _rescale_by_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None
) -> torch.Tensor:
    # out was normalised by Z = exp(lse); with the sink the denominator is Z + exp(sink)
    if sinks is None:
        return out
    factor = torch.sigmoid(lse - sinks.to(lse.dtype).view(1, -1, 1))
    return out * factor.unsqueeze(-1).to(out.dtype)


def _block_mask(
    spec: MaskSpec, seq_len: int, document_ids: torch.Tensor | None, device: Any
) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    mask_mod: Callable[..., torch.Tensor]
    if spec.documents:
        assert document_ids is not None
        docs = document_ids

        def mask_mod(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return spec.visible(q_idx, kv_idx, docs[b, q_idx], docs[b, kv_idx])

        batch: int | None = docs.shape[0]
    else:

        def mask_mod(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return spec.visible(q_idx, kv_idx)

        batch = None
    return create_block_mask(mask_mod, batch, None, seq_len, seq_len, device=device)


@functools.cache
def _compiled_flex() -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: Any,
    sinks: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    # compiled on accelerators (the fused kernel); eager on CPU, where FlexAttention has no
    # backward anyway and the eager path is the reference implementation
    kernel = cast(
        "Callable[..., Any]", _compiled_flex() if is_accelerator(q.device) else flex_attention
    )
    if sinks is None:
        out: torch.Tensor = kernel(q, k, v, block_mask=block_mask, scale=scale)
        return out
    out, aux = kernel(q, k, v, block_mask=block_mask, scale=scale, return_aux=AuxRequest(lse=True))
    assert aux.lse is not None
    return _rescale_by_sinks(out, aux.lse, sinks)


# (device type, dtype) pairs without torch's varlen kernel (it runs on the flash kernel:
# CUDA with half precision); learnt on the first call, said once, the reference used after
_NO_VARLEN_KERNEL: set[tuple[str, torch.dtype]] = set()


@dataclass(frozen=True)
class _Segments:
    """Packed segments of a batch for variable-length attention.

    ``starts`` / ``lengths`` are host integers of every segment of the flattened
    ``batch * seq`` positions (one host read per batch, when the masks are built; never per
    layer); ``cu_seqlens`` is the same on the device for torch's kernel.
    """

    spec: MaskSpec
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    cu_seqlens: torch.Tensor
    max_len: int
    cu_seqlens_total: int

    @classmethod
    def of(
        cls,
        spec: MaskSpec,
        batch: int,
        seq_len: int,
        document_ids: torch.Tensor | None,
        device: Any,
    ) -> _Segments:
        if document_ids is None:
            change = torch.zeros(batch, seq_len, dtype=torch.bool, device=device)
        else:
            change = torch.zeros_like(document_ids, dtype=torch.bool)
            if spec.documents:
                change[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        if spec.chunk_size is not None:
            pos = torch.arange(seq_len, device=change.device)
            change = change | ((pos % spec.chunk_size == 0) & (pos > 0))
        change[:, 0] = True  # every row of the batch starts a segment
        starts_t = change.reshape(-1).nonzero().flatten()
        total = batch * seq_len
        cu = torch.cat([starts_t, starts_t.new_tensor([total])]).to(torch.int32)
        bounds = cu.tolist()  # the batch's one host read
        lengths = tuple(b - a for a, b in itertools.pairwise(bounds))
        return cls(spec, tuple(bounds[:-1]), lengths, cu, max(lengths), bounds[-1])

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        scale: float | None,
    ) -> torch.Tensor:
        B, H, S, _ = q.shape
        if self.cu_seqlens_total != B * S:
            raise ValueError(
                f"varlen masks were built for {self.cu_seqlens_total} positions, got a batch of "
                f"{B} x {S} (pass batch_size to AttentionMasks)"
            )
        # (batch, heads, seq, dim) -> packed (batch * seq, heads, dim)
        qp, kp, vp = (t.transpose(1, 2).reshape(B * S, H, t.shape[-1]) for t in (q, k, v))
        key = (q.device.type, q.dtype)
        out: torch.Tensor | None = None
        if key not in _NO_VARLEN_KERNEL:
            try:
                out = self._kernel(qp, kp, vp, sinks, scale)
            except (NotImplementedError, RuntimeError) as err:
                _NO_VARLEN_KERNEL.add(key)
                logger.info(
                    "varlen attention: no kernel for %s %s (%s); using the reference "
                    "(one SDPA call per segment)",
                    *key,
                    str(err).splitlines()[0],
                )
        if out is None:
            out = self._reference(qp, kp, vp, sinks, scale)
        return out.view(B, S, H, -1).transpose(1, 2)

    def _kernel(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        scale: float | None,
    ) -> torch.Tensor:
        from torch.nn.attention.varlen import AuxRequest, varlen_attn

        window = self.spec.sliding_window
        window_size = (-1 if window is None else window - 1, 0)  # causal: nothing ahead
        cu = self.cu_seqlens
        result = varlen_attn(
            q,
            k,
            v,
            cu,
            cu,
            self.max_len,
            self.max_len,
            scale=scale,
            window_size=window_size,
            return_aux=None if sinks is None else AuxRequest(lse=True),
        )
        if sinks is None:
            assert isinstance(result, torch.Tensor)
            return result
        out, lse = result
        # packed layout: out (tokens, heads, dim), lse (heads, tokens); as (1, heads, tokens, ...)
        rescaled = _rescale_by_sinks(out.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0), sinks)
        return rescaled[0].transpose(0, 1)

    def _reference(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        scale: float | None,
    ) -> torch.Tensor:
        # one SDPA call per segment, causal (with the window) inside it
        inner = MaskSpec(sliding_window=self.spec.sliding_window)
        outs = []
        for start, length in zip(self.starts, self.lengths, strict=True):
            seg = [t[start : start + length].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
            mask = None if inner.plain_causal else inner.dense(length, None, q.device)
            outs.append(_sdpa(seg[0], seg[1], seg[2], mask, sinks, scale)[0].transpose(0, 1))
        return torch.cat(outs, dim=0)
