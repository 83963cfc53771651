"""DeepSeek-V3.2 (DSA): the lightning indexer, sparse attention, HF both ways, the indexer's losses.

Oracles: ``transformers``' ``DeepseekV32ForCausalLM`` (our export loads with the same logits, and
its weights load into ours with the same logits); the flavor's own config.json rebuilds it
(``--model.flavor auto``); the gradients of each training stage are compared with runs where a
loss term is removed (the detached indexer: the main model's gradients do not change with the
indexer loss, the indexer's do not change with the language-modelling loss).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hp_cp_ep import MoE
from hp_trainer import ConfigManager
from hp_trainer.components.hf_io.config import hf_config_mismatches, model_args_from_hf_config
from hp_trainer.models.deepseek_v32 import (
    DeepSeekV32,
    DeepSeekV32Args,
    DSAttention,
    configure_indexer_training,
    indexer_kl_divergence,
)
from hp_trainer.protocols.model_spec import get_model_spec

SPEC = get_model_spec("deepseek_v32")


def _tiny(seed: int = 0, **overrides: Any) -> DeepSeekV32:
    torch.manual_seed(seed)
    model = SPEC.build("tiny", **overrides)
    model.init_weights()  # type: ignore[operator]
    assert isinstance(model, DeepSeekV32)
    with torch.no_grad():  # a trained routing bias and key norm (not their init values)
        gen = torch.Generator().manual_seed(seed + 7)
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            assert moe.expert_bias is not None
            moe.expert_bias.copy_(0.05 * torch.randn(8, generator=gen))
        for att in model.dsa_attentions():
            norm = att.indexer.k_norm
            norm.weight.add_(0.1 * torch.randn(norm.weight.shape, generator=gen))
            norm.bias.add_(0.1 * torch.randn(norm.bias.shape, generator=gen))
    return model


def _tokens(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_flavors_layout_and_sparsity() -> None:
    big = SPEC.model_args("671B")
    assert (big.index_n_heads, big.index_head_dim, big.index_topk, big.q_lora_rank) == (
        64,
        128,
        2048,
        1536,
    )
    assert big.max_seq_len == 163840
    assert big.rope_scaling is not None
    with torch.device("meta"):
        meta = SPEC.build("671B", n_layers=4)
        v3 = get_model_spec("deepseek_v3").build("671B", n_layers=4, q_lora_rank=1536)
    indexer = meta.get_submodule("layers.0.attention.indexer")
    # wq_b 1536 -> 64 x 128, wk 7168 -> 128, k_norm (w, b), weights_proj 7168 -> 64
    assert sum(p.numel() for p in indexer.parameters()) == (
        1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    )
    # FLOPs: attention over min(index_topk, seq) keys, plus the indexer scoring every key
    dense = v3.num_flops_per_token(8192)  # type: ignore[operator]
    own = sum(p.numel() for p in meta.get_submodule("layers.0.attention.indexer").parameters())
    attention = 12 * 4 * 128 * 192
    assert meta.num_flops_per_token(8192) == (  # type: ignore[operator]
        dense + 6 * 4 * own - attention * (8192 - 2048) + 6 * 4 * 64 * 128 * 8192
    )
    model = _tiny()
    assert all(isinstance(b.attention, DSAttention) for b in model.layers.values())
    tokens = _tokens(2, 24, 1)
    other = tokens.clone()
    other[:, -1] = (other[:, -1] + 1) % 2048
    with torch.no_grad():
        sparse, changed = model(tokens), model(other)
        for att in model.dsa_attentions():
            att.index_topk = 24
        dense = model(tokens)
    torch.testing.assert_close(sparse[:, :-1], changed[:, :-1])  # causal
    torch.testing.assert_close(sparse[:, :8], dense[:, :8])  # <= 8 visible: all selected
    assert (sparse[:, 8:] - dense[:, 8:]).abs().amax() > 1e-3  # later queries are sparse


def _export(model: DeepSeekV32, folder: Path) -> dict[str, torch.Tensor]:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    adapter = SPEC.state_dict_adapter(SPEC.model_args("tiny"))  # type: ignore[misc]
    hf = {k: v.contiguous() for k, v in adapter.to_hf(model.state_dict()).items()}
    safetensors_torch.save_file(hf, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(adapter.hf_config()))
    return hf


def test_export_loads_in_transformers_with_the_same_logits(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model = _tiny()
    hf = _export(model, tmp_path)
    assert "model.layers.1.self_attn.indexer.k_norm.bias" in hf
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(reference).__name__ == "DeepseekV32ForCausalLM"
    tokens = _tokens(2, 24, 4)  # 24 > index_topk 8: the selection matters
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, rtol=1e-5, atol=1e-5)
    # the round trip through the adapter is exact
    back = SPEC.state_dict_adapter(SPEC.model_args("tiny")).from_hf(hf)  # type: ignore[misc]
    ours = model.state_dict()
    assert set(back) == set(ours)
    assert all(torch.equal(back[k], v) for k, v in ours.items())


def test_transformers_weights_load_into_ours_with_the_same_logits() -> None:
    transformers = pytest.importorskip("transformers")
    adapter = SPEC.state_dict_adapter(SPEC.model_args("tiny"))  # type: ignore[misc]
    config = transformers.DeepseekV32Config(**adapter.hf_config())
    torch.manual_seed(3)
    reference = transformers.DeepseekV32ForCausalLM(config).float().eval()
    state = {k: v for k, v in reference.state_dict().items() if "rotary_emb" not in k}
    with torch.no_grad():  # HF initializes the router bias and key norm to 0 / 1: move them
        for key, value in state.items():
            if "e_score_correction_bias" in key or "k_norm" in key:
                value.add_(0.05 * torch.randn(value.shape))
    # transformers stores the experts fused (gate_up_proj); the adapter reads per-expert keys
    experts = {}
    for key in [k for k in state if k.endswith("mlp.experts.gate_up_proj")]:
        prefix = key[: -len("gate_up_proj")]
        gate_up, down = state.pop(key), state.pop(prefix + "down_proj")
        for j in range(gate_up.shape[0]):
            gate, up = gate_up[j].chunk(2, dim=0)
            experts[f"{prefix}{j}.gate_proj.weight"] = gate
            experts[f"{prefix}{j}.up_proj.weight"] = up
            experts[f"{prefix}{j}.down_proj.weight"] = down[j]
    ours = SPEC.model_cls(SPEC.model_args("tiny"))
    ours.load_state_dict(adapter.from_hf({**state, **experts}))
    tokens = _tokens(2, 24, 5)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), reference(tokens).logits, rtol=1e-5, atol=1e-5)


def test_every_flavor_is_rebuilt_from_its_config_json() -> None:
    for flavor in SPEC.flavors:
        args = SPEC.model_args(flavor)
        config = SPEC.state_dict_adapter(args).hf_config()  # type: ignore[misc]
        assert model_args_from_hf_config(config) == args, flavor
        assert hf_config_mismatches(args, config) == [], flavor
    config = SPEC.state_dict_adapter(SPEC.model_args("tiny")).hf_config()  # type: ignore[misc]
    config["index_topk"] = 16
    assert hf_config_mismatches(SPEC.model_args("tiny"), config) == [
        "index_topk: flavor has 8, config.json has 16"
    ]


def test_bad_indexer_sizes_and_jobs_are_refused_naming_the_values() -> None:
    with pytest.raises(
        ValueError, match=r"index_head_dim = 4 is smaller than qk_rope_head_dim = 8"
    ):
        DeepSeekV32Args(qk_rope_head_dim=8, index_head_dim=4, q_lora_rank=16)
    with pytest.raises(ValueError, match=r"q_lora_rank = 0: DeepSeek-V3.2's indexer"):
        DeepSeekV32Args(q_lora_rank=0)
    with pytest.raises(ValueError, match="index_n_heads must be >= 1, got 0"):
        DeepSeekV32Args(index_n_heads=0)
    config = SPEC.state_dict_adapter(SPEC.model_args("tiny")).hf_config()  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"index_head_dim = 6 is smaller.* in ckpt/"):
        model_args_from_hf_config({**config, "index_head_dim": 6}, source="ckpt/")

    def job(**sections: Any) -> Any:
        base: dict[str, Any] = {"model": {"name": "deepseek_v32", "flavor": "tiny"}}
        return ConfigManager().from_dict({**base, **sections})

    with pytest.raises(ValueError, match=r"training.seq_len = 4: .*index_topk = 8 is larger"):
        job(training={"seq_len": 4})
    cp2 = {"context_parallel_degree": 2}
    with pytest.raises(ValueError, match=r"rotate_method = 'ulysses': expected one of 'ring'"):
        job(parallelism={**cp2, "context_parallel_rotate_method": "ulysses"})
    with pytest.raises(ValueError, match=r"indexer_stage = 'dense_warmup': expected 'sparse' w"):
        job(parallelism=cp2, dsa={"indexer_stage": "dense_warmup"})
    with pytest.raises(ValueError, match=r"tensor_parallel_degree = 2: expected 1 with model"):
        job(parallelism={**cp2, "tensor_parallel_degree": 2})
    with pytest.raises(ValueError, match=r"attn_mask_type = 'block_causal': expected 'causal'"):
        job(
            model={"name": "deepseek_v32", "flavor": "tiny", "attn_mask_type": "block_causal"},
            parallelism=cp2,
        )
    assert job(parallelism=cp2).parallelism.context_parallel_degree == 2
    with pytest.raises(ValueError, match=r"dsa.indexer_stage = 'dense_warmup': .*'llama3'"):
        ConfigManager().from_dict({"dsa": {"indexer_stage": "dense_warmup"}})
    with pytest.raises(ValueError, match=r"dsa.indexer_loss_coeff = -1.0: expected a number >= 0"):
        job(dsa={"indexer_loss_coeff": -1.0})
    with pytest.raises(ValueError, match="one of 'dense_warmup', 'sparse'"):
        job(dsa={"indexer_stage": "dense"})
    assert job(training={"seq_len": 8}).dsa.indexer_stage == "sparse"  # topk == seq_len is fine


def test_kl_is_zero_when_the_indexer_reproduces_the_attention() -> None:
    model = _tiny()
    att = model.dsa_attentions()[0]
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        q, k, _, _ = att.project(x, model.rope_cache)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    visible = torch.ones(12, 12).tril().bool().expand(2, 12, 12)
    logits = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    probs = torch.softmax(logits.masked_fill(~visible.unsqueeze(1), float("-inf")), -1)
    target = probs.mean(dim=1)  # summed over the heads, normalized
    scores = (target.clamp_min(1e-30).log() + 3.0).requires_grad_()  # softmax gives target
    kl = indexer_kl_divergence(target, scores, visible)
    assert kl.shape == (2, 12)
    torch.testing.assert_close(kl, torch.zeros(2, 12), atol=1e-6, rtol=0)
    kl.sum().backward()  # type: ignore[no-untyped-call]
    assert scores.grad is not None
    assert scores.grad.abs().amax() < 1e-6
    other = scores.detach() + torch.randn(2, 12, 12, generator=torch.Generator().manual_seed(3))
    assert (indexer_kl_divergence(target, other, visible)[:, 1:] > 1e-3).all()
    # and it is torch's KL divergence of the same distributions
    log_q = torch.log_softmax(other.masked_fill(~visible, float("-inf")), -1)
    expected = F.kl_div(log_q.masked_fill(~visible, 0), target, reduction="none").sum(-1)
    torch.testing.assert_close(indexer_kl_divergence(target, other, visible), expected)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _step(model: DeepSeekV32, tokens: torch.Tensor, lm_weight: float = 1.0) -> None:
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    (lm_weight * loss).backward()  # type: ignore[no-untyped-call]


def test_dense_warmup_trains_the_indexer_alone_against_dense_attention() -> None:
    model = _tiny()
    tokens = _tokens(2, 24, 6)
    with torch.no_grad():
        for att in model.dsa_attentions():
            att.index_topk = 24
        dense = model(tokens)
        for att in model.dsa_attentions():
            att.index_topk = 8
    configure_indexer_training(model, "dense_warmup", 0.5)
    model.train()
    _step(model, tokens)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), dense)  # the attention is dense
    grads = _grads(model)
    for name, grad in grads.items():
        if ".attention.indexer." in name:
            assert grad is not None, name
            assert grad.abs().sum() > 0, name
        else:
            assert grad is None, name  # frozen: no gradient, not even zeros
    assert all(not m.load_balance_coeff for m in model.modules() if isinstance(m, MoE))
    losses = [att.indexer_loss for att in model.dsa_attentions()]
    assert all(loss is not None and loss > 0 for loss in losses)
    # the indexer's gradient is that of 0.5 x its KL alone (the LM loss never reaches it)
    _step(model, tokens, lm_weight=0.0)
    for name, grad in _grads(model).items():
        if grad is not None:
            torch.testing.assert_close(grad, grads[name], rtol=1e-6, atol=0.0)


def test_sparse_stage_separates_the_two_losses() -> None:
    tokens = _tokens(2, 24, 7)
    model = _tiny()
    model.train()
    configure_indexer_training(model, "sparse", 0.0)  # no indexer loss: HF's indexer (no grad)
    _step(model, tokens)
    plain = _grads(model)
    assert all(g is None for n, g in plain.items() if ".indexer." in n)
    assert all(g is not None for n, g in plain.items() if ".indexer." not in n)
    configure_indexer_training(model, "sparse", 1.0)
    _step(model, tokens)
    both = _grads(model)
    for name, grad in both.items():
        assert grad is not None, name
        if ".indexer." in name:
            assert grad.abs().sum() > 0, name
        else:  # the main model's gradient is unchanged by the indexer loss (bitwise)
            assert torch.equal(grad, plain[name]), name  # type: ignore[arg-type]
    _step(model, tokens, lm_weight=0.0)  # the indexer's comes from its own loss only
    for name, grad in _grads(model).items():
        if ".indexer." in name:
            assert grad is not None
            torch.testing.assert_close(grad, both[name], rtol=1e-6, atol=0.0)
    # the divisor: the loss is summed over queries and divided by indexer_loss_tokens
    mean = torch.stack([a.indexer_loss for a in model.dsa_attentions()])  # type: ignore[misc]
    configure_indexer_training(model, "sparse", 1.0, tokens_per_step=4 * 48)
    _step(model, tokens)
    summed = torch.stack([a.indexer_loss for a in model.dsa_attentions()])  # type: ignore[misc]
    torch.testing.assert_close(summed * 4, mean)
