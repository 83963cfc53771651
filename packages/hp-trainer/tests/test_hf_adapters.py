"""HuggingFace state-dict adapters: exact round trips, HF-convention logits, import/export.

Oracle for the layout change: a forward pass written here in HuggingFace's convention (rotary
embedding by ``rotate_half`` on the two halves of each head, HF key names), run on the converted
weights, must give the logits of our decoder. ``transformers`` is not a dependency, so the
reference is this file's own ~30 lines, following ``LlamaForCausalLM``/``Qwen3ForCausalLM``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hp_dcp
import hp_fsdp
from hp_dtensor.testing import distributed, rank_seed
from hp_trainer.components.checkpoint import CheckpointManager
from hp_trainer.components.hf_io.adapters import (
    StateDictAdapter,
    half_to_interleaved_rotary,
    interleaved_to_half_rotary,
)
from hp_trainer.models.common.decoder import Decoder, DecoderArgs
from hp_trainer.models.llama3 import Llama3StateDictAdapter, llama3_flavors
from hp_trainer.models.qwen3 import Qwen3StateDictAdapter, qwen3_flavors

if hasattr(hp_fsdp, "fully_shard"):
    fully_shard = hp_fsdp.fully_shard
else:  # pragma: no cover - only while hp-fsdp is unfinished
    from torch.distributed.fsdp import fully_shard

ADAPTERS: dict[str, type[StateDictAdapter]] = {
    "llama3": Llama3StateDictAdapter,
    "qwen3": Qwen3StateDictAdapter,
}


def tiny(name: str, tied: bool = False) -> DecoderArgs:
    args = copy.deepcopy((llama3_flavors if name == "llama3" else qwen3_flavors)["tiny"])
    args.vocab_size = 96
    args.max_seq_len = 32
    args.enable_weight_tying = tied
    return args


def build(args: DecoderArgs, seed: int) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(args)
    model.init_weights()
    with torch.no_grad():  # non-trivial norm scales, so their permutation matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def hf_reference_logits(hf: dict[str, torch.Tensor], cfg: dict[str, Any], tokens: torch.Tensor):
    """Llama / Qwen 3 forward in HuggingFace's convention, from an HF state dict."""
    B, S = tokens.shape
    H, KV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    if cfg.get("rope_scaling"):  # Llama 3.1's rule as HF writes it: three bands of wavelengths
        r = cfg["rope_scaling"]
        old = r["original_max_position_embeddings"]
        wavelen = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelen > old / r["low_freq_factor"], inv_freq / r["factor"], inv_freq)
        smooth = (old / wavelen - r["low_freq_factor"]) / (
            r["high_freq_factor"] - r["low_freq_factor"]
        )
        medium = (wavelen >= old / r["high_freq_factor"]) & (wavelen <= old / r["low_freq_factor"])
        blended = (1 - smooth) * scaled / r["factor"] + smooth * scaled
        inv_freq = torch.where(medium, blended, scaled)
    freqs = torch.outer(torch.arange(S, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
    h = hf["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms(h, hf[p + "input_layernorm.weight"], eps)
        q = (x @ hf[p + "self_attn.q_proj.weight"].T).view(B, S, H, D)
        k = (x @ hf[p + "self_attn.k_proj.weight"].T).view(B, S, KV, D)
        v = (x @ hf[p + "self_attn.v_proj.weight"].T).view(B, S, KV, D)
        if p + "self_attn.q_norm.weight" in hf:
            q = _rms(q, hf[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, hf[p + "self_attn.k_norm.weight"], eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = k.repeat_interleave(H // KV, dim=2)
        v = v.repeat_interleave(H // KV, dim=2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        h = h + att.transpose(1, 2).reshape(B, S, H * D) @ hf[p + "self_attn.o_proj.weight"].T
        x = _rms(h, hf[p + "post_attention_layernorm.weight"], eps)
        gate = F.silu(x @ hf[p + "mlp.gate_proj.weight"].T)
        h = h + (gate * (x @ hf[p + "mlp.up_proj.weight"].T)) @ hf[p + "mlp.down_proj.weight"].T
    h = _rms(h, hf["model.norm.weight"], eps)
    head = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    return h @ head.T


def test_rotary_permutation_inverts_and_moves_pairs() -> None:
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).view(16, 3)  # 2 heads of size 8
    hf = interleaved_to_half_rotary(w, 2)
    # head 0: our rows 0,2,4,6 (first of each pair) then 1,3,5,7
    assert hf[:8, 0].tolist() == [0, 6, 12, 18, 3, 9, 15, 21]
    assert torch.equal(half_to_interleaved_rotary(hf, 2), w)
    with pytest.raises(ValueError, match="heads of even size"):
        interleaved_to_half_rotary(torch.zeros(6, 2), 2)


@pytest.mark.parametrize(("name", "tied"), [("llama3", False), ("qwen3", False), ("qwen3", True)])
def test_round_trip_exact_and_hf_logits_match(name: str, tied: bool) -> None:
    args = tiny(name, tied)
    model = build(args, seed=0)
    adapter = ADAPTERS[name](args)
    ours = model.state_dict()
    hf = adapter.to_hf(ours)
    assert "model.layers.1.self_attn.q_proj.weight" in hf
    assert ("model.layers.0.self_attn.q_norm.weight" in hf) == (name == "qwen3")
    assert ("lm_head.weight" in hf) == (not tied)
    back = adapter.from_hf(hf)
    assert set(back) == set(ours)
    for key, value in ours.items():
        assert torch.equal(back[key], value), key
    assert not torch.equal(
        hf["model.layers.0.self_attn.q_proj.weight"], ours["layers.0.attention.wq.weight"]
    )  # the rows really moved
    tokens = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    expected = model(tokens)
    torch.testing.assert_close(
        hf_reference_logits(hf, adapter.hf_config(), tokens), expected, rtol=1e-5, atol=1e-5
    )
    # and a model built from the HF weights computes the same logits
    other = build(args, seed=1)
    other.load_state_dict(adapter.from_hf(hf))
    torch.testing.assert_close(other(tokens), expected, rtol=0, atol=0)


def test_adapter_errors() -> None:
    adapter = Llama3StateDictAdapter(tiny("llama3"))
    with pytest.raises(KeyError, match=r"layers\.0\.mystery"):
        adapter.to_hf({"layers.0.mystery.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match="no native name"):
        adapter.from_hf({"model.layers.0.mlp.experts.weight": torch.zeros(1)})
    with pytest.raises(TypeError, match="DecoderArgs"):
        Llama3StateDictAdapter({"dim": 4})  # type: ignore[arg-type]


class _Cfg:
    enable = True
    folder = "checkpoint"


def _manager(model: nn.Module, args: DecoderArgs, folder: str, name: str) -> CheckpointManager:
    return CheckpointManager(
        None, [model], None, None, {}, _Cfg(), ADAPTERS[name](args), base_folder=folder
    )


def test_export_and_import_hf_single_process(tmp_path: Path) -> None:
    args = tiny("qwen3", tied=True)
    model = build(args, 0)
    _manager(model, args, str(tmp_path), "qwen3").export_hf(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["tie_word_embeddings"] is True
    assert (tmp_path / "hf" / hp_dcp.HF_INDEX_FILE).is_file()
    fresh = build(args, 1)
    _manager(fresh, args, str(tmp_path), "qwen3").load_hf(tmp_path / "hf")
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    assert fresh.lm_head.weight is fresh.tok_embeddings.weight  # tying survives the import
    # a new run with an empty checkpoint folder starts from the HF weights (initial load)
    cfg = _Cfg()
    cfg.initial_load_path = str(tmp_path / "hf")  # type: ignore[attr-defined]
    cfg.initial_load_in_hf = True  # type: ignore[attr-defined]
    third = build(args, 2)
    manager = CheckpointManager(
        None, [third], None, None, {}, cfg, Qwen3StateDictAdapter(args), base_folder=tmp_path
    )
    assert manager.load()
    assert manager.loaded_step == 0
    for key, value in model.state_dict().items():
        assert torch.equal(third.state_dict()[key], value), key


def _sharded(args: DecoderArgs, seed: int) -> Decoder:
    model = build(args, seed)
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    return model


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


@distributed(world_size=2)
@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_hf_import_train_export_import(folder: str, name: str) -> None:
    args = tiny(name)
    source = build(args, 0)  # a "downloaded" HF checkpoint, written by rank 0
    if dist.get_rank() == 0:
        hp_dcp.save_hf_safetensors(ADAPTERS[name](args).to_hf(source.state_dict()), f"{folder}/in")
    dist.barrier()
    model = _sharded(args, 1)
    manager = _manager(model, args, folder, name)
    manager.load_hf(f"{folder}/in")
    for key, value in _full(model).items():
        assert torch.equal(value, source.state_dict()[key]), key
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(rank_seed(0))  # different data on each rank
    for _ in range(2):
        tokens = torch.randint(0, args.vocab_size, (2, 9))
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    trained = _full(model)
    assert not torch.equal(trained["norm.weight"], source.state_dict()["norm.weight"])
    manager.export_hf(f"{folder}/out")
    again = _sharded(args, 2)
    _manager(again, args, folder, name).load_hf(f"{folder}/out")
    for key, value in _full(again).items():
        assert torch.equal(value, trained[key]), key


@pytest.fixture
def folder(tmp_path: Path) -> str:
    return str(tmp_path)


# -- config.json: RoPE scaling, flavor auto / checks, export to transformers -------------------

LLAMA31_TINY_CONFIG = {  # a Llama-3.1-style config.json at tiny sizes, as HF writes one
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,  # tiny, so that 48 positions need the scaling
    },
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "torch_dtype": "float32",
}


def _make_llama31_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """Write an HF checkpoint (safetensors + config.json) with random weights; return them."""
    torch.manual_seed(7)
    hf: dict[str, torch.Tensor] = {}
    cfg = LLAMA31_TINY_CONFIG
    dim, ffn, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"]
    head = dim // cfg["num_attention_heads"]
    hf["model.embed_tokens.weight"] = torch.randn(cfg["vocab_size"], dim)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        hf[p + "self_attn.q_proj.weight"] = torch.randn(dim, dim) * dim**-0.5
        hf[p + "self_attn.k_proj.weight"] = torch.randn(kv * head, dim) * dim**-0.5
        hf[p + "self_attn.v_proj.weight"] = torch.randn(kv * head, dim) * dim**-0.5
        hf[p + "self_attn.o_proj.weight"] = torch.randn(dim, dim) * dim**-0.5
        hf[p + "mlp.gate_proj.weight"] = torch.randn(ffn, dim) * dim**-0.5
        hf[p + "mlp.up_proj.weight"] = torch.randn(ffn, dim) * dim**-0.5
        hf[p + "mlp.down_proj.weight"] = torch.randn(dim, ffn) * ffn**-0.5
        hf[p + "input_layernorm.weight"] = 1 + 0.2 * torch.randn(dim)
        hf[p + "post_attention_layernorm.weight"] = 1 + 0.2 * torch.randn(dim)
    hf["model.norm.weight"] = 1 + 0.2 * torch.randn(dim)
    hf["lm_head.weight"] = torch.randn(cfg["vocab_size"], dim) * dim**-0.5
    hp_dcp.save_hf_safetensors(hf, folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    return hf


def _job(folder: Path, flavor: str, hf: Path, seq_len: int = 32) -> Any:
    from hp_trainer import ConfigManager

    return ConfigManager().from_dict(
        {
            "job": {"dump_folder": str(folder)},
            "model": {"name": "llama3", "flavor": flavor},
            "training": {"seq_len": seq_len},
            "checkpoint": {
                "enable": True,
                "initial_load_path": str(hf),
                "initial_load_in_hf": True,
            },
        }
    )


def test_llama31_checkpoint_loads_with_auto_and_gives_the_reference_logits(tmp_path: Path) -> None:
    from hp_trainer import get_model_spec
    from hp_trainer.components.hf_io.config import resolve_model_args
    from hp_trainer.models.common.decoder import RopeScaling

    hf = _make_llama31_checkpoint(tmp_path / "hf")
    args = resolve_model_args(get_model_spec("llama3"), _job(tmp_path, "auto", tmp_path / "hf"))
    assert args.rope_scaling == RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
    )
    assert (args.dim, args.n_kv_heads, args.ffn_hidden_dim, args.max_seq_len) == (64, 2, 192, 128)
    model = Decoder(args)
    manager = CheckpointManager(
        None, [model], None, None, {}, _Cfg(), Llama3StateDictAdapter(args), base_folder=tmp_path
    )
    manager.load_hf(tmp_path / "hf")
    tokens = torch.randint(0, 2048, (2, 48))
    with torch.no_grad():
        ours = model(tokens)
    reference = hf_reference_logits(hf, {**LLAMA31_TINY_CONFIG, "head_dim": 16}, tokens)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    # the scaling matters at these positions: without it the logits are far off
    plain = hf_reference_logits(
        hf, {**LLAMA31_TINY_CONFIG, "head_dim": 16, "rope_scaling": None}, tokens
    )
    assert (plain - reference).abs().max() > 1e-2


def test_a_flavor_that_differs_from_config_json_is_refused_naming_every_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hp_trainer.cli import main

    _make_llama31_checkpoint(tmp_path / "hf")
    hf = ["--checkpoint.enable", "--checkpoint.initial_load_in_hf"]
    hf += ["--checkpoint.initial_load_path", str(tmp_path / "hf")]
    assert main(["--model.flavor", "tiny", "--training.seq_len", "32", *hf]) == 2
    err = capsys.readouterr().err
    assert "model llama3/tiny does not describe the checkpoint" in err
    assert "rope_scaling: flavor has None, config.json has RopeScaling(factor=8.0" in err
    assert "intermediate_size: flavor has 192" not in err  # equal fields are not listed
    assert "max_position_embeddings: flavor has 512, config.json has 128" in err
    # auto: built from config.json; a sequence over its maximum is refused up front
    assert main(["--model.flavor", "auto", "--training.seq_len", "256", *hf]) == 2
    assert (
        "training.seq_len = 256 is over the maximum sequence length 128" in capsys.readouterr().err
    )
    # auto without an HF checkpoint, and a folder without config.json
    assert main(["--model.flavor", "auto"]) == 2
    assert "checkpoint.initial_load_in_hf = true" in capsys.readouterr().err
    (tmp_path / "hf" / "config.json").unlink()
    assert main(["--model.flavor", "auto", *hf]) == 2
    assert "no HuggingFace config.json" in capsys.readouterr().err


def test_published_flavors_match_their_config_json() -> None:
    from hp_trainer.components.hf_io.config import hf_config_mismatches

    llama31_8b = {  # Meta-Llama-3.1-8B config.json (the fields compared)
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
    }  # fmt: skip
    assert hf_config_mismatches(llama3_flavors["3.1-8B"], llama31_8b) == []
    wrong = hf_config_mismatches(llama3_flavors["8B"], llama31_8b)
    assert [line.split(":")[0] for line in wrong] == ["rope_scaling", "max_position_embeddings"]
    llama32_1b = {  # Llama-3.2-1B
        **llama31_8b, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "head_dim": 64, "tie_word_embeddings": True,
        "rope_scaling": {**llama31_8b["rope_scaling"], "factor": 32.0},  # type: ignore[dict-item]
    }  # fmt: skip
    assert hf_config_mismatches(llama3_flavors["1B"], llama32_1b) == []
    qwen3_06b = {  # Qwen3-0.6B
        "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "rope_scaling": None, "max_position_embeddings": 40960, "tie_word_embeddings": True,
    }  # fmt: skip
    assert hf_config_mismatches(qwen3_flavors["0.6B"], qwen3_06b) == []


def test_export_with_rope_scaling_loads_in_transformers_with_the_same_logits(
    tmp_path: Path,
) -> None:
    transformers = pytest.importorskip("transformers")
    from hp_trainer.components.hf_io.config import decoder_args_from_hf_config

    args = decoder_args_from_hf_config(LLAMA31_TINY_CONFIG)
    model = build(args, 3)
    _manager(model, args, str(tmp_path), "llama3").export_hf(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_scaling"] == LLAMA31_TINY_CONFIG["rope_scaling"]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    tokens = torch.randint(0, 2048, (2, 48))
    with torch.no_grad():
        theirs = hf_model(tokens).logits
        ours = model(tokens)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
