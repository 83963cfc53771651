"""NCCL's point-to-point rules: the model, the validator, and traces replayed from real runs."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hp_pp
from hp_dtensor.testing import run_distributed
from hp_pp import generators
from hp_pp.p2p_model import P2POp, Post, Wait, program_from_json, program_to_json, replay
from hp_pp.transport import defer_receives

DIM = 8
_DATA = Path(__file__).with_name("data") / "legacy_p2p_traces.json"


def _op(kind: str, peer: int, mb: int, what: str = "F") -> P2POp:
    return P2POp(kind, peer, (0, mb, what, "data0"), (2, 2), "torch.float32")


def test_model_rendezvous_fifo_and_batches() -> None:
    # Both ranks send first, each on its own, then receive: under rendezvous neither send
    # completes (the receives sit behind them on the pair's stream).
    lone = {
        0: [Post(0, (_op("send", 1, 0),)), Post(1, (_op("recv", 1, 1, "B"),)), Wait(1)],
        1: [Post(0, (_op("send", 0, 1, "B"),)), Post(1, (_op("recv", 0, 0),)), Wait(1)],
    }
    report = replay(lone)
    assert report.deadlocked
    (text,) = report.problems
    assert "rank 0, pair (0, 1), waits on recv B(stage 0, mb 1, data0), posted behind its own " in (
        text
    )
    assert "send F(stage 0, mb 0, data0) with rank 1" in text
    # The same operations posted together progress together.
    batched = {
        0: [Post(0, (_op("send", 1, 0), _op("recv", 1, 1, "B"))), Wait(0)],
        1: [Post(0, (_op("send", 0, 1, "B"), _op("recv", 0, 0))), Wait(0)],
    }
    assert replay(batched).ok
    # Tags are ignored: receives posted in another order than the sends get the wrong tensor.
    swapped = {
        0: [Post(0, (_op("send", 1, 0), _op("send", 1, 1))), Wait(0)],
        1: [Post(0, (_op("recv", 0, 1), _op("recv", 0, 0))), Wait(0)],
    }
    problems = replay(swapped).problems
    assert any(
        "rank 1, pair (0, 1): recv F(stage 0, mb 1, data0) would get rank 0's send F(stage 0, "
        "mb 0, data0)" in p
        for p in problems
    )
    # A send nobody receives is named.
    orphan = {0: [Post(0, (_op("send", 1, 0),))], 1: []}
    assert any("is never received by rank 1" in p for p in replay(orphan).problems)
    # Programs survive a JSON round trip.
    assert program_from_json(program_to_json(lone[0])) == lone[0]


def test_traces_recorded_before_the_fix_fail_the_model() -> None:
    """Mutation check: the transfers the executor posted before batching (each isend/irecv on
    its own, receives in consumption order; recorded from 2-rank gloo runs) hang or swap
    tensors under NCCL's rules: GPipe, 1F1B, Interleaved 1F1B and DualPipeV deadlock, ZBV
    receives a same-shape tensor of another micro-batch."""
    traces = json.loads(_DATA.read_text())
    verdicts = {}
    for key, per_rank in traces.items():
        report = replay({int(r): program_from_json(p) for r, p in per_rank.items()})
        verdicts[key] = report
        assert not report.ok, key
    assert verdicts["GPipe/ws2/step1"].deadlocked
    assert verdicts["1F1B/ws2/step1"].deadlocked
    assert verdicts["Interleaved1F1B/ws2/step1"].deadlocked
    assert verdicts["DualPipeV/ws2/step1"].deadlocked
    assert any(
        "would get rank 0's send F" in p for p in verdicts["ZBVZeroBubble/ws2/step1"].problems
    )


def _record(names: list[str], n_mb: int, steps: int = 2) -> dict[str, list[Any]]:
    """Run each schedule and return this rank's recorded program of every step."""
    ws = dist.get_world_size()
    rank = dist.get_rank()
    out: dict[str, list[Any]] = {}
    for name in names:
        style = generators.STYLE[name]
        num_stages = ws * (1 if name in ("GPipe", "1F1B") else 2)
        torch.manual_seed(0)
        mods = [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(num_stages)]
        idx = generators.rank_to_stages(rank, ws, num_stages, style)
        stages = [hp_pp.PipelineStage(mods[s], s, num_stages, torch.device("cpu")) for s in idx]
        cls = hp_pp.get_schedule_class(name)
        loss = nn.functional.mse_loss
        sched = (
            cls(stages[0], n_mb, loss_fn=loss)
            if name in ("GPipe", "1F1B")
            else cls(stages, n_mb, loss_fn=loss)
        )
        out[name] = []
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(2 * n_mb, DIM, generator=g), torch.randn(2 * n_mb, DIM, generator=g)
            sched.step(*((x,) if 0 in idx else ()), target=y if num_stages - 1 in idx else None)
            out[name].append(program_to_json(sched.executor.trace))
    return out


