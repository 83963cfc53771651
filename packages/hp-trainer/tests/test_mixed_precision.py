"""Mixed precision without FSDP: autocast compute, float32 parameters and optimizer state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hp_trainer import ConfigManager, Trainer, load_documents


def _trainer(folder: Path, dtype: str) -> Trainer:
    corpus = folder / "c.txt"
    if not corpus.exists():
        corpus.write_text("\n".join(load_documents("tiny_stories_synth")[:80]) + "\n")
    cfg = ConfigManager().from_dict(
        {
            "job": {"dump_folder": str(folder), "run_name": dtype},
            "model": {"flavor": "tiny"},
            "training": {"local_batch_size": 2, "seq_len": 32, "steps": 2, "seed": 0,
                         "mixed_precision_param": dtype},
            "metrics": {"enable_plot": False, "enable_progress_bar": False},
            "data": {"dataset": str(corpus)},
        }
    )  # fmt: skip
    return Trainer(cfg)


def test_bf16_compute_with_fp32_master_weights_on_one_process(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}
    reference = _trainer(tmp_path, "float32")
    try:
        fp32 = reference.train()
    finally:
        reference.close()
    trainer = _trainer(tmp_path, "bfloat16")

    def record(module: Any, args: Any, out: torch.Tensor) -> None:
        seen.setdefault("logits", out.dtype)

    hook = trainer.model.lm_head.register_forward_hook(record)
    try:
        bf16 = trainer.train()
    finally:
        hook.remove()
        trainer.close()
    assert seen["logits"] == torch.bfloat16  # the matmuls ran in bf16
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    state = trainer.optimizers.optimizers[0].state
    assert {s["exp_avg"].dtype for s in state.values()} == {torch.float32}
    assert bf16 != fp32  # a real change of precision ...
    torch.testing.assert_close(bf16, fp32, rtol=2e-2, atol=0)  # ... close to the fp32 run
