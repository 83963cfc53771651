"""Qwen3.5 (Gated DeltaNet hybrid): the delta rule's two forms, partial rotary, HF both ways,
``--model.flavor auto``, FLOPs, and the layouts refused up front."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hp_trainer import ConfigManager
from hp_trainer.components.hf_io.config import hf_config_mismatches, resolve_model_args
from hp_trainer.distributed.layout_validation import validate_parallel_layout
from hp_trainer.models.common.decoder import precompute_rope
from hp_trainer.models.qwen3_5 import (
    Qwen35,
    causal_depthwise_conv,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)
from hp_trainer.models.qwen3_5.delta_rule import delta_rule_flops_per_token
from hp_trainer.models.qwen3_5.model import apply_partial_rotary
from hp_trainer.protocols.model_spec import get_model_spec

FAMILIES = ["qwen3_5", "qwen3_5_moe"]


def _inputs(
    seq: int, key_heads: int = 2, value_heads: int = 4, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seq, key_heads, 16, generator=gen)
    k = torch.randn(2, seq, key_heads, 16, generator=gen)
    v = torch.randn(2, seq, value_heads, 8, generator=gen)
    g = -2 * torch.rand(2, seq, value_heads, generator=gen)  # log decays
    beta = torch.rand(2, seq, value_heads, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize(("seq", "chunk"), [(19, 8), (16, 4), (7, 64), (12, 1)])
def test_chunked_delta_rule_equals_recurrent_forward_and_backward(seq: int, chunk: int) -> None:
    leaves = [t.requires_grad_() for t in _inputs(seq)]
    state0 = torch.randn(2, 4, 16, 8, generator=torch.Generator().manual_seed(5)) * 0.1
    out_r, state_r = gated_delta_rule_recurrent(*leaves, initial_state=state0)
    out_c, state_c = gated_delta_rule_chunked(*leaves, chunk_size=chunk, initial_state=state0)
    torch.testing.assert_close(out_c, out_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state_c, state_r, rtol=1e-5, atol=1e-5)
    weights = torch.randn(out_r.shape, generator=torch.Generator().manual_seed(6))
    grads_r = torch.autograd.grad((out_r * weights).sum() + state_r.sum(), leaves)
    grads_c = torch.autograd.grad((out_c * weights).sum() + state_c.sum(), leaves)
    for name, a, b in zip(["q", "k", "v", "g", "beta"], grads_c, grads_r, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")


_DOCS = torch.tensor([[0] * 3 + [1] * 8 + [2] * 8, [0] * 16 + [1] * 3])  # edges in and at chunks


def test_document_masking_restarts_conv_and_state_at_every_document() -> None:
    leaves = [t.requires_grad_() for t in _inputs(19, seed=1)]
    out_r, state_r = gated_delta_rule_recurrent(*leaves, document_ids=_DOCS)
    out_c, state_c = gated_delta_rule_chunked(*leaves, chunk_size=8, document_ids=_DOCS)
    torch.testing.assert_close(out_c, out_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state_c, state_r, rtol=1e-5, atol=1e-5)
    grads_r = torch.autograd.grad(out_r.sum() + state_r.sum(), leaves)
    grads_c = torch.autograd.grad(out_c.sum() + state_c.sum(), leaves)
    for a, b in zip(grads_c, grads_r, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # the oracle: every document run alone from an empty state
    q, k, v, g, beta = (t.detach() for t in leaves)
    x = torch.randn(2, 19, 6, generator=torch.Generator().manual_seed(2))
    weight = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    conv = causal_depthwise_conv(x, weight, document_ids=_DOCS)
    torch.testing.assert_close(  # one document: the conv1d path
        causal_depthwise_conv(x, weight, document_ids=torch.zeros(2, 19, dtype=torch.long)),
        causal_depthwise_conv(x, weight),
        rtol=1e-6,
        atol=1e-6,
    )
    for row in range(2):
        for doc in _DOCS[row].unique().tolist():
            span = (_DOCS[row] == doc).nonzero().flatten()
            sl = slice(int(span[0]), int(span[-1]) + 1)
            alone, _ = gated_delta_rule_recurrent(
                *(t[row : row + 1, sl] for t in (q, k, v, g, beta))
            )
            torch.testing.assert_close(out_c[row : row + 1, sl], alone, rtol=1e-5, atol=1e-5)
            conv_alone = causal_depthwise_conv(x[row : row + 1, sl], weight)
            torch.testing.assert_close(conv[row : row + 1, sl], conv_alone, rtol=1e-6, atol=1e-6)


def test_delta_rule_equals_transformers_torch_paths() -> None:
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    q, k, v, g, beta = _inputs(21, seed=3)
    ours, _ = gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=8)
    common = {"use_qk_l2norm_in_kernel": True}
    theirs_chunk, _ = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, **common)
    theirs_rec, _ = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **common)
    torch.testing.assert_close(ours, theirs_chunk, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, theirs_rec, rtol=1e-5, atol=1e-5)


def test_delta_rule_refuses_bad_shapes() -> None:
    q, k, v, g, beta = _inputs(8, key_heads=3, value_heads=4)
    with pytest.raises(ValueError, match="multiple of the key heads 3"):
        gated_delta_rule_chunked(q, k, v, g, beta)
    with pytest.raises(ValueError, match="chunk_size must be a positive int, got 0"):
        gated_delta_rule_chunked(*_inputs(8), chunk_size=0)


def test_partial_rotary_equals_transformers() -> None:
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 10, 3, 16, generator=gen)
    k = torch.randn(2, 10, 1, 16, generator=gen)
    rope = precompute_rope(4, 32, 10000.0)  # a quarter of 16 dimensions rotated
    angles = torch.outer(torch.arange(10.0), 1.0 / 10000.0 ** (torch.arange(0, 4, 2) / 4))
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q_hf, k_hf = hf.apply_rotary_pos_emb(q, k, cos[None], sin[None], unsqueeze_dim=2)
    torch.testing.assert_close(apply_partial_rotary(q, rope), q_hf, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply_partial_rotary(k, rope), k_hf, rtol=1e-6, atol=1e-6)
    assert torch.equal(apply_partial_rotary(q, rope)[..., 4:], q[..., 4:])  # passed through


def _tiny(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = get_model_spec(name).build("tiny")
    model.init_weights()  # type: ignore[operator]
    with torch.no_grad():  # norms away from their zero init, so the mapping of each is checked
        gen = torch.Generator().manual_seed(seed + 1)
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_forward_backward_reaches_every_parameter(name: str) -> None:
    model = _tiny(name)
    args: Any = model.args
    assert args.layer_types == ("linear_attention", "full_attention")
    tokens = torch.randint(0, 2048, (2, 12), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    torch.autograd.backward(loss)
    for pname, param in model.named_parameters():
        assert param.grad is not None, pname
        assert param.grad.abs().sum() > 0, pname
    # the recurrent form of the same model gives the same logits
    recurrent = get_model_spec(name).model_cls(dataclasses.replace(args, linear_recurrent=True))
    recurrent.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(recurrent(tokens), logits, rtol=1e-5, atol=1e-5)
    # packed documents: both forms restart at every document, and the mask changes the logits
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])
    with torch.no_grad():
        packed = model(tokens, document_ids=docs)
        torch.testing.assert_close(
            recurrent(tokens, document_ids=docs), packed, rtol=1e-5, atol=1e-5
        )
        assert not torch.allclose(packed[:, 5:], logits[:, 5:].detach(), atol=1e-3)


def _export(name: str, model: torch.nn.Module, folder: Path) -> Any:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    spec = get_model_spec(name)
    adapter = spec.state_dict_adapter(spec.model_args("tiny"))  # type: ignore[misc]
    hf = {k: v.contiguous() for k, v in adapter.to_hf(model.state_dict()).items()}
    safetensors_torch.save_file(hf, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(adapter.hf_config()))
    return adapter, hf


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_both_ways_same_logits(name: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model = _tiny(name)
    adapter, hf = _export(name, model, tmp_path)
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in hf
    assert hf["model.layers.0.linear_attn.conv1d.weight"].shape == (2 * 32 + 64, 1, 4)
    back = adapter.from_hf(hf)  # the round trip is exact
    assert set(back) == set(model.state_dict())
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(reference).__name__ == adapter.architecture
    tokens = torch.randint(0, 2048, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, rtol=1e-5, atol=1e-5)
    # HF -> ours: a transformers model of its own init (fused in-memory experts) loads here
    torch.manual_seed(7)
    theirs = transformers.AutoModelForCausalLM.from_config(reference.config).float()
    ours = get_model_spec(name).build("tiny")
    ours.load_state_dict(adapter.from_hf(theirs.state_dict()))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_auto_flavor_builds_from_config_json(name: str, tmp_path: Path) -> None:
    _export(name, _tiny(name), tmp_path)
    base = {
        "model": {"name": name, "flavor": "auto"},
        "training": {"seq_len": 32},
        "checkpoint": {"initial_load_path": str(tmp_path), "initial_load_in_hf": True},
    }
    args = resolve_model_args(get_model_spec(name), ConfigManager().from_dict(base))
    assert args == get_model_spec(name).model_args("tiny")
    config = json.loads((tmp_path / "config.json").read_text())
    assert hf_config_mismatches(args, config) == []
    config["linear_num_value_heads"] = 8
    assert any("linear_num_value_heads" in m for m in hf_config_mismatches(args, config))


def test_flops_per_token_counts_the_delta_rule() -> None:
    model = _tiny("qwen3_5")
    assert isinstance(model, Qwen35)
    args = model.args
    seq = 32
    embedding = model.tok_embeddings.weight.numel()
    params = sum(p.numel() for p in model.parameters()) - embedding
    full = 12 * args.n_heads * 16 * seq  # one full-attention block
    linear = delta_rule_flops_per_token(4, 16, 16, 8, seq)  # one Gated DeltaNet block
    assert model.num_flops_per_token(seq) == 6 * params + full + linear
    # observed: the chunked form's matrix products, counted by torch (the solve is not a matmul)
    q, k, v, g, beta = _inputs(seq, value_heads=4)
    v = torch.randn(2, seq, 4, 16)
    with FlopCounterMode(display=False) as counter:
        gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=8)
    size, dk, dv, heads, tokens = 8, 16, 16, 4, 2 * seq
    solve = size * (dk + dv)  # per token and head, in the formula but not counted
    forward = delta_rule_flops_per_token(heads, dk, dv, size, seq) // 3
    assert counter.get_total_flops() == tokens * (forward - heads * solve)


def _cfg(name: str, **par: int) -> Any:
    return ConfigManager().from_dict(
        {
            "model": {"name": name, "flavor": "tiny"},
            "training": {"seq_len": 32},
            "parallelism": par,
        }
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_context_parallel_is_refused_at_parse_time_with_the_reason(name: str) -> None:
    with pytest.raises(ValueError, match="carry a recurrent state through the whole sequence"):
        validate_parallel_layout(_cfg(name, context_parallel_degree=2), 2)
    bad = dataclasses.replace(get_model_spec(name).model_args("tiny"), linear_num_key_heads=1)
    with pytest.raises(ValueError, match="linear_num_key_heads = 1"):
        validate_parallel_layout(_cfg(name, tensor_parallel_degree=2), 2, model_args=bad)