_ALL = [
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
]


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_recorded_traces_of_every_schedule_pass_the_model(ws: int) -> None:
    names = list(_ALL)
    per_rank = run_distributed(_record, ws, names, 2 * ws, timeout=120)
    for name in names:
        for step in range(2):
            programs = {r: program_from_json(per_rank[r][name][step]) for r in range(ws)}
            report = replay(programs)
            assert report.ok, (name, ws, step, report.problems)
            # Something moved, and the first step carries one description per boundary more.
            assert report.matched > 0
    # The first step carries the stage descriptions (meta) and later steps do not.
    first = [op for p in per_rank[0]["1F1B"][0] if "post" in p for op in p["ops"]]
    later = [op for p in per_rank[0]["1F1B"][1] if "post" in p for op in p["ops"]]
    assert any(op["ident"][3] == "meta" for op in first)
    assert not any(op["ident"][3] == "meta" for op in later)


def _record_mpipe() -> list[Any]:
    load = __import__("hp_dtensor.testing", fromlist=["load_test_module"]).load_test_module
    mpipe = load(Path(__file__).with_name("test_runtime_mpipe.py"), "hp_pp_tests_mpipe")
    rank = dist.get_rank()
    mods = mpipe._modules(True)
    indices = [rank, rank + 2]
    stages = [hp_pp.PipelineStage(mods[s], s, 4, torch.device("cpu")) for s in indices]
    copy = None if rank == 0 else mpipe.CountingPre()
    sched = hp_pp.ScheduleMPipe(
        stages, 4, loss_fn=nn.functional.mse_loss, preprocess_fqn="pre", preprocess=copy
    )
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(8, mpipe.DIM, generator=g), torch.randn(8, mpipe.DIM, generator=g)
    traces = []
    for _ in range(2):
        sched.step(x, target=y if rank == 1 else None)
        traces.append(program_to_json(sched.executor.trace))
    return traces


def test_mpipe_trace_passes_the_model_and_ships_tensors() -> None:
    per_rank = run_distributed(_record_mpipe, 2)
    for step in range(2):
        report = replay({r: program_from_json(per_rank[r][step]) for r in range(2)})
        assert report.ok, report.problems
    # The preprocess output travels as a tensor of its own shape (no pickled bytes).
    shipped = [
        op
        for p in per_rank[1][1]
        if "post" in p
        for op in p["ops"]
        if op["ident"][2] == "PRE" and op["kind"] == "send"
    ]
    assert shipped
    assert all(op["dtype"] == "torch.float32" for op in shipped)


def _record_fsdp() -> list[Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import hp_fsdp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
    hp_fsdp.fully_shard(mod, mesh=mesh["dp"])
    stage = hp_pp.PipelineStage(mod, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    sched = hp_pp.Schedule1F1B(stage, 4, loss_fn=nn.functional.mse_loss)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(8, DIM, generator=g), torch.randn(8, DIM, generator=g)
    sched.step(*((x,) if pp_rank == 0 else ()), target=y if pp_rank == 1 else None)
    return program_to_json(sched.executor.trace)


def test_fsdp_inside_stages_trace_passes_the_model() -> None:
    per_rank = run_distributed(_record_fsdp, 4)
    report = replay({r: program_from_json(p) for r, p in enumerate(per_rank)})
    assert report.ok, report.problems
    assert report.matched > 0


# Interleaved 1F1B on 2 ranks, 4 micro-batches, with every receive moved to just before the
# compute that consumes it: the sends-never-block simulation accepts it, NCCL hangs on it.
def _deferred_csv() -> str:
    table = generators.generate("Interleaved1F1B", pp_size=2, num_stages=4, n_microbatches=4)
    lowered = hp_pp.add_communication(table, num_stages=4, style="loop")
    buffer = io.StringIO()
    hp_pp.write_schedule_csv(defer_receives(lowered), buffer)
    return buffer.getvalue()


def test_a_csv_table_that_hangs_on_nccl_is_refused_naming_rank_pair_and_operations() -> None:
    table = hp_pp.read_schedule_csv(io.StringIO(_deferred_csv()))
    report = hp_pp.validate_schedule(table, num_stages=4, n_microbatches=4, style="loop")
    assert report.deadlocked
    (text,) = [p for p in report.problems if p.startswith("NCCL deadlock")]
    assert "rank 0, pair (0, 1), waits on " in text
    assert "posted behind its own send" in text or "whose partner on rank 1 is" in text
    with pytest.raises(ValueError, match=r"NCCL deadlock: rank 0, pair \(0, 1\)"):
        hp_pp.check_schedule(table, num_stages=4, n_microbatches=4, style="loop")
