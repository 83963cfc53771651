"""YaRN RoPE (gpt-oss, DeepSeek-V3's ``rope_scaling``, Qwen) against ``transformers``.

Our model built from an HF ``config.json`` with ``rope_type: "yarn"`` and its weights gives
``transformers``' logits within 1e-5: a Llama-layout decoder (the table's magnitude correction
only) and DeepSeek-V3's latent attention (``mscale`` and ``mscale_all_dim``: the table's
correction and the softmax scale's). Contexts are tiny (original 16 positions, 48 used) so that
every band of the ramp is exercised.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from hp_trainer.components.hf_io.config import (
    decoder_args_from_hf_config,
    rope_scaling_from_hf,
    rope_scaling_to_hf,
)
from hp_trainer.models.common.decoder import Decoder, YarnRopeScaling, precompute_rope
from hp_trainer.protocols.model_spec import get_model_spec

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}

LLAMA_YARN_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": YARN,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "torch_dtype": "float32",
}


def _save_hf(folder: Path, state: dict[str, torch.Tensor], config: dict[str, object]) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in state.items()}
    safetensors_torch.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))


def test_yarn_config_round_trip_and_table() -> None:
    scaling = rope_scaling_from_hf(LLAMA_YARN_CONFIG)
    assert scaling == YarnRopeScaling(factor=4.0, original_max_position_embeddings=16)
    assert rope_scaling_from_hf({"rope_scaling": rope_scaling_to_hf(scaling)}) == scaling
    # the paper's magnitude correction multiplies the whole table
    assert scaling is not None
    assert math.isclose(scaling.cos_sin_scale, 0.1 * math.log(4.0) + 1.0)
    table = precompute_rope(16, 48, 10000.0, scaling)
    radius = table.pow(2).sum(-1).sqrt()
    torch.testing.assert_close(radius, torch.full_like(radius, scaling.cos_sin_scale))
    # the fastest dimension is kept, the slowest divided by the factor
    plain = precompute_rope(16, 48, 10000.0)
    torch.testing.assert_close(table[:, 0] / scaling.cos_sin_scale, plain[:, 0])
    slow = torch.atan2(table[1, -1, 1], table[1, -1, 0])
    torch.testing.assert_close(slow, torch.atan2(plain[1, -1, 1], plain[1, -1, 0]) / 4.0)
    # DeepSeek-V3's published values: the table's correction cancels, the softmax's does not
    v3 = YarnRopeScaling(
        factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0
    )
    assert v3.cos_sin_scale == 1.0
    assert math.isclose(v3.softmax_scale_factor, (0.1 * math.log(40.0) + 1.0) ** 2)


def test_llama_with_yarn_equals_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    spec = get_model_spec("llama3")
    args = decoder_args_from_hf_config(LLAMA_YARN_CONFIG)
    assert isinstance(args.rope_scaling, YarnRopeScaling)
    torch.manual_seed(0)
    model = Decoder(args)
    model.init_weights()
    adapter = spec.state_dict_adapter(args)  # type: ignore[misc]
    _save_hf(tmp_path, adapter.to_hf(model.state_dict()), adapter.hf_config())
    assert json.loads((tmp_path / "config.json").read_text())["rope_scaling"]["rope_type"] == "yarn"
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    tokens = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), reference(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "mscales", [(None, None), (0.707, 1.0)], ids=["factor-only", "mscale+mscale_all_dim"]
)
def test_deepseek_v3_with_yarn_equals_transformers(
    mscales: tuple[float | None, float | None], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    spec = get_model_spec("deepseek_v3")
    mscale, mscale_all_dim = mscales
    scaling = YarnRopeScaling(
        factor=4.0,
        original_max_position_embeddings=16,
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
    )
    args = dataclasses.replace(spec.model_args("tiny"), rope_scaling=scaling, max_seq_len=64)
    torch.manual_seed(0)
    model = spec.build("tiny", rope_scaling=scaling, max_seq_len=64)
    model.init_weights()  # type: ignore[operator]
    adapter = spec.state_dict_adapter(args)  # type: ignore[misc]
    config = adapter.hf_config()
    assert config["rope_scaling"]["rope_type"] == "yarn"
    _save_hf(tmp_path, adapter.to_hf(model.state_dict()), config)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    tokens = torch.randint(0, 2048, (2, 48), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours, theirs = model(tokens), reference(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # and the args read back from that config.json are the ones we built
    read = spec.args_from_hf_config(config, "test")  # type: ignore[misc]
    assert read.rope_scaling == scaling
