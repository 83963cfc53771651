"""The MoE families (qwen3_moe, deepseek_v3): forward/backward, HF adapters, transformers logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hp_cp_ep import MoE
from hp_trainer.models.deepseek_v3 import DeepSeekV3, MLAttention
from hp_trainer.protocols.model_spec import get_model_spec

FAMILIES = ["qwen3_moe", "deepseek_v3"]


def _tiny(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = get_model_spec(name).build("tiny")
    model.init_weights()  # type: ignore[operator]
    return model


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_forward_backward_reaches_every_parameter(name: str) -> None:
    model = _tiny(name)
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    assert logits.shape == (2, 16, 2048)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    for pname, param in model.named_parameters():
        assert param.grad is not None, pname
        assert param.grad.abs().sum() > 0, pname
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes
    assert all(int(m.tokens_per_expert.sum()) == 32 * m.top_k for m in moes)


def test_deepseek_v3_layout() -> None:
    model = _tiny("deepseek_v3")
    assert isinstance(model, DeepSeekV3)
    blocks = list(model.layers.values())
    assert [b.moe_enabled for b in blocks] == [False, True]  # dense first block
    moe = blocks[1].moe
    assert isinstance(moe, MoE)
    assert moe.shared_experts is not None
    assert moe.expert_bias is not None
    assert moe.router.score_func == "sigmoid"
    assert isinstance(blocks[0].attention, MLAttention)
    # the sequence matters (causal): changing the last token leaves earlier logits unchanged
    tokens = torch.randint(0, 2048, (1, 12), generator=torch.Generator().manual_seed(2))
    other = tokens.clone()
    other[0, -1] = (other[0, -1] + 1) % 2048
    with torch.no_grad():
        a, b = model(tokens), model(other)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_real_size_flavors_are_args_only() -> None:
    qwen = get_model_spec("qwen3_moe").model_args("30B-A3B")
    assert (qwen.dim, qwen.n_layers, qwen.moe_args.num_experts, qwen.moe_args.top_k) == (
        2048,
        48,
        128,
        8,
    )
    ds = get_model_spec("deepseek_v3").model_args("671B")
    assert (ds.n_layers, ds.n_dense_layers, ds.moe_args.num_experts, ds.head_dim) == (
        61,
        3,
        256,
        192,
    )
    with torch.device("meta"):
        big = get_model_spec("deepseek_v3").build("671B", n_layers=4)
    assert sum(p.numel() for p in big.layers["3"].moe.experts.parameters()) == 256 * 3 * 7168 * 2048


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_adapter_round_trip_is_exact(name: str) -> None:
    spec = get_model_spec(name)
    model = _tiny(name)
    adapter = spec.state_dict_adapter(spec.model_args("tiny"))  # type: ignore[misc]
    ours = model.state_dict()
    hf = adapter.to_hf(ours)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in hf
    assert "model.layers.1.mlp.gate.weight" in hf
    back = adapter.from_hf(hf)
    assert set(back) == set(ours)
    for key, value in ours.items():
        assert torch.equal(back[key], value), key
    del hf["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(KeyError, match="experts"):
        adapter.from_hf(hf)


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_export_loads_in_transformers_with_same_logits(name: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    spec = get_model_spec(name)
    model = _tiny(name)
    if name == "deepseek_v3":  # a trained routing bias (HF's e_score_correction_bias)
        with torch.no_grad():
            for moe in (m for m in model.modules() if isinstance(m, MoE)):
                assert moe.expert_bias is not None
                moe.expert_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(3)))
                moe.expert_bias.mul_(0.05)
    adapter = spec.state_dict_adapter(spec.model_args("tiny"))  # type: ignore[misc]
    hf = {k: v.contiguous() for k, v in adapter.to_hf(model.state_dict()).items()}
    safetensors_torch.save_file(hf, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(adapter.hf_config()))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours, theirs = model(tokens), reference(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
