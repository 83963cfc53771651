"""Pipeline parallel in the trainer: pp x dp, pp x tp (and pp x dp x tp on 8 ranks) train like
one process (losses, gradient norms, final parameters); stop/resume under PP is exact and a
pipelined checkpoint resumes without PP (FQNs unchanged)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hp_dtensor.testing import run_distributed
from hp_trainer import ConfigManager, JobConfig, Trainer, load_documents


def _corpus(folder: Path) -> str:
    path = folder / "corpus.txt"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"corpus.{os.getpid()}.tmp"
        tmp.write_text("\n".join(load_documents("tiny_stories_synth")[:200]) + "\n")
        os.replace(tmp, path)
    return str(path)


def job(
    folder: Path,
    par: dict[str, Any],
    *,
    run: str,
    local_bs: int = 2,
    steps: int = 3,
    model: str = "llama3",
    checkpoint: dict[str, Any] | None = None,
) -> JobConfig:
    """A tiny-flavor float32 job (exact enough for parity at 1e-5)."""
    return ConfigManager().from_dict(
        {
            "job": {"run_name": run, "dump_folder": str(folder)},
            "model": {"name": model, "flavor": "tiny"},
            "training": {
                "local_batch_size": local_bs,
                "seq_len": 32,
                "steps": steps,
                "seed": 0,
                "max_norm": 1.0,
                "mixed_precision_param": "float32",
                "mixed_precision_reduce": "float32",
            },
            "parallelism": par,
            # Adam divides by sqrt(v) + eps: with eps 1e-8 a near-zero gradient summed in another
            # order (micro-batches) moves its weight by up to lr; 1e-6 keeps that below 1e-5
            "optimizer": {"lr": 5e-3, "eps": 1e-6},
            "lr_scheduler": {"warmup_steps": 1},
            "metrics": {"log_freq": 1, "enable_plot": False, "enable_progress_bar": False},
            "data": {"dataset": _corpus(folder)},
            "checkpoint": checkpoint or {},
        }
    )


def full_state(parts: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's parts, gathered whole (collective over the part's mesh)."""
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in part.state_dict().items():
            out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


def _train(folder: str, par: dict[str, Any], local_bs: int) -> Any:
    trainer = Trainer(job(Path(folder), par, run=f"r{dist.get_rank()}", local_bs=local_bs))
    try:
        losses = trainer.train()
        return losses, trainer.grad_norms, full_state(trainer.model_parts)
    finally:
        trainer.close()


def reference(folder: Path, local_bs: int, **kw: Any) -> tuple[list[float], list[float], Any]:
    trainer = Trainer(job(folder, {}, run="ref", local_bs=local_bs, **kw))
    losses = trainer.train()
    trainer.close()
    return losses, trainer.grad_norms, full_state(trainer.model_parts)


def assert_matches_reference(results: list[Any], ref: tuple[list[float], list[float], Any]) -> None:
    ref_losses, ref_norms, ref_state = ref
    seen: set[str] = set()
    for losses, norms, state in results:
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5
        )
        # the global gradient norm sums squares in another order in each layout: it drifts
        # by up to ~3e-5 relative (HSDP without CP/PP too), so it is checked at 1e-4
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-4, atol=0)
        for key, value in state.items():
            torch.testing.assert_close(
                value, ref_state[key], rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}"
            )
        seen |= set(state)
    assert seen == set(ref_state)  # the stages together hold the whole model, FQNs unchanged


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
    ref = reference(tmp_path, local_bs * dp)
    assert ref[0][-1] < ref[0][0]  # it learns
    assert_matches_reference(results, ref)


_PP = {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 2}
_CKPT = {"enable": True, "interval": 2, "keep_latest_k": 0, "last_save_model_only": False}


def _stopped_at_2(cfg: JobConfig) -> tuple[list[float], Trainer]:
    trainer = Trainer(cfg)
    observe = trainer.metrics.observe_loss

    def observe_then_stop(step: int, loss: float) -> None:  # what SIGTERM does, at step 2
        observe(step, loss)
        trainer._stop_requested = step == 2

    trainer.metrics.observe_loss = observe_then_stop  # type: ignore[method-assign]
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
    full, _ = _run(job(root, _PP, run="full", steps=4))
    stopped, _ = _stopped_at_2(job(root, _PP, run="stop", steps=4, checkpoint=_CKPT))
    resumed, trainer = _run(job(root, _PP, run="stop", steps=4, checkpoint=_CKPT))
    from_one, one = _run(job(root, _PP, run="one", steps=4, checkpoint=_CKPT))
    return full, stopped, resumed, trainer.checkpointer.loaded_step, from_one, one.step


def test_stop_resume_under_pp_exact_and_across_pp(tmp_path: Path) -> None:
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
    ref = reference(tmp_path, 4)
    assert_matches_reference(results, ref)


def _train_from_csv(folder: str) -> Any:
    from hp_pp import generators, read_schedule_csv, write_schedule_csv

    path = Path(folder) / f"gpipe{dist.get_rank()}.csv"
    gpipe = generators.generate("GPipe", pp_size=2, num_stages=2, n_microbatches=2)
    write_schedule_csv(gpipe, path)
    par = {**_PP, "pipeline_parallel_schedule_csv": str(path)}
    trainer = Trainer(job(Path(folder), par, run=f"csv{dist.get_rank()}"))
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
    ref_losses = reference(tmp_path, 4)[0]
    for losses, uses_file in results:
        assert uses_file
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5
        )
