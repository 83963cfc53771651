"""Pipeline parallel in the trainer: pp x dp, pp x tp (and pp x dp x tp on 8 ranks) train like
one process (losses, gradient norms, final parameters); stop/resume under PP is exact and a
pipelined checkpoint resumes without PP (FQNs unchanged)."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import JobConfig, Trainer


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _train(folder: str, par: dict[str, Any], local_bs: int) -> Any:
    h = _helpers()
    trainer = Trainer(h.job(Path(folder), par, run=f"r{dist.get_rank()}", local_bs=local_bs))
    try:
        losses = trainer.train()
        return losses, trainer.grad_norms, h.full_state(trainer.model_parts)
    finally:
        trainer.close()


_CASES = {
    # pp 2 x cp 2: the CP shards (inputs, RoPE) reach every stage, the loss the last one
    "pp2xcp2": (4, {"pipeline_parallel_degree": 2, "context_parallel_degree": 2}, 1),
    # pp 2 x dp_shard 2, 1F1B over 2 micro-batches of 1 sample
    "pp2xdp2-1f1b": (4, {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 2}, 2),
    # pp 2 x tp 2, interleaved (2 stages per rank: embedding+block 0 | block 1 | ...)
    "pp2xtp2-interleaved": (
        4,
        {
            "pipeline_parallel_degree": 2,
            "tensor_parallel_degree": 2,
            "pipeline_parallel_schedule": "Interleaved1F1B",
        },
        1,
    ),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_pipelined_training_matches_one_process(tmp_path: Path, case: str) -> None:
    ws, par, dp = _CASES[case]
    local_bs = 2  # 2 micro-batches of 1 sample (pipeline_parallel_microbatch_size 1)
    results = run_distributed(_train, ws, str(tmp_path), par, local_bs, timeout=150)
    ref = _helpers().reference(tmp_path, local_bs * dp)
    assert ref[0][-1] < ref[0][0]  # it learns
    _helpers().assert_matches_reference(results, ref)


_PP = {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 2}
_CKPT = {"enable": True, "interval": 2, "keep_latest_k": 0, "last_save_model_only": False}


def _stopped_at_2(cfg: JobConfig) -> tuple[list[float], Trainer]:
    trainer = Trainer(cfg)
    _helpers().stop_at(trainer, 2)
    try:
        return trainer.train(), trainer
    finally:
        trainer.close()


def _run(cfg: JobConfig) -> tuple[list[float], Trainer]:
    trainer = Trainer(cfg)
    try:
        return trainer.train(), trainer
    finally:
        trainer.close()


def _stop_resume_under_pp(folder: str) -> Any:
    """pp 2 x dp 2: 4 steps uninterrupted; stopped at 2 and resumed; resumed from the
    single-process checkpoint in ``one``."""
    root = Path(folder)
    job = _helpers().job
    full, _ = _run(job(root, _PP, run="full", steps=4))
    stopped, _ = _stopped_at_2(job(root, _PP, run="stop", steps=4, checkpoint=_CKPT))
    resumed, trainer = _run(job(root, _PP, run="stop", steps=4, checkpoint=_CKPT))
    from_one, one = _run(job(root, _PP, run="one", steps=4, checkpoint=_CKPT))
    return full, stopped, resumed, trainer.checkpointer.loaded_step, from_one, one.step


def test_stop_resume_under_pp_exact_and_across_pp(tmp_path: Path) -> None:
    job = _helpers().job
    # a single-process run saves step-2 (then stops): the pipelined run resumes from it below
    one_stopped, _ = _stopped_at_2(job(tmp_path, {}, run="one", local_bs=4, steps=4,
                                       checkpoint=_CKPT))  # fmt: skip
    results = run_distributed(_stop_resume_under_pp, 4, str(tmp_path), timeout=180)
    full, stopped, resumed, loaded, from_one, one_step = results[0]
    assert all(r == results[0] for r in results)  # every rank reports the global loss
    assert loaded == 2
    assert len(stopped) == len(resumed) == 2
    assert stopped + resumed == full  # same layout: bitwise
    torch.testing.assert_close(one_stopped, full[:2], rtol=1e-5, atol=1e-5)
    assert one_step == 4
    torch.testing.assert_close(from_one, full[2:], rtol=1e-5, atol=1e-5)  # no PP -> PP

    # PP -> no PP: the pipelined step-2 (each stage saved its own FQNs) on one process
    shutil.rmtree(tmp_path / "stop" / "checkpoint" / "step-4")
    resumed_one, trainer = _run(job(tmp_path, {}, run="stop", local_bs=4, steps=4,
                                    checkpoint=_CKPT))  # fmt: skip
    assert trainer.checkpointer.loaded_step == 2
    torch.testing.assert_close(resumed_one, full[2:], rtol=1e-5, atol=1e-5)


def test_pp2_dp2_tp2_on_8_ranks_matches_one_process(tmp_path: Path) -> None:
    par = {
        "pipeline_parallel_degree": 2,
        "data_parallel_shard_degree": 2,
        "tensor_parallel_degree": 2,
    }
    results = run_distributed(_train, 8, str(tmp_path), par, 2, timeout=240)
    ref = _helpers().reference(tmp_path, 4)
    _helpers().assert_matches_reference(results, ref)


def _train_from_csv(folder: str) -> Any:
    from hp_pp import generators, read_schedule_csv, write_schedule_csv

    path = Path(folder) / f"gpipe{dist.get_rank()}.csv"
    gpipe = generators.generate("GPipe", pp_size=2, num_stages=2, n_microbatches=2)
    write_schedule_csv(gpipe, path)
    par = {**_PP, "pipeline_parallel_schedule_csv": str(path)}
    trainer = Trainer(_helpers().job(Path(folder), par, run=f"csv{dist.get_rank()}"))
    try:
        assert trainer.pipeline is not None
        schedule = trainer.pipeline.parts.schedule
        # the CSV's table (GPipe's order), not the named schedule's (1F1B)
        uses_file = schedule.pipeline_order == read_schedule_csv(path)
        return trainer.train(), uses_file
    finally:
        trainer.close()


def test_schedule_from_a_csv_file_trains_like_one_process(tmp_path: Path) -> None:
    results = run_distributed(_train_from_csv, 4, str(tmp_path), timeout=150)
    ref_losses = _helpers().reference(tmp_path, 4)[0]
    for losses, uses_file in results:
        assert uses_file
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5
        )
