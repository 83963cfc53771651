"""DSA on one device: the lightning indexer's top-k and sparse attention.

Oracles: ``transformers``' ``DeepseekV32Attention`` (its indexer and its index-masked dense
attention, eager) rebuilt from our two functions with the module's own weights, output and
gradients; dense SDPA with the selection turned into a boolean mask.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hp_cp_ep.dsa import (
    indexer_scores,
    indexer_topk,
    sparse_attention,
    sparse_indexer_loss,
    sparse_latent_attention,
)


def _docs(b: int, s: int) -> torch.Tensor:
    row = torch.tensor([0] * 5 + [1] * 9 + [2] * (s - 14))
    return torch.stack([row.roll(3 * i) for i in range(b)])


def _visible(s: int, docs: torch.Tensor | None) -> torch.Tensor:
    mask = torch.ones(s, s, dtype=torch.bool).tril().unsqueeze(0)
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])
    return mask


def _brute_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """Python reference of the documented ranking: score desc, then position asc; -1 pads."""
    b, s, t = scores.shape
    out = torch.full((b, s, min(topk, t)), -1, dtype=torch.long)
    for i in range(b):
        for j in range(s):
            cands = [
                (-scores[i, j, x].item(), x)
                for x in range(t)
                if visible[min(i, visible.shape[0] - 1), j, x]
            ]
            for slot, (_, x) in enumerate(sorted(cands)[:topk]):
                out[i, j, slot] = x
    return out


@pytest.mark.parametrize("with_docs", [False, True])
def test_indexer_topk_is_the_documented_ranking_with_ties_and_padding(with_docs: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    b, s, h, d = 2, 24, 3, 8
    q = torch.randn(b, s, h, d, generator=gen)
    k = torch.randn(b, s, d, generator=gen)
    w = torch.randn(b, s, h, generator=gen)
    k[:, 5] = k[:, 2]  # exact ties in score (same key twice)
    docs = _docs(b, s) if with_docs else None
    got = indexer_topk(q, k, w, 6, softmax_scale=d**-0.5, document_ids=docs)
    scores = indexer_scores(q, k, w, softmax_scale=d**-0.5)
    want = _brute_topk(scores, _visible(s, docs), 6)
    assert got.dtype == torch.int64
    assert got.shape == (b, s, 6)
    assert torch.equal(got, want)
    assert (got[:, 0, 1:] == -1).all()  # query 0 sees one key: the rest is padding
    # topk larger than the sequence: min(topk, T) slots
    assert indexer_topk(q, k, w, 100, softmax_scale=0.3).shape == (b, s, s)


def test_indexer_scores_follow_transformers_order_scale_relu_weights() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, w = (
        torch.randn(1, 4, 2, 8, generator=gen),
        torch.randn(1, 4, 8, generator=gen),
        torch.randn(1, 4, 2, generator=gen),
    )
    got = indexer_scores(
        q, k, w, softmax_scale=-0.5
    )  # a negative scale tells scale-before-relu apart
    want = torch.einsum("bsh,bsht->bst", w, F.relu(-0.5 * torch.einsum("bshd,btd->bsht", q, k)))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_sparse_attention_equals_dense_sdpa_with_the_selection_mask(kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(2)
    b, h, s, d, dv = 2, 4, 16, 8, 6
    q = torch.randn(b, h, s, d, generator=gen, requires_grad=True)
    k = torch.randn(b, kv_heads, s, d, generator=gen, requires_grad=True)
    v = torch.randn(b, kv_heads, s, dv, generator=gen, requires_grad=True)
    iq, ik, w = (
        torch.randn(b, s, 2, 4, generator=gen),
        torch.randn(b, s, 4, generator=gen),
        torch.rand(b, s, 2, generator=gen),
    )
    idx = indexer_topk(iq, ik, w, 5, softmax_scale=0.5, document_ids=_docs(b, s))
    out = sparse_attention(q, k, v, idx, scale=0.3)
    g = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), g)
    mask = torch.zeros(b, s, s + 1, dtype=torch.bool).scatter(
        -1, idx.clamp(min=-1) % (s + 1), True
    )[..., :s]
    ref = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.unsqueeze(1), scale=0.3, enable_gqa=True
    )
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for a, e in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_sparse_attention_sinks_and_empty_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(1, 2, 4, 8, generator=gen),
        torch.randn(1, 1, 4, 8, generator=gen),
        torch.randn(1, 1, 4, 8, generator=gen),
    )
    idx = torch.tensor([[[0, -1], [1, 0], [-1, -1], [3, 2]]])
    sinks = torch.tensor([0.5, -1.0], requires_grad=True)
    out = sparse_attention(q, k, v, idx, scale=0.25, sinks=sinks)
    # row 2 has no key: zeros without sinks, zeros with sinks too (the sink has no value)
    assert torch.equal(sparse_attention(q, k, v, idx, scale=0.25)[:, :, 2], torch.zeros(1, 2, 8))
    assert torch.equal(out[:, :, 2], torch.zeros(1, 2, 8))
    logits = torch.einsum("hd,td->ht", q[0, :, 3], k[0, 0, [3, 2]]) * 0.25
    p = torch.softmax(torch.cat([logits, sinks.detach()[:, None]], -1), -1)[:, :2]
    torch.testing.assert_close(out[0, :, 3], p @ v[0, 0, [3, 2]], rtol=1e-6, atol=1e-6)
    out.sum().backward()  # type: ignore[no-untyped-call]
    assert sinks.grad is not None
    assert torch.isfinite(sinks.grad).all()


def test_bad_inputs_are_refused_naming_the_values() -> None:
    q, k, w = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 8), torch.randn(1, 4, 2)
    with pytest.raises(ValueError, match="topk must be >= 1; got 0"):
        indexer_topk(q, k, w, 0, softmax_scale=1.0)
    with pytest.raises(TypeError, match="topk must be an int; got float"):
        indexer_topk(q, k, w, 2.0, softmax_scale=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"index_k must be \[B=1, T, Di=8\]"):
        indexer_topk(q, torch.randn(1, 4, 6), w, 2, softmax_scale=1.0)
    with pytest.raises(ValueError, match="S=4, T=5"):
        indexer_topk(q, torch.randn(1, 5, 8), w, 2, softmax_scale=1.0)
    with pytest.raises(ValueError, match=r"Hk dividing H=2"):
        sparse_attention(
            torch.randn(1, 2, 4, 8),
            torch.randn(1, 3, 4, 8),
            torch.randn(1, 3, 4, 8),
            torch.zeros(1, 4, 2, dtype=torch.long),
            scale=1.0,
        )


# --------------------------------------------------------------------------- transformers oracle


def _hf_attention(topk: int):  # type: ignore[no-untyped-def]
    modeling = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
    from transformers import DeepseekV32Config

    config = DeepseekV32Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
        kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6,
        index_n_heads=8, index_head_dim=8, index_topk=topk, num_hidden_layers=1,
        vocab_size=64, max_position_embeddings=64,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(4)
    attn = modeling.DeepseekV32Attention(config, 0)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    rope = modeling.DeepseekV32RotaryEmbedding(config)
    return modeling, attn, rope


def _ours(modeling, attn, x, cos, sin, topk, docs) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The HF attention recomposed from our indexer_topk and sparse_attention."""
    b, s, _ = x.shape
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    q = attn.q_b_proj(q_resid).view(b, s, -1, attn.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = q.split([attn.qk_nope_head_dim, attn.qk_rope_head_dim], -1)
    kv_pass, k_rot = attn.kv_a_proj_with_mqa(x).split(
        [attn.kv_lora_rank, attn.qk_rope_head_dim], -1
    )
    k_pass = attn.kv_a_layernorm(kv_pass).view(b, 1, s, -1)
    q_rot, k_rot = modeling.apply_rotary_pos_emb_interleave(
        q_rot, k_rot.view(b, 1, s, -1), cos, sin
    )
    key, value = attn.expand_kv(k_pass, k_rot)
    ix = attn.indexer
    iq = ix.wq_b(q_resid).view(b, s, ix.n_heads, ix.head_dim)
    ik = ix.k_norm(ix.wk(x)).unsqueeze(2)
    iq_rot, iq_pass = iq.split([ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], -1)
    ik_rot, ik_pass = ik.split([ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], -1)
    iq_rot, ik_rot = modeling.apply_rotary_pos_emb(iq_rot, ik_rot, cos, sin, unsqueeze_dim=2)
    iq, ik = torch.cat([iq_rot, iq_pass], -1), torch.cat([ik_rot, ik_pass], -1).squeeze(2)
    w = ix.weights_proj(x) * ix.n_heads**-0.5
    idx = indexer_topk(iq, ik, w, topk, softmax_scale=ix.softmax_scale, document_ids=docs)
    out = sparse_attention(torch.cat([q_pass, q_rot], -1), key, value, idx, scale=attn.scaling)
    return attn.o_proj(out.transpose(1, 2).reshape(b, s, -1)), idx


@pytest.mark.parametrize("with_docs", [False, True])
def test_equals_transformers_deepseek_v32_attention(with_docs: bool) -> None:
    topk, b, s = 5, 2, 20
    modeling, attn, rope = _hf_attention(topk)
    x = torch.randn(b, s, 32, generator=torch.Generator().manual_seed(5), requires_grad=True)
    pos = torch.arange(s).unsqueeze(0)
    cos, sin = rope(x, pos)
    docs = _docs(b, s) if with_docs else None
    visible = _visible(s, docs).expand(b, s, s)
    mask = torch.zeros(b, 1, s, s).masked_fill(
        ~visible.unsqueeze(1), torch.finfo(torch.float32).min
    )
    hf_idx: dict[str, torch.Tensor] = {}
    attn.indexer.register_forward_hook(lambda m, a, o: hf_idx.setdefault("idx", o))
    ref, _ = attn(x, (cos, sin), mask)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(6))
    ref_grads = torch.autograd.grad(ref, [x, *attn.parameters()], g, allow_unused=True)
    out, idx = _ours(modeling, attn, x, cos, sin, topk, docs)
    grads = torch.autograd.grad(out, [x, *attn.parameters()], g, allow_unused=True)
    # the same selection: HF's visible picks (it also returns masked keys when few are visible)
    hf = hf_idx["idx"].long()
    hf_visible = visible.gather(-1, hf)
    for i in range(b):
        for j in range(s):
            assert set(hf[i, j][hf_visible[i, j]].tolist()) == set(
                idx[i, j][idx[i, j] >= 0].tolist()
            )
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for a, e in zip(grads, ref_grads, strict=True):
        if e is None:  # the indexer's weights get no gradient in either
            assert a is None or not a.any()
            continue
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_sparse_latent_attention_equals_sparse_attention_on_the_expanded_rows() -> None:
    gen = torch.Generator().manual_seed(7)
    b, t, c, h = 2, 12, 6, 4
    kv = torch.randn(b, t, c, generator=gen, requires_grad=True)
    wk, wv = torch.randn(c, h * 5, generator=gen), torch.randn(c, h * 3, generator=gen)
    q = torch.randn(b, h, t, 5, generator=gen)
    idx = indexer_topk(
        torch.randn(b, t, 2, 4, generator=gen), torch.randn(b, t, 4, generator=gen),
        torch.randn(b, t, 2, generator=gen), 4, softmax_scale=0.5,
    )  # fmt: skip

    def expand(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (rows @ wk).view(-1, h, 5), (rows @ wv).view(-1, h, 3)

    got = sparse_latent_attention(q, kv, idx, scale=0.3, expand=expand)
    k, v = (kv @ wk).view(b, t, h, 5).transpose(1, 2), (kv @ wv).view(b, t, h, 3).transpose(1, 2)
    torch.testing.assert_close(got, sparse_attention(q, k, v, idx, scale=0.3), rtol=1e-6, atol=1e-6)
    # no expand: one shared head, k = v = the row (MLA's absorbed form)
    qc = torch.randn(b, h, t, c, generator=gen)
    shared = sparse_latent_attention(qc, kv, idx, scale=0.3)
    rows = kv.unsqueeze(1)
    torch.testing.assert_close(shared, sparse_attention(qc, rows, rows, idx, scale=0.3))
    with pytest.raises(ValueError, match=r"expand must map rows \[N=24, C\]"):
        sparse_latent_attention(q, kv, idx, scale=0.3, expand=lambda r: (r, r))


def test_sparse_indexer_loss_is_the_kl_from_head_summed_attention_to_the_indexer() -> None:
    gen = torch.Generator().manual_seed(8)
    b, t, c, h, hi, di = 2, 12, 6, 2, 2, 4
    iq = torch.randn(b, t, hi, di, generator=gen, requires_grad=True)
    ik = torch.randn(b, t, di, generator=gen, requires_grad=True)
    w = torch.randn(b, t, hi, generator=gen, requires_grad=True)
    q, kv = torch.randn(b, h, t, c, generator=gen), torch.randn(b, t, c, generator=gen)
    idx = indexer_topk(iq, ik, w, 4, softmax_scale=0.5)
    loss = sparse_indexer_loss(iq, ik, w, q, kv, idx, softmax_scale=0.5, scale=0.3)
    # dense reference: the selection as a mask over all keys
    sel = torch.zeros(b, t, t + 1, dtype=torch.bool).scatter(-1, idx % (t + 1), True)[..., :t]
    att = torch.einsum("bhsd,btd->bhst", q, kv) * 0.3
    p = torch.softmax(att.masked_fill(~sel[:, None], float("-inf")), -1).sum(1)
    p = p / p.sum(-1, keepdim=True)
    scores = indexer_scores(iq, ik, w, softmax_scale=0.5).masked_fill(~sel, float("-inf"))
    log_q = torch.log_softmax(scores, -1)
    want = torch.where(p > 0, p * (p.clamp_min(1e-30).log() - log_q), torch.zeros_like(p)).sum(-1)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    got = torch.autograd.grad(loss.mean(), (iq, ik, w))
    ref = torch.autograd.grad(want.mean(), (iq, ik, w))
    for a, e in zip(got, ref, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
