"""``--model.flavor auto`` for the MoE families (Qwen 3 MoE, DeepSeek-V3) and unknown models.

Oracles: every flavor's own ``config.json`` (the adapter's ``hf_config``) builds back exactly the
flavor's arguments; a tiny MoE model exported and re-imported with ``auto`` gives bitwise the
logits of the exported model (and ``transformers``, when installed, the same logits at 1e-5); a
named MoE flavor is checked against config.json field by field; a model type hp-trainer does not
have is refused before any process starts, naming its architectures and what is supported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hp_trainer import ConfigManager
from hp_trainer.cli import main
from hp_trainer.components.checkpoint import CheckpointManager
from hp_trainer.components.hf_io.config import (
    hf_config_mismatches,
    model_args_from_hf_config,
    resolve_model_args,
)
from hp_trainer.protocols.model_spec import get_model_spec

FAMILIES = ["qwen3_moe", "deepseek_v3"]


class _Cfg:
    enable = True
    folder = "checkpoint"


def _job(folder: Path, name: str, flavor: str, hf: Path) -> Any:
    return ConfigManager().from_dict(
        {
            "job": {"dump_folder": str(folder)},
            "model": {"name": name, "flavor": flavor},
            "training": {"seq_len": 32},
            "checkpoint": {
                "enable": True,
                "initial_load_path": str(hf),
                "initial_load_in_hf": True,
            },
        }
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_every_moe_flavor_is_rebuilt_from_its_config_json(name: str) -> None:
    spec = get_model_spec(name)
    for flavor in spec.flavors:
        args = spec.model_args(flavor)
        config = spec.state_dict_adapter(args).hf_config()  # type: ignore[misc]
        assert model_args_from_hf_config(config) == args, flavor
        assert hf_config_mismatches(args, config) == [], flavor


@pytest.mark.parametrize("name", FAMILIES)
def test_moe_export_reimported_with_auto_gives_the_same_logits(name: str, tmp_path: Path) -> None:
    spec = get_model_spec(name)
    torch.manual_seed(0)
    model = spec.build("tiny")
    model.init_weights()  # type: ignore[operator]
    adapter = spec.state_dict_adapter(spec.model_args("tiny"))  # type: ignore[misc]
    CheckpointManager(
        None, [model], None, None, {}, _Cfg(), adapter, base_folder=tmp_path
    ).export_hf(tmp_path / "hf")
    args = resolve_model_args(spec, _job(tmp_path, name, "auto", tmp_path / "hf"))
    assert args == spec.model_args("tiny")
    again = spec.model_cls(args)
    manager = CheckpointManager(
        None, [again], None, None, {}, _Cfg(), spec.state_dict_adapter(args), base_folder=tmp_path
    )  # type: ignore[misc]
    manager.load_hf(tmp_path / "hf")
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = again(tokens)
        assert torch.equal(ours, model(tokens))
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32
    )
    with torch.no_grad():
        torch.testing.assert_close(ours, reference(tokens).logits, rtol=1e-5, atol=1e-5)


def test_named_moe_flavor_is_checked_against_config_json(tmp_path: Path) -> None:
    spec = get_model_spec("qwen3_moe")
    config = spec.state_dict_adapter(spec.model_args("tiny")).hf_config()  # type: ignore[misc]
    config["num_experts_per_tok"] = 4
    config["num_experts"] = 16
    lines = hf_config_mismatches(spec.model_args("tiny"), config)
    assert lines == [
        "moe_args.num_experts: flavor has 8, config.json has 16",
        "moe_args.top_k: flavor has 2, config.json has 4",
    ]
    dense = get_model_spec("qwen3").state_dict_adapter(  # type: ignore[misc]
        get_model_spec("qwen3").model_args("tiny")
    )
    assert hf_config_mismatches(spec.model_args("tiny"), dense.hf_config()) == [
        "model_type: flavor has 'qwen3_moe', config.json has 'qwen3'"
    ]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"moe_args\.num_experts: flavor has 8"):
        resolve_model_args(spec, _job(tmp_path, "qwen3_moe", "tiny", tmp_path / "hf"))
    # auto with model.name of another family: told which name builds it
    with pytest.raises(ValueError, match=r"use --model\.name qwen3_moe"):
        resolve_model_args(
            get_model_spec("qwen3"), _job(tmp_path, "qwen3", "auto", tmp_path / "hf")
        )


def test_auto_refuses_an_unsupported_model_before_any_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    mixtral = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 2048,
        "intermediate_size": 128,
        "num_local_experts": 8,
    }
    (hf / "config.json").write_text(json.dumps(mixtral))
    args = ["--model.flavor", "auto", "--checkpoint.enable", "--checkpoint.initial_load_in_hf"]
    assert main([*args, "--checkpoint.initial_load_path", str(hf)]) == 2
    err = capsys.readouterr().err
    assert "architectures ['MixtralForCausalLM'] (model_type 'mixtral')" in err
    assert "qwen3_moe (Qwen3MoeForCausalLM), deepseek_v3 (DeepseekV3ForCausalLM)" in err
    # a DeepSeek-V3 option the model does not have is named too
    spec = get_model_spec("deepseek_v3")
    config = spec.state_dict_adapter(spec.model_args("tiny")).hf_config()  # type: ignore[misc]
    with pytest.raises(ValueError, match="rope_interleave false"):
        model_args_from_hf_config({**config, "rope_interleave": False})
    with pytest.raises(ValueError, match="mlp_only_layers"):
        model_args_from_hf_config(
            {
                **get_model_spec("qwen3_moe")
                .state_dict_adapter(  # type: ignore[misc]
                    get_model_spec("qwen3_moe").model_args("tiny")
                )
                .hf_config(),
                "mlp_only_layers": [1],
            }
        )
