"""The training step reads nothing from the device except on log steps.

Every ``.item()`` makes the host wait for the accelerator, which ends the overlap of the next
step's launch with this step's kernels. The trainer keeps the token count, loss and gradient norm
on the device and reads them (all steps since the last read, in one go) on log, validation and
checkpoint steps; the SIGTERM check runs after those steps only. Counted with
:func:`hp_dtensor.testing.count_host_syncs` (CPU tensors stand for device tensors), on one
process: 0 host syncs of the trainer's own in a non-log step, a handful in a log step. PyTorch's
eager AdamW makes one host scalar per step for its host-side step counters
(``torch.tensor(1.0, device="cpu")``, not a sync on an accelerator either): measured alone and
allowed, at the optimizer's call site only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hp_dtensor.testing import count_host_syncs, load_test_module
from hp_trainer import ConfigManager, Trainer

_h = load_test_module(
    Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
)


def _optimizer_own_syncs(like: torch.optim.Optimizer) -> int:
    """What PyTorch's optimizer step counts alone (its host step counters), after step 1."""
    param = torch.nn.Parameter(torch.ones(4))
    opt = type(like)([param], foreach=like.defaults.get("foreach"))
    param.grad = torch.ones(4)
    opt.step()
    host = [s["step"] for s in opt.state.values()]
    with count_host_syncs(host_tensors=host) as syncs:
        opt.step()
    assert set(syncs.by_op) <= {"tensor_from_python"}
    return syncs.total


def _counted_steps(trainer: Trainer) -> list[Any]:
    """Run ``trainer.train()`` with each step's host syncs counted (data loading excluded)."""
    counts: list[Any] = []
    run_step = trainer._run_step

    def counted(batches: Any) -> bool:
        # the optimizer's step counters live on the host on an accelerator too (PyTorch's)
        host = [s["step"] for opt in trainer.optimizers for s in opt.state.values()]
        with count_host_syncs(host_tensors=host) as syncs:
            read = run_step(batches)
        counts.append((trainer.step, syncs))
        return read

    trainer._run_step = counted  # type: ignore[method-assign]
    return counts


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("syncs")
    out: dict[str, Any] = {}
    for name in ("llama3", "qwen3"):
        job = _h.job(folder, {}, run=name, steps=4, model=name)
        raw = job.to_dict()
        raw["metrics"]["log_freq"] = 3  # logs at steps 1, 3, 4: step 2 is not a log step
        trainer = Trainer(ConfigManager().from_dict(raw))
        counts = _counted_steps(trainer)
        losses = trainer.train()
        trainer.close()
        out[name] = (counts, losses, trainer.grad_norms)
        out["optimizers"] = trainer.optimizers.optimizers
    return out


@pytest.mark.parametrize("model", ["llama3", "qwen3"])
def test_a_non_log_step_makes_no_host_sync(runs: dict[str, Any], model: str) -> None:
    counts, losses, norms = runs[model]
    by_step = dict(counts)
    ours = [
        (op, site)
        for op, site in by_step[2].events
        if "hp_trainer/components/optimizer/containers.py" not in site
    ]
    assert ours == [], by_step[2].summary()  # none of the trainer's own
    own = sum(_optimizer_own_syncs(opt) for opt in runs["optimizers"])
    assert by_step[2].total == own  # PyTorch's optimizer's, only
    assert by_step[1].total > 0  # a log step reads: the counter sees the trainer's reads
    # the values read later are every step's, in order, finite
    assert len(losses) == len(norms) == 4
    assert all(torch.isfinite(torch.tensor(losses + norms)))
