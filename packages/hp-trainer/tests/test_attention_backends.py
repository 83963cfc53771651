"""One mask description, three attention backends: each equals the written-out reference.

Every mask kind (causal, packed documents, sliding window, Llama 4 chunks, a bidirectional
prefix, and their combinations), with and without attention sinks, through SDPA, varlen (the
reference path on CPU) and FlexAttention (forward only: torch 2.13 has no FlexAttention
backward on CPU) against :func:`reference_attention` (scores, mask, softmax with a sink column,
written out), forward and backward, fp32 at 1e-5. Then the wiring: one set of masks per batch
shared by every layer, FlexAttention's block mask not growing as seq^2, the decoder equal across
backends, and the config refusing what cannot run here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hp_trainer import ConfigManager
from hp_trainer.models.common.attention import (
    AttentionMasks,
    MaskSpec,
    attention,
    reference_attention,
)
from hp_trainer.models.common.decoder import Decoder, DecoderArgs

B, H, S, D = 2, 3, 24, 8

SPECS = {
    "causal": MaskSpec(),
    "documents": MaskSpec(documents=True),
    "window": MaskSpec(sliding_window=5),
    "chunked": MaskSpec(chunk_size=7),
    "prefix": MaskSpec(prefix_length=6),
    "window+documents": MaskSpec(sliding_window=4, documents=True),
    "chunked+documents": MaskSpec(chunk_size=5, documents=True),
    "prefix+documents": MaskSpec(prefix_length=3, documents=True),
}


def _document_ids() -> torch.Tensor:
    # different documents per row, one starting at 0 in the middle of a chunk
    ids = torch.zeros(B, S, dtype=torch.int64)
    ids[0, 9:] = 1
    ids[0, 17:] = 2
    ids[1, 3:] = 1
    ids[1, 20:] = 2
    return ids


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, S, D, generator=gen) for _ in range(3))
    sinks = torch.randn(H, generator=gen)
    return q, k, v, sinks


def _run(backend: str, spec: MaskSpec, with_sinks: bool, grad: bool) -> list[torch.Tensor]:
    q, k, v, sinks = (t.requires_grad_(grad) for t in _inputs())
    docs = _document_ids() if spec.documents else None
    masks = AttentionMasks(backend, S, batch_size=B, document_ids=docs, device=q.device)
    layer_spec = dataclasses.replace(spec, documents=False)  # documents come from the batch
    out = attention(q, k, v, spec=layer_spec, masks=masks, sinks=sinks if with_sinks else None)
    if not grad:
        return [out]
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [t.grad for t in (q, k, v)] + ([sinks.grad] if with_sinks else [])
    return [out, *grads]  # type: ignore[list-item]


def _reference(spec: MaskSpec, with_sinks: bool, grad: bool) -> list[torch.Tensor]:
    q, k, v, sinks = (t.requires_grad_(grad) for t in _inputs())
    docs = _document_ids() if spec.documents else None
    out = reference_attention(
        q, k, v, spec=spec, document_ids=docs, sinks=sinks if with_sinks else None
    )
    if not grad:
        return [out]
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [t.grad for t in (q, k, v)] + ([sinks.grad] if with_sinks else [])
    return [out, *grads]  # type: ignore[list-item]


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("kind", list(SPECS))
def test_sdpa_equals_reference_forward_and_backward(kind: str, with_sinks: bool) -> None:
    spec = SPECS[kind]
    _close(_run("sdpa", spec, with_sinks, grad=True), _reference(spec, with_sinks, grad=True))


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("kind", [k for k, s in SPECS.items() if s.varlen_error() is None])
def test_varlen_equals_reference_forward_and_backward(kind: str, with_sinks: bool) -> None:
    spec = SPECS[kind]
    _close(_run("varlen", spec, with_sinks, grad=True), _reference(spec, with_sinks, grad=True))


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("kind", list(SPECS))
def test_flex_forward_equals_reference(kind: str, with_sinks: bool) -> None:
    spec = SPECS[kind]
    _close(_run("flex", spec, with_sinks, grad=False), _reference(spec, with_sinks, grad=False))


def test_reference_masks_what_it_should() -> None:
    """The oracle itself: a query never draws on a key its spec hides (perturbing the key)."""
    spec = MaskSpec(sliding_window=3, documents=True)
    q, k, v, _ = _inputs()
    docs = _document_ids()
    base = reference_attention(q, k, v, spec=spec, document_ids=docs)
    v2 = v.clone()
    v2[0, :, 8] += 100.0  # position 8 of row 0: document 0; seen by queries 8..10 in the window
    moved = (reference_attention(q, k, v2, spec=spec, document_ids=docs) - base).abs()
    changed = moved[0].amax(dim=(0, 2)) > 0
    assert changed.nonzero().flatten().tolist() == [8]  # 9, 10 are document 1: not 8's
    # and sinks only ever shrink the weights: with a huge sink the output goes to zero
    huge = torch.full((H,), 50.0)
    out = reference_attention(q, k, v, spec=MaskSpec(), sinks=huge)
    assert out.abs().max() < 1e-10


def _hand_rule(spec: MaskSpec, row: int, i: int, j: int) -> bool:
    """The mask written as sentences, independently of ``MaskSpec.visible``."""
    doc = _document_ids()[row]
    in_prefix = spec.prefix_length is not None and j < spec.prefix_length
    if j > i and not in_prefix:  # the future, unless it is the prefix
        return False
    if spec.sliding_window is not None and j <= i - spec.sliding_window:
        return False  # more than window - 1 positions back
    if spec.chunk_size is not None and i // spec.chunk_size != j // spec.chunk_size:
        return False
    return not (spec.documents and doc[i] != doc[j])


@pytest.mark.parametrize("kind", list(SPECS))
def test_dense_masks_match_hand_written_rules(kind: str) -> None:
    spec = SPECS[kind]
    dense = spec.dense(S, _document_ids(), "cpu").expand(B, 1, S, S)
    want = torch.tensor(
        [[[_hand_rule(spec, r, i, j) for j in range(S)] for i in range(S)] for r in range(B)]
    )
    assert torch.equal(dense[:, 0], want)


def test_varlen_refuses_a_prefix() -> None:
    masks = AttentionMasks("varlen", S)
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="bidirectional prefix"):
        attention(q, k, v, spec=MaskSpec(prefix_length=4), masks=masks)


def test_masks_lowered_once_per_batch_and_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 3-layer decoder with documents builds its mask once for the batch, not per layer."""
    built: list[MaskSpec] = []
    real_dense = MaskSpec.dense

    def counting_dense(self: MaskSpec, *args: object, **kwargs: object) -> torch.Tensor:
        built.append(self)
        return real_dense(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(MaskSpec, "dense", counting_dense)
    torch.manual_seed(0)
    model = Decoder(DecoderArgs(dim=24, n_layers=3, n_heads=3, vocab_size=50, max_seq_len=S))
    tokens = torch.randint(0, 50, (B, S))
    model(tokens, document_ids=_document_ids())
    assert built == [MaskSpec(documents=True)]
    masks = AttentionMasks("sdpa", S, document_ids=_document_ids())
    assert masks.lowered(MaskSpec(documents=True)) is masks.lowered(MaskSpec(documents=True))


def test_flex_block_mask_is_not_quadratic() -> None:
    """block_causal at seq 2048: FlexAttention's mask holds blocks, SDPA's holds every pair."""
    seq = 2048
    docs = (torch.arange(seq) // 300).view(1, seq)
    flex = AttentionMasks("flex", seq, document_ids=docs).lowered(MaskSpec(documents=True))
    block_bytes = sum(
        t.numel() * t.element_size()
        for t in (
            flex.kv_num_blocks,
            flex.kv_indices,
            flex.full_kv_num_blocks,
            flex.full_kv_indices,
        )
        if t is not None
    )
    dense = AttentionMasks("sdpa", seq, document_ids=docs).lowered(MaskSpec(documents=True))
    dense_bytes = dense.numel() * dense.element_size()
    assert dense_bytes == seq * seq
    assert block_bytes * 100 < dense_bytes, (block_bytes, dense_bytes)


def _decoder(backend: str) -> Decoder:
    torch.manual_seed(0)
    args = DecoderArgs(
        dim=24, n_layers=2, n_heads=3, n_kv_heads=1, vocab_size=50, max_seq_len=S,
        attn_backend=backend,
    )  # fmt: skip
    return Decoder(args)


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_decoder_varlen_equals_sdpa_with_gradients(documents: bool) -> None:
    tokens = torch.randint(0, 50, (B, S), generator=torch.Generator().manual_seed(1))
    docs = _document_ids() if documents else None
    results = []
    for backend in ("sdpa", "varlen"):
        model = _decoder(backend)
        logits = model(tokens, document_ids=docs)
        logits.float().square().mean().backward()
        results.append([logits, *(p.grad for p in model.parameters())])
    _close(results[1], results[0])  # type: ignore[arg-type]


def test_decoder_flex_forward_equals_sdpa() -> None:
    tokens = torch.randint(0, 50, (B, S), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = _decoder("sdpa")(tokens, document_ids=_document_ids())
        got = _decoder("flex")(tokens, document_ids=_document_ids())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_config_attn_backend() -> None:
    cfg = ConfigManager().parse_args(["--model.attn_backend", "varlen"])
    assert cfg.model.attn_backend == "varlen"
    from hp_trainer import get_model_spec
    from hp_trainer.components.hf_io.config import resolve_model_args

    assert resolve_model_args(get_model_spec("llama3"), cfg).attn_backend == "varlen"
    with pytest.raises(ValueError, match="no backward on CPU"):
        ConfigManager().parse_args(["--model.attn_backend", "flex"])
    with pytest.raises(ValueError, match="context_parallel_degree"):
        ConfigManager().parse_args(
            ["--model.attn_backend", "varlen", "--parallelism.context_parallel_degree", "2"]
        )
    with pytest.raises(ValueError, match="attn_backend"):
        ConfigManager().parse_args(["--model.attn_backend", "xformers"])
    with pytest.raises(ValueError, match="attn_backend must be one of"):
        DecoderArgs(attn_backend="xformers")
