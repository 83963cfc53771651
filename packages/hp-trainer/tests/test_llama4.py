"""Llama 4 (text): layout, masks, HF adapter both ways, ``--model.flavor auto``, refusals.

Oracles: ``transformers``' ``Llama4ForCausalLM`` built from the same config (logits at 1e-5 in
both directions: our export loaded there, its random model imported here, also with Scout's
RoPE scaling whose two frequency factors are equal), every flavor's own config.json building
back exactly the flavor, and the attention's mask rules checked on the module itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hp_cp_ep import MoE
from hp_dtensor.testing import count_host_syncs
from hp_trainer import ConfigManager, parse_args
from hp_trainer.cli import nproc_for
from hp_trainer.components.checkpoint import CheckpointManager
from hp_trainer.components.hf_io.config import (
    hf_config_mismatches,
    model_args_from_hf_config,
    resolve_model_args,
)
from hp_trainer.distributed.layout_validation import validate_parallel_layout
from hp_trainer.models.llama4 import Llama4, Llama4Args, Llama4Attention
from hp_trainer.protocols.model_spec import get_model_spec

SPEC = get_model_spec("llama4")


def _tiny(seed: int = 0, **overrides: Any) -> Llama4:
    torch.manual_seed(seed)
    model = SPEC.build("tiny", **overrides)
    model.init_weights()  # type: ignore[operator]
    assert isinstance(model, Llama4)
    return model


def _tokens(batch: int = 2, seq: int = 20, seed: int = 4) -> torch.Tensor:
    return torch.randint(0, 2048, (batch, seq), generator=torch.Generator().manual_seed(seed))


class _Cfg:
    enable = True
    folder = "checkpoint"


def _job(folder: Path, flavor: str, hf: Path, par: dict[str, Any] | None = None) -> Any:
    return ConfigManager().from_dict(
        {
            "job": {"dump_folder": str(folder)},
            "model": {"name": "llama4", "flavor": flavor},
            "training": {"seq_len": 32},
            "parallelism": par or {},
            "checkpoint": {
                "enable": True,
                "initial_load_path": str(hf),
                "initial_load_in_hf": True,
            },
        }
    )


def test_tiny_layout_irope_chunks_and_interleaved_moe() -> None:
    model = _tiny()
    blocks = list(model.layers.values())
    assert [b.moe_enabled for b in blocks] == [False, True, False]  # interleave step 2
    attn = [b.attention for b in blocks]
    assert [a.use_rope for a in attn] == [True, True, False]  # NoPE every 3rd block
    assert [a.mask_spec.chunk_size for a in attn] == [8, 8, None]
    assert [a.temperature for a in attn] == [None, None, (8.0, 0.1)]
    moe = blocks[1].moe
    assert isinstance(moe, MoE)
    assert moe.shared_experts is not None
    assert moe.expert_bias is None
    assert moe.router.score_func == "sigmoid"
    assert moe.top_k == 1
    assert moe.moe_args.score_before_experts
    assert not moe.router.route_norm
    # every parameter is reached by the backward
    tokens = _tokens(seq=16)
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert param.grad.abs().sum() > 0, name
    assert int(moe.tokens_per_expert.sum()) == 32
    # FLOPs: active parameters (1 of 8 routed experts) and attention over 8 keys in the two
    # chunked blocks, 32 in the NoPE block
    params = sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel()
    inactive = 7 * 3 * 64 * 32
    assert model.num_flops_per_token(32) == 6 * (params - inactive) + 12 * 4 * 16 * (8 + 8 + 32)


def test_chunked_rope_block_sees_its_chunk_and_nope_block_everything() -> None:
    model = _tiny()
    x = torch.randn(1, 20, 64, generator=torch.Generator().manual_seed(5))
    other = x.clone()
    other[:, 3] += 1.0  # a position of the first chunk (0..7)
    for block, changed in ((model.layers["0"], slice(3, 8)), (model.layers["2"], slice(3, 20))):
        att = block.attention
        assert isinstance(att, Llama4Attention)
        with torch.no_grad():
            a, b = att(x, model.rope_cache), att(other, model.rope_cache)
        moved = (a - b).abs().amax(dim=-1)[0] > 0
        expected = torch.zeros(20, dtype=torch.bool)
        expected[changed] = True
        assert torch.equal(moved, expected)
    # one chunk covering the sequence is plain causal (SDPA's causal path, no mask built)
    assert model.layers["0"].attention.spec_for(8).plain_causal


@pytest.mark.parametrize("backend", ["varlen"])
def test_backends_give_the_sdpa_logits(backend: str) -> None:
    model = _tiny()
    tokens = _tokens()
    docs = torch.tensor([[0] * 5 + [1] * 15, [0] * 12 + [1] * 8])
    with torch.no_grad():
        expected = model(tokens, document_ids=docs)
        model.args.attn_backend = backend
        got = model(tokens, document_ids=docs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_hf_adapter_round_trip_is_exact() -> None:
    model = _tiny()
    adapter = SPEC.state_dict_adapter(SPEC.model_args("tiny"))  # type: ignore[misc]
    ours = model.state_dict()
    hf = adapter.to_hf(ours)
    assert hf["model.layers.1.feed_forward.experts.gate_up_proj"].shape == (8, 64, 64)
    assert hf["model.layers.1.feed_forward.experts.down_proj"].shape == (8, 32, 64)
    assert "model.layers.1.feed_forward.shared_expert.up_proj.weight" in hf
    assert "model.layers.0.feed_forward.gate_proj.weight" in hf
    back = adapter.from_hf(hf)
    assert set(back) == set(ours)
    for key, value in ours.items():
        assert torch.equal(back[key], value), key
    del ours["layers.1.moe.experts.w3"]
    with pytest.raises(KeyError, match=r"fused with 'layers\.1\.moe\.experts\.w3'"):
        adapter.to_hf(ours)


def test_export_loads_in_transformers_with_the_same_logits(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model = _tiny()
    adapter = SPEC.state_dict_adapter(SPEC.model_args("tiny"))  # type: ignore[misc]
    CheckpointManager(
        None, [model], None, None, {}, _Cfg(), adapter, base_folder=tmp_path
    ).export_hf(tmp_path / "hf")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32
    )
    assert type(reference).__name__ == "Llama4ForCausalLM"
    assert reference.config.layer_types == ["chunked_attention"] * 2 + ["full_attention"]
    tokens = _tokens()  # 20 positions: chunks of 8, temperature tuning from position 7
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, rtol=1e-5, atol=1e-5)
    # --model.flavor auto rebuilds the flavor and loads the same weights
    args = resolve_model_args(SPEC, _job(tmp_path, "auto", tmp_path / "hf"))
    assert args == SPEC.model_args("tiny")
    again = Llama4(args)
    CheckpointManager(
        None, [again], None, None, {}, _Cfg(), SPEC.state_dict_adapter(args), base_folder=tmp_path
    ).load_hf(tmp_path / "hf")  # type: ignore[misc]
    with torch.no_grad():
        assert torch.equal(again(tokens), model(tokens))


def test_transformers_model_imported_with_auto_gives_its_logits(tmp_path: Path) -> None:
    """HF -> ours: a random HF model (Scout-like: MoE in every block, Scout's equal-factor RoPE
    scaling, no QK-norm, explicit NoPE flags) through config.json and its safetensors."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Llama4TextConfig(
        vocab_size=512, hidden_size=48, intermediate_size=24, intermediate_size_mlp=80,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=12,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1,
        no_rope_layers=[1, 0, 1], use_qk_norm=False, attention_chunk_size=6,
        attn_temperature_tuning=True, floor_scale=4, attn_scale=0.2, max_position_embeddings=64,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 16.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 16},
    )  # fmt: skip
    torch.manual_seed(7)
    theirs = transformers.Llama4ForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path / "hf")
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    args = model_args_from_hf_config(raw)
    assert isinstance(args, Llama4Args)
    assert args.no_rope_layers == (1, 0, 1)
    assert args.moe_layers is None
    assert args.rope_scaling is not None
    assert args.rope_scaling.low_freq_factor == 1.0
    ours = Llama4(args)
    CheckpointManager(
        None, [ours], None, None, {}, _Cfg(), SPEC.state_dict_adapter(args), base_folder=tmp_path
    ).load_hf(tmp_path / "hf")  # type: ignore[misc]
    tokens = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)


