"""gpt-oss: HF ``GptOssForCausalLM`` as the oracle both ways, auto flavor, FLOPs, bad input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from hp_trainer.models.gpt_oss import GptOss, GptOssArgs, GptOssStateDictAdapter
from hp_trainer.models.gpt_oss.model import GptOssAttention, GptOssExperts, GptOssMoE
from hp_trainer.protocols.model_spec import get_model_spec


def _args(**changes: Any) -> GptOssArgs:
    # the tiny flavor with a small SwiGLU limit, so the clamps bite on random weights
    args: GptOssArgs = get_model_spec("gpt_oss").model_args("tiny")
    return dataclasses.replace(args, **{"swiglu_limit": 0.5, **changes})


def _model(args: GptOssArgs, seed: int = 0) -> GptOss:
    """A tiny model whose biases, sinks and router bias are non-zero and whose experts are
    large enough that the gate and up clamps are active."""
    torch.manual_seed(seed)
    model = GptOss(args)
    model.init_weights()
    g = torch.Generator().manual_seed(seed + 5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", ".b1", ".b3", "sinks", "expert_output_bias.weight")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif ".experts.w" in name:
                p.mul_(20)
    return model


def _attention(model: GptOss, block: int) -> GptOssAttention:
    return cast("GptOssAttention", model.layers[str(block)].attention)


def _tokens(seed: int = 4) -> torch.Tensor:
    return torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(seed))


def _export(model: GptOss, args: GptOssArgs, folder: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    adapter = GptOssStateDictAdapter(args)
    hf = {k: v.contiguous() for k, v in adapter.to_hf(model.state_dict()).items()}
    safetensors_torch.save_file(hf, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(adapter.hf_config()))
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(reference).__name__ == "GptOssForCausalLM"
    assert set(reference.state_dict()) == set(hf)
    return reference


def test_export_loads_in_transformers_with_the_same_logits(tmp_path: Path) -> None:
    args = _args()
    model = _model(args)
    reference = _export(model, args, tmp_path)
    tokens = _tokens()
    with torch.no_grad():
        ours, theirs = model(tokens), reference(tokens).logits
        # the parts that make gpt-oss gpt-oss are active in this comparison
        gate = cast("GptOssExperts", model.get_submodule("layers.0.moe.experts"))
        x = torch.randn(64, args.dim, generator=torch.Generator().manual_seed(0))
        pre = x @ gate.w1[0].t() + gate.b1[0, :, 0]
    assert (pre > args.swiglu_limit).any()  # the gate clamp bites
    assert _attention(model, 0).mask_spec.sliding_window == 8
    assert _attention(model, 1).mask_spec.sliding_window is None
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_transformers_model_loads_here_with_the_same_logits() -> None:
    transformers = pytest.importorskip("transformers")
    args = _args(swiglu_limit=7.0)
    config = transformers.GptOssConfig(**{
        k: v for k, v in GptOssStateDictAdapter(args).hf_config().items()
        if k not in ("architectures", "model_type", "torch_dtype")
    })  # fmt: skip
    torch.manual_seed(1)
    theirs = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():  # HF zero-initialises the biases: give them values
        g = torch.Generator().manual_seed(2)
        for name, p in theirs.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    read = get_model_spec("gpt_oss").args_from_hf_config
    assert read is not None
    args_back = read(config.to_dict(), "test")
    assert dataclasses.replace(args_back, attn_backend="sdpa") == args
    ours = GptOss(args)
    state = GptOssStateDictAdapter(args).from_hf(theirs.state_dict())
    assert set(state) == set(ours.state_dict())
    ours.load_state_dict(state)
    tokens = _tokens(7)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)


def test_adapter_round_trip_is_exact_and_refuses_half_a_pair() -> None:
    args = _args()
    model = _model(args)
    adapter = GptOssStateDictAdapter(args)
    ours = model.state_dict()
    hf = adapter.to_hf(ours)
    assert hf["model.layers.1.mlp.experts.gate_up_proj"].shape == (6, 64, 64)  # [E, D, 2I]
    assert hf["model.layers.1.mlp.experts.down_proj_bias"].shape == (6, 64)
    back = adapter.from_hf(hf)
    assert set(back) == set(ours)
    for key, value in ours.items():
        assert torch.equal(back[key], value), key
    partial = {k: v for k, v in ours.items() if k != "layers.0.moe.experts.b3"}
    with pytest.raises(KeyError, match="fused expert tensors"):
        adapter.to_hf(partial)
    with pytest.raises(TypeError, match="GptOssArgs"):
        GptOssStateDictAdapter(get_model_spec("qwen3_moe").model_args("tiny"))


def test_auto_flavor_builds_the_published_sizes_from_their_config() -> None:
    from hp_trainer.components.hf_io.config import hf_config_mismatches, model_args_from_hf_config

    for flavor in ("20b", "120b", "debugmodel"):
        args = get_model_spec("gpt_oss").model_args(flavor)
        config = GptOssStateDictAdapter(args).hf_config()
        assert model_args_from_hf_config(config, source=flavor) == args
        assert hf_config_mismatches(args, config) == []
    twenty = get_model_spec("gpt_oss").model_args("20b")
    config = GptOssStateDictAdapter(twenty).hf_config()
    config["sliding_window"] = 256
    assert hf_config_mismatches(twenty, config) == [
        "sliding_window: flavor has 128, config.json has 256"
    ]


def test_flops_per_token_count_the_window_and_the_active_experts() -> None:
    args = _args()
    model = GptOss(args)
    seq = 32
    params = sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel()
    # per expert: w1, w3 (32 x 64), w2 (64 x 32), b1, b3 (32), output bias (64); 4 of 6 idle
    per_expert = 3 * 32 * 64 + 2 * 32 + 64
    active = params - 2 * 4 * per_expert
    heads_dim = 4 * 16
    attention = 12 * heads_dim * (min(seq, 8) + seq)  # block 0 slides over 8, block 1 is full
    assert model.num_flops_per_token(seq) == 6 * active + attention
    full = GptOss(_args(layer_types=("full_attention", "full_attention")))
    assert full.num_flops_per_token(seq) - model.num_flops_per_token(seq) == 12 * heads_dim * 24
    # a window at least the sequence: the same as full attention
    assert model.num_flops_per_token(8) == full.num_flops_per_token(8)


def test_the_window_and_the_sinks_change_the_output() -> None:
    """Against the reference attention: without the window or the sinks the logits differ."""
    args = _args()
    model = _model(args)
    tokens = _tokens()
    with torch.no_grad():
        base = model(tokens)
        _attention(model, 0).mask_spec = dataclasses.replace(
            _attention(model, 0).mask_spec, sliding_window=None
        )
        assert (model(tokens) - base).abs().max() > 1e-3
        _attention(model, 0).mask_spec = dataclasses.replace(
            _attention(model, 0).mask_spec, sliding_window=8
        )
        torch.testing.assert_close(model(tokens), base, rtol=0, atol=0)
        _attention(model, 1).sinks.zero_()
        assert (model(tokens) - base).abs().max() > 1e-3


def test_backends_agree_and_every_parameter_gets_a_gradient() -> None:
    args = _args()
    model = _model(args)
    tokens = _tokens()
    docs = torch.tensor([[0] * 20 + [1] * 12, [0] * 7 + [1] * 25])
    logits = model(tokens, document_ids=docs)
    varlen = GptOss(dataclasses.replace(args, attn_backend="varlen"))
    varlen.load_state_dict(model.state_dict())
    torch.testing.assert_close(varlen(tokens, document_ids=docs), logits, rtol=1e-5, atol=1e-5)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    loss.backward()  # type: ignore[no-untyped-call]
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert param.grad.abs().sum() > 0, name
    moes = [m for m in model.modules() if isinstance(m, GptOssMoE)]
    assert len(moes) == 2
    assert all(int(m.tokens_per_expert.sum()) == 64 * 2 for m in moes)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"layer_types": ("sliding_attention",)}, "layer_types has 1 entries"),
        ({"layer_types": ("sliding", "full_attention")}, "unknown"),
        ({"sliding_window": 0}, "sliding_window = 0"),
        ({"swiglu_limit": 0.0}, "swiglu_limit must be positive"),
        ({"n_dense_layers": 1}, "no dense blocks"),
    ],
)
def test_bad_arguments_are_refused(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _args(**changes)


def test_debug_config_is_a_valid_two_rank_job() -> None:
    from hp_trainer import parse_args
    from hp_trainer.cli import nproc_for
    from hp_trainer.distributed.layout_validation import validate_parallel_layout

    config = parse_args(["--config", "debug_gpt_oss"])
    assert (config.model.name, config.model.flavor, config.training.steps) == (
        "gpt_oss",
        "debugmodel",
        20,
    )
    assert nproc_for(config) == 2
    validate_parallel_layout(config, 2)  # ep 2 divides the 8 experts, seq 128 fits


def test_a_window_over_the_sequence_is_full_attention_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    args = _args()
    model = _model(args)
    full = GptOss(_args(layer_types=("full_attention", "full_attention")))
    full.load_state_dict(model.state_dict())
    tokens = _tokens()[:, :8]  # window 8 >= 8 positions
    with caplog.at_level("INFO", logger="hp_trainer.models.gpt_oss.model"), torch.no_grad():
        torch.testing.assert_close(model(tokens), full(tokens), rtol=0, atol=0)
        model(tokens)
    said = [r for r in caplog.records if "sliding_window 8 >= sequence length 8" in r.message]
    assert len(said) == 1
