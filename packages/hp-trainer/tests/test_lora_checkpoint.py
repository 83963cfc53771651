"""LoRA checkpoints and exports, against real clients.

One fine-tuning flow in one process: an HF base model (not the trainer's own initialisation)
is imported, LoRA trains 3 steps, checkpoints at step 2 and at the end.

- Checkpoints hold the adapters only (model keys counted) plus the ``lora`` state.
- A resume from step 2 reloads the frozen base from the HF checkpoint and the adapters from
  step 2: step 3 gives bitwise the same loss and adapters as the uninterrupted run.
- The PEFT adapter written with the last step's HF export loads with
  ``peft.PeftModel.from_pretrained`` onto the ``transformers`` model of the base export: same
  logits as our trained model (1e-5); the merged HF export equals ``merge_and_unload`` of it.
- Resuming with another alpha or rank is refused, naming both values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import hp_dcp
from hp_dtensor.testing import load_test_module
from hp_trainer import JobConfig, Llama3StateDictAdapter, LoRAConfig, Trainer
from hp_trainer.components.converters.lora import is_lora_key

_lora = load_test_module(Path(__file__).with_name("test_lora.py"), "hp_trainer_tests_lora")
RANK, ALPHA, N_ADAPTER_PARAMS = _lora.RANK, _lora.ALPHA, _lora.N_ADAPTER_PARAMS
_h, _tiny_model = _lora._h, _lora._tiny_model


def _base_hf(folder: Path) -> Path:
    """A base model in HF format, initialised with another seed than the trainer's."""
    out = folder / "base-hf"
    model = _tiny_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # not the seeded init the trainer would draw
    adapter = Llama3StateDictAdapter(model.args)
    hp_dcp.save_hf_safetensors(adapter.to_hf(model.state_dict()), out)
    (out / "config.json").write_text(json.dumps(adapter.hf_config()) + "\n")
    return out


def _job(folder: Path, run: str, base: Path, **lora: Any) -> JobConfig:
    ckpt = {
        "enable": True,
        "interval": 2,
        "keep_latest_k": 0,
        "initial_load_path": str(base),
        "initial_load_in_hf": True,
        "last_save_in_hf": True,
    }
    cfg: JobConfig = _h().job(folder, {}, run=run, checkpoint=ckpt)
    cfg.model.converters = ["lora"]
    cfg.lora = LoRAConfig(**{"rank": RANK, "alpha": ALPHA, **lora})
    return cfg


def _model_keys(step_dir: Path) -> set[str]:
    metadata = hp_dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata
    return {k.removeprefix("model.") for k in metadata if k.startswith("model.")}


def test_adapter_checkpoints_resume_and_export_to_peft(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base = _base_hf(tmp_path)
    trainer = Trainer(_job(tmp_path, "run", base))
    losses = trainer.train()
    trainer.close()
    ckpt = tmp_path / "run" / "checkpoint"
    for step in (2, 3):
        keys = _model_keys(ckpt / f"step-{step}")
        assert len(keys) == N_ADAPTER_PARAMS
        assert all(is_lora_key(k) for k in keys)

    # the trained model's logits, and the same from peft on transformers
    tokens = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = trainer.model(tokens)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base))
    adapter_dir = ckpt / "step-3-hf" / "adapter"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == RANK
    assert config["lora_alpha"] == ALPHA
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    peft_model = peft.PeftModel.from_pretrained(hf, str(adapter_dir)).eval()
    with torch.no_grad():
        theirs = peft_model(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    merged_hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt / "step-3-hf")).eval()
    with torch.no_grad():
        merged = merged_hf(tokens).logits
        unloaded = peft_model.merge_and_unload()(tokens).logits
    torch.testing.assert_close(merged, unloaded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, ours, rtol=1e-5, atol=1e-5)
    # the adapters moved the model away from the base
    with torch.no_grad():
        base_logits = transformers.AutoModelForCausalLM.from_pretrained(str(base))(tokens).logits
    assert (base_logits - ours).abs().max() > 1e-3

    # resume from step 2 in a new run folder: base from HF again, adapters from the checkpoint
    for run, lora in (("resume", {}), ("alpha", {"alpha": 2 * ALPHA}), ("rank", {"rank": 2})):
        (tmp_path / run / "checkpoint").mkdir(parents=True)
        shutil.copytree(ckpt / "step-2", tmp_path / run / "checkpoint" / "step-2")
        again = Trainer(_job(tmp_path, run, base, **lora))
        if run == "resume":
            resumed = again.train()
            again.close()
            assert resumed == losses[2:]
            state = _h().full_state(again.model_parts)
            for k, v in _h().full_state(trainer.model_parts).items():
                assert torch.equal(state[k], v), k
            continue
        key = "alpha" if run == "alpha" else "rank"
        with pytest.raises(
            ValueError, match=rf"checkpoint's LoRA adapters have {key} = .* but lora\.{key}"
        ):
            again.train()
        again.close()
