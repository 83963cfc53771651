"""Trainer losses under FSDP, HSDP and FSDP x TP match a single-process run step by step."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import ConfigManager, JobConfig, Trainer


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def tiny_config(
    folder: Path,
    *,
    model: str = "llama3",
    steps: int = 10,
    local_batch_size: int = 2,
    global_batch_size: int = -1,
    parallelism: dict[str, Any] | None = None,
    run_name: str = "run",
) -> JobConfig:
    """A 10-step tiny-flavor job in float32 (exact enough for parity at 1e-5)."""
    return ConfigManager().from_dict(
        {
            "job": {"run_name": run_name, "dump_folder": str(folder)},
            "model": {"name": model, "flavor": "tiny"},
            "training": {
                "local_batch_size": local_batch_size,
                "global_batch_size": global_batch_size,
                "seq_len": 32,
                "steps": steps,
                "seed": 0,
                "max_norm": 1.0,
                "mixed_precision_param": "float32",
                "mixed_precision_reduce": "float32",
            },
            "parallelism": parallelism or {},
            "optimizer": {"lr": 5e-3},
            "lr_scheduler": {"warmup_steps": 2, "decay_type": "cosine"},
            "metrics": {"log_freq": 5, "enable_plot": False, "enable_progress_bar": False},
            # 400 documents: tokenizing all of the corpus 4x per test is slow
            "data": {"dataset": _helpers().corpus(folder, 400)},
        }
    )


def _train(
    folder: str, model: str, local_bs: int, global_bs: int, par: dict[str, Any], ref: bool = False
) -> Any:
    cfg = tiny_config(
        Path(folder),
        model=model,
        local_batch_size=local_bs,
        global_batch_size=global_bs,
        parallelism=par,
        run_name="ref" if ref else f"rank{dist.get_rank()}",
    )
    trainer = Trainer(cfg)
    losses = trainer.train()
    trainer.close()
    return losses, trainer.grad_norms, trainer.dp_rank


_SINGLE: dict[tuple[str, int, int], Any] = {}


def _single_process(folder: str, model: str, local_bs: int, global_bs: int) -> Any:
    """The one-process run of a case, computed once per session (fsdp2xtp2, hsdp2x1xtp2 and
    the compile test share one)."""
    key = (model, local_bs, global_bs)
    if key not in _SINGLE:
        _SINGLE[key] = _train(folder, model, local_bs, global_bs, {}, ref=True)
    return _SINGLE[key]


_CASES = [
    # (world size, model, per-rank batch, global batch, parallelism)
    (3, "llama3", 2, -1, {"data_parallel_shard_degree": 3}),
    # HSDP with 2 gradient-accumulation micro-batches per step
    (4, "llama3", 2, 16, {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2}),
    (4, "llama3", 2, -1, {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}),
    (4, "qwen3", 2, -1, {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}),
    # HSDP (replicate 2 x shard 1) over TP 2: the (replicate, shard, tp) DTensor layout
    (
        4,
        "llama3",
        2,
        -1,
        {
            "data_parallel_replicate_degree": 2,
            "data_parallel_shard_degree": 1,
            "tensor_parallel_degree": 2,
        },
    ),
]


@pytest.mark.parametrize(
    ("ws", "model", "local_bs", "global_bs", "par"),
    _CASES,
    ids=["fsdp3", "hsdp2x2-accum2", "fsdp2xtp2", "qwen3-fsdp2xtp2", "hsdp2x1xtp2"],
)
def test_parallel_losses_match_single_process(
    tmp_path: Path, ws: int, model: str, local_bs: int, global_bs: int, par: dict[str, Any]
) -> None:
    results = run_distributed(
        _train, ws, str(tmp_path), model, local_bs, global_bs, par, timeout=120
    )
    dp = ws // par.get("tensor_parallel_degree", 1)
    ref_losses, ref_norms, _ = _single_process(str(tmp_path), model, local_bs * dp, global_bs)
    assert len(ref_losses) == 10
    assert ref_losses[-1] < ref_losses[0] - 0.5  # it learns
    dp_ranks = set()
    for losses, norms, dp_rank in results:
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-5
        )
        dp_ranks.add(dp_rank)
    assert dp_ranks == set(range(dp))  # every data-parallel rank saw its own slice


def _train_and_close(cfg: JobConfig) -> list[float]:
    trainer = Trainer(cfg)
    try:
        return trainer.train()
    finally:
        trainer.close()


def _train_meta(folder: str) -> Any:
    cfg = tiny_config(Path(folder), run_name=f"meta{dist.get_rank()}", parallelism={})
    cfg.model.init_device = "meta"
    return _train_and_close(cfg)


def test_meta_init_single_process_matches_cpu_init(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, run_name="meta", steps=3)
    cfg.model.init_device = "meta"
    meta = Trainer(cfg)
    cpu = Trainer(tiny_config(tmp_path, run_name="cpu", steps=3))
    for (name, a), b in zip(
        meta.model.state_dict().items(), cpu.model.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, msg=name)
    torch.testing.assert_close(meta.model.rope_cache, cpu.model.rope_cache)
    torch.testing.assert_close(meta.train(), cpu.train())


def test_meta_init_under_fsdp_trains(tmp_path: Path) -> None:
    results = run_distributed(_train_meta, 2, str(tmp_path), timeout=120)
    torch.testing.assert_close(torch.tensor(results[0]), torch.tensor(results[1]))
    assert results[0][-1] < results[0][0] - 0.5


def _train_compiled(folder: str) -> Any:
    cfg = tiny_config(
        Path(folder),
        steps=2,
        parallelism={"data_parallel_shard_degree": 2},
        run_name=f"compiled{dist.get_rank()}",
    )
    cfg.compile.enable = True
    cfg.compile.backend = "aot_eager"
    return _train_and_close(cfg)


def test_compiled_blocks_under_fsdp_match_eager(tmp_path: Path) -> None:
    compiled = run_distributed(_train_compiled, 2, str(tmp_path), timeout=180)
    eager, _, _ = _single_process(str(tmp_path), "llama3", 4, -1)
    torch.testing.assert_close(
        torch.tensor(compiled[0]), torch.tensor(eager[:2]), rtol=1e-5, atol=1e-5
    )
