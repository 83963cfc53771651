"""The validation loop under pipeline parallel: forward only through the schedule, the same loss
as one process on every rank, and training untouched by it."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import JobConfig, Trainer, load_documents
from hp_trainer.config import ValidationConfig


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


_PP = {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 2}


def _held_out(folder: Path) -> str:
    """Documents the training corpus (the first 200) does not contain."""
    path = folder / "valid.txt"
    if not path.exists():
        tmp = folder / f"valid.{torch.randint(1 << 30, ()).item()}.tmp"
        tmp.write_text("\n".join(load_documents("tiny_stories_synth")[200:260]) + "\n")
        tmp.replace(path)
    return str(path)


def _job(folder: Path, par: dict[str, Any], run: str, local_bs: int, val_bs: int) -> JobConfig:
    cfg: JobConfig = _helpers().job(folder, par, run=run, local_bs=local_bs, steps=2)
    if val_bs:
        cfg.validation = ValidationConfig(
            enable=True, dataset=_held_out(folder), local_batch_size=val_bs, freq=1, steps=2
        )
    return cfg


def _train(folder: Path, par: dict[str, Any], run: str, local_bs: int, val_bs: int) -> Any:
    """Training losses, and per validation: (logged loss, perplexity, whether it left every
    gradient None, the kinds of the schedule's actions in it)."""
    trainer = Trainer(_job(folder, par, run, local_bs, val_bs))
    validations: list[tuple[float, float, bool, set[str]]] = []
    validator = trainer.validator
    if validator is not None:
        validate = validator.validate
        log = trainer.metrics.log_validation

        def observed(model: torch.nn.Module) -> tuple[float, float]:
            # the step's gradients are spent (the next step zeroes them first): clear them to
            # see that the forward-only pass produces none
            trainer.optimizers.zero_grad()
            result = validate(model)
            no_grads = all(
                p.grad is None for part in trainer.model_parts for p in part.parameters()
            )
            kinds: set[str] = set()
            if trainer.pipeline is not None:
                kinds = {str(e[0]) for e in trainer.pipeline.parts.schedule.executor.events}
            validations.append((*result, no_grads, kinds))
            return result

        def logged(step: int, loss: float, perplexity: float) -> dict[str, Any]:
            assert (loss, perplexity) == validations[-1][:2]  # what validate() returned
            return log(step, loss, perplexity)

        validator.validate = observed  # type: ignore[method-assign]
        trainer.metrics.log_validation = logged  # type: ignore[method-assign]
    try:
        return trainer.train(), validations
    finally:
        trainer.close()


def _pp_runs(folder: str) -> Any:
    # 4 validation samples per dp rank: 2 schedule runs of the training local batch (2)
    with_val = _train(Path(folder), _PP, f"val{dist.get_rank()}", 2, 4)
    without = _train(Path(folder), _PP, f"plain{dist.get_rank()}", 2, 0)
    return with_val, without


def test_validation_under_pp_matches_one_process(tmp_path: Path) -> None:
    # the one-process run sees the same global batches: 4 training and 8 validation samples
    ref_losses, ref_val = _train(tmp_path, {}, "ref", 4, 8)
    results = run_distributed(_pp_runs, 4, str(tmp_path), timeout=150)
    (losses, validations), _ = results[0]
    assert len(validations) == 2  # after steps 1 and 2 (freq 1)
    for (rank_losses, rank_val), (plain_losses, _) in results:
        assert rank_losses == plain_losses  # validating leaves training bitwise unchanged
        assert [v[:2] for v in rank_val] == [v[:2] for v in validations]  # every rank logs it
        for val, ref in zip(rank_val, ref_val, strict=True):
            loss, perplexity, no_grads, kinds = val
            torch.testing.assert_close(loss, ref[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(perplexity, ref[1], rtol=1e-5, atol=1e-5)
            assert no_grads
            assert "F" in kinds  # forward only:
            assert not kinds & {"B", "I", "W", "send_b", "post_recv_b"}
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert ref_val[1][0] < ref_val[0][0]  # it learns: the held-out loss moves with training
