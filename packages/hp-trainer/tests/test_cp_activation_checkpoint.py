"""Context parallel with activation checkpointing, and in compiled blocks, in the trainer.

Each layout trains 1 step on the tiny llama3 with every activation-checkpointing mode that
composes with CP: the losses, gradient norms, last step's gradients and final parameters equal
the same layout without checkpointing bitwise (the recomputation runs the same ops on the same
shards), and one process at the parity tolerance. The context-parallel engine is counted: under
``full`` and selective per-op AC every block's attention runs twice per step (forward and
recomputation), every second block's under ``selective`` ``"2"``, once under ``swap``, so a
checkpoint silently off (or recomputed outside CP) fails here. Ring at cp 2, all-gather at cp 3
(non-power-of-two, sequence 24), Ulysses at cp 2.

Compiled blocks (``aot_eager``, ``fullgraph = false``): the attention is a graph break and runs
eagerly between compiled pieces; with no AC, ``memory_budget``, ``full`` and selective per-op AC
(the checkpoint eager around the compiled block) the losses, gradients and parameters equal
eager CP within 1e-5, and graphs were really compiled (with the checkpoint traced, Dynamo would
run checkpointed blocks uncompiled: no graph).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hp_cp_ep.cp import ContextParallelAttention
from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import ConfigManager, JobConfig, Trainer

STEPS, LOCAL_BS, N_LAYERS = 1, 2, 2  # tiny llama3: 2 blocks

_COMPILED = {"enable": True, "backend": "aot_eager", "fullgraph": False}
#: activation_checkpoint and compile sections, and the engine calls per block and step
_AC: dict[str, tuple[dict[str, Any], dict[str, Any], float]] = {
    "none": ({"mode": "none"}, {}, 1),
    "full": ({"mode": "full"}, {}, 2),
    "selective-op": ({"mode": "selective", "selective_ac_option": "op"}, {}, 2),
    "selective-2": ({"mode": "selective", "selective_ac_option": "2"}, {}, 1.5),
    "swap": ({"mode": "swap"}, {}, 1),
    # the attention is a graph break: it runs eagerly, once (the partitioner recomputes inside
    # the compiled pieces only)
    "compiled": ({"mode": "none"}, _COMPILED, 1),
    "compiled-memory_budget": ({"mode": "memory_budget", "memory_budget": 0.0}, _COMPILED, 1),
    # checkpointed blocks: the checkpoint stays eager around the compiled block, whose
    # recomputation runs the attention again
    "compiled-full": ({"mode": "full"}, _COMPILED, 2),
    "compiled-op": ({"mode": "selective", "selective_ac_option": "op"}, _COMPILED, 2),
}


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _job(folder: Path, par: dict[str, Any], ac: str, seq_len: int, run: str) -> JobConfig:
    job = _helpers().job(folder, par, run=run, local_bs=LOCAL_BS, steps=STEPS)
    raw = job.to_dict()
    raw["activation_checkpoint"] = _AC[ac][0]
    raw["compile"] = _AC[ac][1]
    raw["training"]["seq_len"] = seq_len
    return ConfigManager().from_dict(raw)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


@contextmanager
def _engine_calls() -> Iterator[list[str]]:
    # every route into the engine (its __call__ and the SDPA redirect) ends in ``_call``
    calls: list[str] = []
    original = ContextParallelAttention._call

    def counted(self: ContextParallelAttention, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(self.mode)
        return original(self, *args, **kwargs)

    ContextParallelAttention._call = counted  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        ContextParallelAttention._call = original  # type: ignore[method-assign]


def _compiled_graphs() -> tuple[int, int]:
    """Graphs Dynamo compiled so far, and graph breaks at a ``torch.compiler.disable``."""
    counters = torch._dynamo.utils.counters
    breaks = sum(n for reason, n in counters["graph_break"].items() if "disable" in reason)
    return int(counters["stats"]["unique_graphs"]), breaks


def _train_each(folder: str, par: dict[str, Any], acs: list[str], seq_len: int) -> list[Any]:
    """Per variant: losses, grad norms, final params, last gradients, engine calls, graphs."""
    out = []
    for ac in acs:
        job = _job(Path(folder), par, ac, seq_len, run=f"{ac}-r{dist.get_rank()}")
        torch._dynamo.reset()  # type: ignore[no-untyped-call]
        torch._dynamo.utils.counters.clear()
        trainer = Trainer(job)
        try:
            with _engine_calls() as calls:
                losses = trainer.train()
            grads = {}
            for name, p in trainer.model.named_parameters():
                assert p.grad is not None, name
                grads[name.replace("_checkpoint_wrapped_module.", "")] = _whole(p.grad)
            params = _helpers().full_state(trainer.model_parts)
            graphs = _compiled_graphs()
            out.append((losses, trainer.grad_norms, params, grads, len(calls), graphs))
        finally:
            trainer.close()
    return out


_REFS: dict[int, tuple[list[float], list[float], Any]] = {}


def _reference(folder: Path, seq_len: int) -> tuple[list[float], list[float], Any]:
    """One process without checkpointing, once per sequence length and session (read-only)."""
    if seq_len not in _REFS:
        trainer = Trainer(_job(folder, {}, "none", seq_len, run="ref"))
        try:
            losses = trainer.train()
            _REFS[seq_len] = losses, trainer.grad_norms, _helpers().full_state(trainer.model_parts)
        finally:
            trainer.close()
    return _REFS[seq_len]


_CASES = {
    # (world size, parallelism, sequence length, variants besides none)
    "cp2-ring": (
        2,
        {"context_parallel_degree": 2, "context_parallel_rotate_method": "ring"},
        32,
        ["full", "selective-op", "swap", "compiled", "compiled-memory_budget", "compiled-full"],
    ),
    "cp3-allgather": (
        3,
        {"context_parallel_degree": 3, "context_parallel_rotate_method": "allgather"},
        24,
        ["full", "selective-2", "compiled-op"],
    ),
    "cp2-ulysses": (
        2,
        {"context_parallel_degree": 2, "context_parallel_rotate_method": "ulysses"},
        32,
        ["full"],
    ),
}


def _assert_close_to(variant: str, got: tuple[Any, ...], want: tuple[Any, ...]) -> None:
    close = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), **close)
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), **close)
    for kind, values, wanted in (("param", got[2], want[2]), ("grad", got[3], want[3])):
        assert values.keys() == wanted.keys(), (variant, kind)
        for name, value in values.items():
            where = f"{variant} {kind} {name}"
            torch.testing.assert_close(
                value, wanted[name], **close, msg=lambda m, w=where: f"{w}: {m}"
            )


def _assert_bitwise(variant: str, got: tuple[Any, ...], want: tuple[Any, ...]) -> None:
    assert got[0] == want[0], variant
    assert got[1] == want[1], variant
    for kind, values, wanted in (("param", got[2], want[2]), ("grad", got[3], want[3])):
        assert values.keys() == wanted.keys(), (variant, kind)
        for name, value in values.items():
            assert torch.equal(value, wanted[name]), f"{variant} {kind} {name}"


@pytest.mark.parametrize("case", list(_CASES))
def test_context_parallel_with_activation_checkpointing(tmp_path: Path, case: str) -> None:
    ws, par, seq_len, variants = _CASES[case]
    results = run_distributed(
        _train_each, ws, str(tmp_path), par, ["none", *variants], seq_len, timeout=240
    )
    ref = _reference(tmp_path, seq_len)
    _helpers().assert_matches_reference([r[0][:3] for r in results], ref, each_rank_whole=True)
    for rank_results in results:
        base = rank_results[0]
        assert base[4] == STEPS * N_LAYERS  # the engine answers each block's attention
        assert base[5] == (0, 0)  # eager
        for variant, got in zip(variants, rank_results[1:], strict=True):
            assert got[4] == _AC[variant][2] * STEPS * N_LAYERS, variant
            if _AC[variant][1]:
                graphs, breaks = got[5]
                assert graphs >= 2, variant  # compiled pieces around the eager attention
                assert breaks >= 1, variant
                _assert_close_to(variant, got, base)
            else:
                _assert_bitwise(variant, got, base)
