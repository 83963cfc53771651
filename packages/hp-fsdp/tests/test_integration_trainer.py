"""hp-fsdp under the transformers ``Trainer`` (``fsdp="full_shard auto_wrap"``, FSDP2).

The Trainer trains a tiny random ``LlamaForCausalLM`` for 5 steps with ``fsdp_config =
{"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
"activation_checkpointing": True}`` and bf16 mixed precision, once with torch's FSDP2 and once
with ``hp_fsdp.integrations.use_hp_fsdp``: every step's loss is bitwise equal, the model was
sharded by hp-fsdp, and the checkpoint the Trainer saved at step 3 resumes into the same losses
for steps 4 and 5. A peft LoRA model (frozen base and adapters in one unit) trains equal to torch's
FSDP2 too. 2 gloo ranks, the sampler gives each rank different rows. On CPU, Accelerate keeps
``MULTI_CPU``; the Trainer subclass below sets its state to FSDP as it would be on a GPU.
"""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_dtensor.testing import distributed, load_test_module
from hp_fsdp.integrations import hp_fsdp_active, use_hp_fsdp

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

STEPS = 5


def _h() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_integration_helpers.py"), "hp_fsdp_integration_helpers"
    )


class _Rows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(model: Any, out: str, tok: Any, *, lora: bool) -> Any:
    from accelerate.utils import FullyShardedDataParallelPlugin  # type: ignore[import-untyped]
    from transformers import Trainer, TrainingArguments, default_data_collator

    h = _h()

    class CpuFsdpTrainer(Trainer):
        exact_losses: list[float]

        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            h.force_fsdp_on_cpu(self.accelerator, plugin)
            self.is_fsdp_enabled = True

        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)
            self.exact_losses.append(loss.item())
            return loss

    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=3,
        report_to=[],
        use_cpu=True,
        bf16=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        fsdp="full_shard auto_wrap",
        fsdp_config={
            "fsdp_version": 2,
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "activation_checkpointing": not lora,
        },
    )
    enc = tok(h.texts(7, 4 * STEPS), return_tensors="pt")  # the sampler splits rows by rank
    trainer = CpuFsdpTrainer(
        model=model,
        args=args,
        train_dataset=_Rows(enc["input_ids"]),
        data_collator=default_data_collator,
        processing_class=tok,
    )
    trainer.exact_losses = []
    return trainer


def _train(out: str, *, lora: bool, resume: str | None = None) -> dict[str, Any]:
    h = _h()
    tok = h.tokenizer()
    with h.accelerate_env():
        model = h.tiny_llama()
        if lora:
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(1)
            config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
            model = get_peft_model(model, config)
        trainer = _trainer(model, out, tok, lora=lora)
        trainer.train(resume_from_checkpoint=resume)
        result = {
            "losses": list(trainer.exact_losses),
            "units": h.hp_units(trainer.model),
            "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            "checkpointed": sum(
                hasattr(m, "_checkpoint_wrapped_module") for m in trainer.model.modules()
            ),
            "param_dtype": trainer.accelerator.state.fsdp_plugin.mixed_precision_policy.param_dtype,
        }
        del trainer, model
        gc.collect()
    return result


def _shared_tmp() -> str:
    root = [tempfile.mkdtemp() if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(root, src=0)
    return str(root[0])


@distributed(world_size=2, timeout=300)
def test_trainer_fsdp2_bf16_ac_equal_to_torch_and_resumes() -> None:
    root = _shared_tmp()
    theirs = _train(f"{root}/torch", lora=False)
    gc.collect()
    with use_hp_fsdp(allow_torch_sharded=True):
        ours = _train(f"{root}/hp", lora=False)
        resumed = _train(f"{root}/hp", lora=False, resume=f"{root}/hp/checkpoint-3")
    assert not hp_fsdp_active()
    assert theirs["units"] == (0, 6), theirs
    assert ours["units"] == (6, 0), ours
    assert len(ours["losses"]) == STEPS
    assert ours["checkpointed"] == theirs["checkpointed"] == 2  # activation checkpointing on
    assert ours["param_dtype"] == theirs["param_dtype"] == torch.bfloat16
    assert ours["losses"] == theirs["losses"], (ours["losses"], theirs["losses"])
    assert resumed["losses"] == ours["losses"][3:], (resumed["losses"], ours["losses"])


@distributed(world_size=2, timeout=300)
def test_trainer_peft_lora_fsdp2_equal_to_torch() -> None:
    root = _shared_tmp()
    theirs = _train(f"{root}/torch", lora=True)
    gc.collect()
    with use_hp_fsdp(allow_torch_sharded=True):
        ours = _train(f"{root}/hp", lora=True)
    # peft's wrap policy is FSDP1's: Accelerate's FSDP2 path then shards the embedding, the
    # [norm, lm_head] tail and the root (layers with their frozen base and adapters)
    assert ours["units"][1] == 0, ours
    assert ours["units"][0] == theirs["units"][1] > 0, (ours, theirs)
    lora_numel = 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)  # 2 layers x (q: 32->32, v: 32->16)
    assert ours["trainable"] == theirs["trainable"] == lora_numel, (ours, theirs)
    assert ours["losses"] == theirs["losses"], (ours["losses"], theirs["losses"])
    assert ours["losses"][0] != ours["losses"][-1]  # the adapters trained