def test_every_flavor_is_rebuilt_from_its_config_json() -> None:
    for flavor in SPEC.flavors:
        args = SPEC.model_args(flavor)
        config = SPEC.state_dict_adapter(args).hf_config()  # type: ignore[misc]
        assert model_args_from_hf_config(config) == args, flavor
        assert hf_config_mismatches(args, config) == [], flavor
    config = SPEC.state_dict_adapter(SPEC.model_args("tiny")).hf_config()  # type: ignore[misc]
    config["interleave_moe_layer_step"] = 1
    assert hf_config_mismatches(SPEC.model_args("tiny"), config) == [
        "interleave_moe_layer_step: flavor has 2, config.json has 1"
    ]


def test_published_flavors_are_args_only() -> None:
    scout, maverick = SPEC.model_args("Scout-17B-16E"), SPEC.model_args("Maverick-17B-128E")
    assert SPEC.model_args("17bx16e") == scout
    assert (scout.moe_args.num_experts, scout.interleave_moe_layer_step, scout.qk_norm) == (
        16,
        1,
        True,
    )
    assert (maverick.moe_args.num_experts, maverick.interleave_moe_layer_step) == (128, 2)
    assert not maverick.qk_norm
    assert maverick.rope_scaling is None
    with torch.device("meta"):
        big = SPEC.build("Maverick-17B-128E", n_layers=2)
    assert [b.moe_enabled for b in big.layers.values()] == [False, True]
    experts = big.layers["1"].moe.experts
    assert sum(p.numel() for p in experts.parameters()) == 128 * 3 * 5120 * 8192
    # Scout's 10M positions: the RoPE table stops at rope_table_len
    with torch.device("meta"):
        scout_model = SPEC.build("Scout-17B-16E", n_layers=1)
    assert scout_model.rope_cache.shape == (131072, 64, 2)


