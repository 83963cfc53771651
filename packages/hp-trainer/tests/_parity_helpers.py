"""What the trainer's parity, resume and history tests share: a tiny corpus, a tiny float32 job,
whole parameters gathered from each rank's parts, a single-process reference run, the comparison
with it, and a stop requested at a chosen step (what SIGTERM does).

Loaded with ``hp_dtensor.testing.load_test_module`` (test folders are not packages); worker
functions stay in the test files and load this module the same way on the ranks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hp_trainer import ConfigManager, JobConfig, Trainer, load_documents


def corpus(folder: Path, documents: int = 200) -> str:
    """The first ``documents`` of the shipped corpus in ``folder`` (written once, atomically)."""
    path = folder / "corpus.txt"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"corpus.{os.getpid()}.tmp"
        tmp.write_text("\n".join(load_documents("tiny_stories_synth")[:documents]) + "\n")
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
            "data": {"dataset": corpus(folder)},
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


_REFERENCES: dict[str, tuple[list[float], list[float], Any, list[dict[str, Any]]]] = {}


def reference(folder: Path, local_bs: int, **kw: Any) -> tuple[list[float], list[float], Any]:
    """The single-process run of :func:`job`: losses, gradient norms, final parameters.

    Computed once per test session for each (batch, options) and shared (read-only) by every
    test that compares with it: the run is deterministic and its corpus the same wherever it is
    written. A reference that checkpoints (its files are used) runs every time.
    """
    losses, norms, state, _ = reference_run(folder, local_bs, **kw)
    return losses, norms, state


def reference_run(
    folder: Path, local_bs: int, **kw: Any
) -> tuple[list[float], list[float], Any, list[dict[str, Any]]]:
    """:func:`reference` and the run's metrics history (the MoE tests compare expert loads)."""
    key = repr((local_bs, sorted(kw.items())))
    if "checkpoint" in kw or key not in _REFERENCES:
        trainer = Trainer(job(folder, {}, run="ref", local_bs=local_bs, **kw))
        losses = trainer.train()
        trainer.close()
        history = trainer.metrics.history
        result = (losses, trainer.grad_norms, full_state(trainer.model_parts), history)
        if "checkpoint" in kw:
            return result
        _REFERENCES[key] = result
    return _REFERENCES[key]


def assert_matches_reference(
    results: list[Any],
    ref: tuple[list[float], list[float], Any],
    *,
    each_rank_whole: bool = False,
    norm_rtol: float = 1e-4,
    norm_atol: float = 0.0,
) -> None:
    """Every rank's (losses, gradient norms, parameters) equal the reference's at 1e-5.

    The gradient norm sums squares in another order in each layout: it drifts by up to ~3e-5
    relative (HSDP without CP/PP too), hence its own tolerance. With ``each_rank_whole`` every
    rank holds every parameter; else (pipeline stages) the ranks together hold them all.
    """
    ref_losses, ref_norms, ref_state = ref
    seen: set[str] = set()
    for losses, norms, state in results:
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            torch.tensor(norms), torch.tensor(ref_norms), rtol=norm_rtol, atol=norm_atol
        )
        if each_rank_whole:
            assert set(state) == set(ref_state)
        for key, value in state.items():
            torch.testing.assert_close(
                value, ref_state[key], rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}"
            )
        seen |= set(state)
    assert seen == set(ref_state)  # the whole model, FQNs unchanged


def stop_at(trainer: Trainer, step: int) -> None:
    """Request a stop once ``step`` is done, as the SIGTERM handler does."""
    observe = trainer.metrics.observe_loss

    def observe_then_stop(done: int, loss: float) -> None:
        observe(done, loss)
        if done == step:
            trainer._stop_requested = True

    trainer.metrics.observe_loss = observe_then_stop  # type: ignore[method-assign]