def test_bad_input_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="interleave_moe_layer_step must be a positive int"):
        Llama4Args(n_heads=4, dim=64, interleave_moe_layer_step=0)
    with pytest.raises(ValueError, match=r"moe_layers \[5\] has indices \[5\]"):
        Llama4Args(n_heads=4, dim=64, n_layers=2, moe_layers=(5,))
    with pytest.raises(ValueError, match="no_rope_layers must hold a 0/1 flag"):
        Llama4Args(n_heads=4, dim=64, n_layers=2, no_rope_layers=(1,))
    model = _tiny(max_seq_len=16)
    with pytest.raises(ValueError, match="longer than the RoPE table's 16"):
        model(_tokens(seq=20))
    job = ConfigManager().from_dict(
        {
            "model": {"name": "llama4", "flavor": "tiny"},
            "training": {"seq_len": 32},
            "parallelism": {"context_parallel_degree": 2},
        }
    )
    with pytest.raises(ValueError, match="llama4/tiny's attention has no context-parallel path"):
        validate_parallel_layout(job, 2)


def test_debug_config_layout_is_valid() -> None:
    cfg = parse_args(["--config", "debug_llama4"])
    assert (cfg.model.name, cfg.model.flavor) == ("llama4", "debugmodel")
    assert nproc_for(cfg) == 4
    validate_parallel_layout(cfg, 4)  # FSDP 2 x TP 2, experts over [ep 2, tp 2]


def test_forward_and_backward_make_no_host_sync() -> None:
    """Chunk masks, temperature and routing stay on the device (CPU tensors stand for it)."""
    model = _tiny()
    tokens = _tokens()
    docs = torch.tensor([[0] * 5 + [1] * 15, [0] * 12 + [1] * 8])
    for document_ids in (None, docs):
        with count_host_syncs() as syncs:
            logits = model(tokens, document_ids=document_ids)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
            loss.backward()
        assert syncs.total == 0, syncs.summary()
