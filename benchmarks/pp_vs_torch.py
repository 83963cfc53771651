"""Time a pipeline-parallel training step with hp-pp against torch.distributed.pipelining.

A small decoder (embedding, blocks, norm, head) is split into stages with
``hp_pp.generate_llm_fqn_per_model_part`` / ``hp_pp.split_module_by_fqns``; the same stage
modules (deep copies) run under hp-pp's schedule class and torch's class of the same name on
2 pipeline ranks (1 stage per rank for GPipe/1F1B, 2 for the others) with 8 micro-batches. Both
live in the same processes (gloo, one intra-op thread per rank) and are stepped alternately
(schedule step, SGD) after a discarded warm-up; a step's time is its slowest rank's; the call
order alternates every step and the run is repeated with the build order swapped
(``--repeats`` times each). The figure is the median over all
timed steps of ``ours / torch`` of the same step (below 1: ours is faster), with its
quartiles beside it. A ``torch vs torch`` row shows the noise floor: on a loaded machine, a
ratio inside that row's quartiles is not a difference.

Peak tensor memory per rank (bytes of tensors allocated during one step and alive at once,
tracked at the dispatcher) is measured over one step of each, stepped as the trainer steps
(``return_outputs=False``); the last-stage column is the rank holding the last stage (which
kept every micro-batch's logits before hp-pp 0.1.3). The
simulator (``hp_pp.simulate_schedule``) predicts ours from costs profiled on the real stages
(forward, backward-input, backward-weight and full backward of one micro-batch, and one
activation transfer), and the prediction error against the measured median is reported.

Zero-bubble rows also report the FLOPs of one step's backward actions (``FlopCounterMode``
around every backward-input ``I``, backward-weight ``W`` and full backward ``B``, summed over
ranks, ours and torch's), against the FLOPs of one full backward of every stage per
micro-batch: with a real weight pass, ``I + W + B`` is one full backward per micro-batch.
The ``A / B (ours, same model)`` rows time two of our schedules against each other on the same
stages (ZBV against 1F1B, Interleaved zero bubble against Interleaved 1F1B), with an
``1F1B / 1F1B`` row as their noise floor.

Usage::

    python benchmarks/pp_vs_torch.py [--steps 6] [--warmup 2] [--repeats 1] [--rows ...]
        [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining as tpp
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

import hp_pp
from hp_pp import generators

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common.py is beside it

from _common import Block

VOCAB, DIM, HEADS, SEQ, MB_ROWS, BLOCKS, N_MB = 512, 96, 4, 32, 2, 4, 8

ROWS: dict[str, dict[str, Any]] = {
    name: {"schedule": name}
    for name in (
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "LoopedBFS",
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
        "DualPipeV",
    )
}
ROWS["torch vs torch 1F1B (noise floor)"] = {"schedule": "1F1B", "control": True}
# Our schedules against each other on the same model (the "torch" side runs ``versus``).
# They split with the embedding weighted 0 (a lookup: no FLOPs); the default weight 1 gives the
# embedding a stage of its own, and V placement's two ranks then hold 1 and 2 blocks' work.
ROWS["ZBVZeroBubble / 1F1B (ours, same model)"] = {
    "schedule": "ZBVZeroBubble",
    "versus": "1F1B",
    "input_weight": 0,
}
ROWS["InterleavedZeroBubble / Interleaved1F1B (ours, same model)"] = {
    "schedule": "InterleavedZeroBubble",
    "versus": "Interleaved1F1B",
    "input_weight": 0,
}
ROWS["1F1B / 1F1B (ours, noise floor)"] = {"schedule": "1F1B", "versus": "1F1B", "input_weight": 0}
_ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")

_TORCH_CLASS = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "LoopedBFS": "ScheduleLoopedBFS",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block(DIM, HEADS) for i in range(BLOCKS)})
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (MB_ROWS * N_MB, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _layout(name: str, input_weight: int = 1) -> tuple[int, str, list[int], list[list[str]]]:
    ws = dist.get_world_size()
    per_rank = 1 if name in ("GPipe", "1F1B") else 2
    num_stages = ws * per_rank
    style = generators.STYLE[name]
    fqns = hp_pp.generate_llm_fqn_per_model_part(num_stages, BLOCKS, input_weight=input_weight)
    indices = generators.rank_to_stages(dist.get_rank(), ws, num_stages, style)
    return num_stages, style, indices, fqns


def _build(
    impl: str, name: str, base: Decoder, input_weight: int = 1
) -> tuple[list[nn.Module], Callable[[int], None], Any]:
    num_stages, _, indices, fqns = _layout(name, input_weight)
    mods = [hp_pp.split_module_by_fqns(base, fqns[s]) for s in indices]
    cpu = torch.device("cpu")
    if impl == "torch":
        stages: list[Any] = [
            tpp.PipelineStage(m, s, num_stages, cpu) for m, s in zip(mods, indices, strict=True)
        ]
        cls: Any = getattr(tpp, _TORCH_CLASS[name])
    else:
        stages = [
            hp_pp.PipelineStage(m, s, num_stages, cpu) for m, s in zip(mods, indices, strict=True)
        ]
        cls = hp_pp.get_schedule_class(name)
    single = name in ("GPipe", "1F1B")
    sched = cls(stages[0] if single else stages, N_MB, loss_fn=loss_fn)
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=1e-3)
    first, last = 0 in indices, num_stages - 1 in indices

    def step(i: int) -> None:
        tokens, target = _batch(i)
        args = (tokens,) if first else ()
        # As the trainer steps: the last stage's outputs are not returned, so not kept.
        sched.step(*args, target=target if last else None, return_outputs=False)
        opt.step()
        opt.zero_grad()

    return mods, step, sched


class LiveTensorBytes(TorchDispatchMode):
    """Tensor-level memory: bytes of storages created under the mode and still alive, and
    their peak (MemTracker refuses modules called once per micro-batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._seen:
                continue
            self._seen.add(key)
            nbytes = storage.nbytes()
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, nbytes)
        return out


def _peak_bytes(step: Callable[[int], None], i: int, sched: Any = None) -> int:
    with LiveTensorBytes() as tracker:
        step(i)
    return tracker.peak + _persistent_recv_bytes(sched)


def _persistent_recv_bytes(sched: Any) -> int:
    """Bytes of the receive buffers torch's stages allocate once and reuse every step: alive
    during the step, but not created under the tracker (hp-pp allocates per step, counted)."""
    stages = getattr(sched, "_stages", None) or [getattr(sched, "_stage", None)]
    seen: set[int] = set()
    total = 0
    for stage in stages:
        for infos in [
            *getattr(stage, "args_recv_info", {}).values(),
            *getattr(stage, "grad_recv_info", {}).values(),
        ]:
            for info in infos:
                buffer = getattr(info, "buffer", None)
                if isinstance(buffer, torch.Tensor):
                    storage = buffer.untyped_storage()
                    if id(storage) not in seen:
                        seen.add(id(storage))
                        total += storage.nbytes()
    return total


def _timed(fn: Callable[[], Any], repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _profile_costs(name: str, base: Decoder) -> dict[str, Any]:
    """Per-stage F/I/W/B times of one micro-batch (ms) on this rank, and one transfer."""
    num_stages, _, indices, fqns = _layout(name)
    tokens, target = _batch(0)
    tokens, target = tokens[:MB_ROWS], target[:MB_ROWS]
    hidden = torch.randn(MB_ROWS, SEQ, DIM)
    costs: dict[int, dict[str, float]] = {}
    for s in indices:
        mod = hp_pp.split_module_by_fqns(base, fqns[s])
        params = list(mod.parameters())

        def forward(mod: nn.Module = mod, s: int = s) -> tuple[torch.Tensor, torch.Tensor]:
            x = tokens if s == 0 else hidden.clone().requires_grad_()
            out = mod(x)
            root = loss_fn(out, target) if s == num_stages - 1 else out.sum()
            return root, x

        def full(forward: Any = forward) -> None:
            root, _ = forward()
            root.backward()

        def input_only(forward: Any = forward, s: int = s) -> None:
            root, x = forward()
            if s > 0:
                torch.autograd.grad(root, [x])

        def input_then_weight(forward: Any = forward, s: int = s, params: Any = params) -> None:
            root, x = forward()
            if s > 0:
                torch.autograd.grad(root, [x], retain_graph=True)
            torch.autograd.backward(root, inputs=params)

        f = _timed(forward)
        b = _timed(full) - f
        i = _timed(input_only) - f
        iw = _timed(input_then_weight) - f
        costs[s] = {
            "forward": 1e3 * f,
            # A loaded machine can time the difference below zero.
            "full_backward": 1e3 * max(b, 0.0),
            "backward_input": 1e3 * max(i, 0.0),
            "backward_weight": 1e3 * max(iw - i, 0.0),
        }
        mod.zero_grad()
    # One activation transfer (rank 0 -> 1 and back): half a round trip.
    buf = torch.randn(MB_ROWS, SEQ, DIM)
    peer = 1 - dist.get_rank() if dist.get_world_size() == 2 else None

    def round_trip() -> None:
        if peer is None:
            return
        if dist.get_rank() == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)

    dist.barrier()
    transfer = _timed(round_trip) / 2
    return {"stages": costs, "transfer_ms": 1e3 * transfer}


def _predict(name: str, profiles: list[dict[str, Any]]) -> float:
    """The simulator's step time (s) from the profiled costs of every rank."""
    per_stage: dict[int, hp_pp.StageCosts] = {}
    for prof in profiles:
        for s, c in prof["stages"].items():
            per_stage[int(s)] = hp_pp.StageCosts(
                forward=c["forward"],
                backward_input=c["backward_input"],
                backward_weight=c["backward_weight"],
                full_backward=c["full_backward"],
            )
    transfer = max(p["transfer_ms"] for p in profiles)
    ws = len(profiles)
    per_rank = 1 if name in ("GPipe", "1F1B") else 2
    table = generators.generate(name, pp_size=ws, num_stages=ws * per_rank, n_microbatches=N_MB)
    costs = hp_pp.PipelineCosts(per_stage=per_stage, transfer=transfer)
    return hp_pp.simulate_schedule(table, costs).step_time / 1e3


def _count_backward_flops(sched: Any, step: Callable[[int], None], i: int) -> dict[str, int]:
    """FLOPs of one step's I, W and B actions on this rank (both runtimes' stages have
    ``backward_one_chunk(mb, loss, full_backward, ...)`` and ``backward_weight_one_chunk``)."""
    stages = getattr(sched, "_stages", None) or [sched._stage]
    counts = {"I": 0, "W": 0, "B": 0}
    saved = []
    for stage in stages:
        backward, weight = stage.backward_one_chunk, stage.backward_weight_one_chunk

        def b(*args: Any, backward: Any = backward, **kwargs: Any) -> Any:
            full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
            with FlopCounterMode(display=False) as counter:
                out = backward(*args, **kwargs)
            counts["B" if full else "I"] += counter.get_total_flops()
            return out

        def w(*args: Any, weight: Any = weight, **kwargs: Any) -> Any:
            with FlopCounterMode(display=False) as counter:
                out = weight(*args, **kwargs)
            counts["W"] += counter.get_total_flops()
            return out

        saved.append((stage, backward, weight))
        stage.backward_one_chunk, stage.backward_weight_one_chunk = b, w
    try:
        step(i)
    finally:
        for stage, backward, weight in saved:
            stage.backward_one_chunk, stage.backward_weight_one_chunk = backward, weight
    return counts


def _full_backward_flops(name: str, mods: list[nn.Module]) -> int:
    """FLOPs of one full backward of this rank's stages, for all micro-batches of a step."""
    num_stages, _, indices, _ = _layout(name)
    tokens, target = _batch(0)
    tokens, target = tokens[:MB_ROWS], target[:MB_ROWS]
    total = 0
    for mod, s in zip(mods, indices, strict=True):
        x = tokens if s == 0 else torch.randn(MB_ROWS, SEQ, DIM, requires_grad=True)
        out = mod(x)
        root = loss_fn(out, target) if s == num_stages - 1 else out
        grad = None if s == num_stages - 1 else torch.ones_like(out)
        with FlopCounterMode(display=False) as counter:
            torch.autograd.backward(root, grad)
        total += N_MB * counter.get_total_flops()
        mod.zero_grad()
    return total


def _stage_flops(
    name: str, mods: list[nn.Module], input_weight: int
) -> dict[int, dict[str, float]]:
    """GFLOP of F, I, W and B of one micro-batch for each of this rank's stages (I and W by
    hp-pp's split backward), for the simulator's FLOP-proportional prediction."""
    from hp_pp._backward import backward_input

    num_stages, _, indices, _ = _layout(name, input_weight)
    tokens, target = _batch(0)
    tokens, target = tokens[:MB_ROWS], target[:MB_ROWS]
    out: dict[int, dict[str, float]] = {}
    for mod, s in zip(mods, indices, strict=True):
        costs: dict[str, float] = {}
        for kind in ("full", "split"):
            x = tokens if s == 0 else torch.randn(MB_ROWS, SEQ, DIM, requires_grad=True)
            with FlopCounterMode(display=False) as counter:
                y = mod(x)
            costs["forward"] = counter.get_total_flops() / 1e9
            root = loss_fn(y, target) if s == num_stages - 1 else y
            grad = None if s == num_stages - 1 else torch.ones_like(y)
            with FlopCounterMode(display=False) as counter:
                if kind == "full":
                    torch.autograd.backward(root, grad)
                else:
                    _, weight_pass = backward_input([root], [grad], [x] if s else [])
            if kind == "full":
                costs["full_backward"] = counter.get_total_flops() / 1e9
            else:
                costs["backward_input"] = counter.get_total_flops() / 1e9
                with FlopCounterMode(display=False) as counter:
                    weight_pass.run()
                costs["backward_weight"] = counter.get_total_flops() / 1e9
            mod.zero_grad()
        out[s] = costs
    return out


def _flop_step(name: str, per_stage: dict[int, dict[str, float]], *, rewalk: bool) -> float:
    """The simulator's step time when every action costs its FLOPs (transfers free);
    ``rewalk``: with the weight pass costing a full backward, as before the split."""
    per_rank = 1 if name in ("GPipe", "1F1B") else 2
    table = generators.generate(name, pp_size=2, num_stages=2 * per_rank, n_microbatches=N_MB)
    stage_costs = {
        s: hp_pp.StageCosts(**(c | {"backward_weight": c["full_backward"]} if rewalk else c))
        for s, c in per_stage.items()
    }
    costs = hp_pp.PipelineCosts(per_stage=stage_costs, transfer=0.0)
    return hp_pp.simulate_schedule(table, costs).step_time


def run_row(row: dict[str, Any], steps: int, warmup: int, ours_first: bool) -> dict[str, Any]:
    """One build order of one row, on every rank; returns this rank's step times and peaks.

    The call order alternates every step, so neither implementation always runs right after
    the other (a fixed order showed up as a few percent either way on a loaded machine).
    """
    torch.manual_seed(0)
    base = Decoder()
    name = row["schedule"]
    control = bool(row.get("control"))
    order = ["ours", "torch"] if ours_first else ["torch", "ours"]
    versus = row.get("versus")
    if versus is not None:  # two of our schedules: "ours" runs ``schedule``, "torch" ``versus``
        built = {
            key: _build(
                "ours", name if key == "ours" else versus, copy.deepcopy(base), row["input_weight"]
            )
            for key in order
        }
    else:
        built = {
            key: _build(
                "torch" if (key == "torch" or control) else "ours", name, copy.deepcopy(base)
            )
            for key in order
        }
    times: dict[str, list[float]] = {key: [] for key in order}
    for i in range(warmup + steps):
        for key in order if i % 2 == 0 else order[::-1]:
            dist.barrier()
            start = time.perf_counter()
            built[key][1](i)
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times[key].append(elapsed)
    result: dict[str, Any] = {key: statistics.median(ts) for key, ts in times.items()}
    result.update({f"{key}_steps": ts for key, ts in times.items()})
    for key in order:
        step = built[key][1]
        result[f"{key}_peak"] = _peak_bytes(step, warmup + steps, built[key][2])
    num_stages, _, indices, _ = _layout(name)
    result["holds_last"] = num_stages - 1 in indices
    if ours_first and not control and versus is None:
        result["profile"] = _profile_costs(name, base)
    if ours_first and versus is not None:
        result["stage_gflop"] = {
            "ours": _stage_flops(name, built["ours"][0], row["input_weight"]),
            "torch": _stage_flops(versus, built["torch"][0], row["input_weight"]),
        }
    if ours_first and name in _ZERO_BUBBLE and versus is None:
        i = warmup + steps + 1
        result["flops"] = {
            key: _count_backward_flops(built[key][2], built[key][1], i) for key in order
        }
        result["flops"]["full_backward"] = _full_backward_flops(name, built["ours"][0])
    return result


def _range(entry: dict[str, Any]) -> str:
    if "step_time_ratio_quartiles" not in entry:
        return "(ratio of medians, one run per order)"
    low, high = entry["step_time_ratio_quartiles"]
    return f"[{low:.2f}-{high:.2f}]"


def main() -> None:
    from hp_dtensor.testing import run_distributed, shutdown_pool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each build order")
    parser.add_argument("--rows", nargs="*", default=list(ROWS))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    report: dict[str, Any] = {
        "model": {
            "vocab": VOCAB,
            "dim": DIM,
            "blocks": BLOCKS,
            "seq": SEQ,
            "microbatch_rows": MB_ROWS,
            "n_microbatches": N_MB,
            "pp": 2,
        },
        "steps": args.steps,
        "warmup": args.warmup,
        "rows": {},
    }
    previous = args.out / "pp_vs_torch.json"
    if set(args.rows) != set(ROWS) and previous.exists():  # a partial rerun updates its rows
        report["rows"] = json.loads(previous.read_text()).get("rows", {})
    for name in args.rows:
        row = ROWS[name]
        orders = []
        # ours / torch of the same step (the slowest rank of each): adjacent steps see the same
        # load, so the median of these pairs is far steadier than a ratio of medians.
        paired: list[float] = []
        profiles: list[dict[str, Any]] = []
        flops: dict[str, Any] | None = None
        gflop: dict[str, Any] = {}
        for ours_first in (True, False) * args.repeats:
            per_rank = run_distributed(
                run_row, 2, row, args.steps, args.warmup, ours_first, timeout=600
            )
            orders.append(
                {
                    "ours": max(r["ours"] for r in per_rank),
                    "torch": max(r["torch"] for r in per_rank),
                    "ours_peak": max(r["ours_peak"] for r in per_rank),
                    "torch_peak": max(r["torch_peak"] for r in per_rank),
                    "ours_last_peak": next(r["ours_peak"] for r in per_rank if r["holds_last"]),
                    "torch_last_peak": next(r["torch_peak"] for r in per_rank if r["holds_last"]),
                }
            )
            ours_steps = [max(s) for s in zip(*(r["ours_steps"] for r in per_rank), strict=True)]
            torch_steps = [max(s) for s in zip(*(r["torch_steps"] for r in per_rank), strict=True)]
            paired += [o / t for o, t in zip(ours_steps, torch_steps, strict=True)]
            if ours_first and not row.get("control") and not profiles and "versus" not in row:
                profiles = [r["profile"] for r in per_rank]
            if ours_first and "stage_gflop" in per_rank[0]:
                gflop = {
                    key: {int(st): c for r in per_rank for st, c in r["stage_gflop"][key].items()}
                    for key in ("ours", "torch")
                }
            if ours_first and "flops" in per_rank[0]:
                flops = {
                    key: (
                        sum(r["flops"][key] for r in per_rank)
                        if key == "full_backward"
                        else {k: sum(r["flops"][key][k] for r in per_rank) for k in "IWB"}
                    )
                    for key in per_rank[0]["flops"]
                }
        time_ratios = [o["ours"] / o["torch"] for o in orders]
        mem_ratios = [o["ours_peak"] / o["torch_peak"] for o in orders]
        entry: dict[str, Any] = {
            "step_time_ratio": statistics.median(paired),
            "step_time_ratio_quartiles": statistics.quantiles(paired, n=4)[::2],
            "ratio_of_medians_per_run": time_ratios,
            "peak_memory_ratio": statistics.geometric_mean(mem_ratios),
            # The rank of the last stage (it held every micro-batch's logits before).
            "last_stage_peak_memory_ratio": statistics.geometric_mean(
                o["ours_last_peak"] / o["torch_last_peak"] for o in orders
            ),
            "ours_median_s": [o["ours"] for o in orders],
            "torch_median_s": [o["torch"] for o in orders],
            "ours_peak_bytes": orders[0]["ours_peak"],
            "torch_peak_bytes": orders[0]["torch_peak"],
            # Other jobs on the machine make the figures noisy: the noise-floor row shows how much.
            "load_average_1min": os.getloadavg()[0],
        }
        if gflop:
            # The same two tables on hardware where time follows FLOPs (a GPU at scale).
            for key, rewalk in (("flop_simulated_ratio", False), ("rewalk_simulated_ratio", True)):
                a = _flop_step(row["schedule"], gflop["ours"], rewalk=rewalk)
                entry[key] = a / _flop_step(row["versus"], gflop["torch"], rewalk=rewalk)
        if flops is not None:
            full = flops["full_backward"]
            entry["backward_flops_per_step"] = flops
            entry["backward_flops_vs_full"] = {
                key: {k: flops[key][k] / full for k in "IWB"}
                | {"total": sum(flops[key].values()) / full}
                for key in ("ours", "torch")
            }
        if profiles:
            predicted = _predict(row["schedule"], profiles)
            measured = statistics.median(o["ours"] for o in orders)
            entry["simulated_step_s"] = predicted
            entry["simulation_error"] = predicted / measured - 1
        report["rows"][name] = entry
        sim = entry.get("simulation_error")
        print(
            f"{name}: time {entry['step_time_ratio']:.3f}, memory {entry['peak_memory_ratio']:.3f}"
            f" (last stage {entry['last_stage_peak_memory_ratio']:.3f})"
            + ("" if sim is None else f", simulator error {100 * sim:+.0f}%"),
            flush=True,
        )
    shutdown_pool()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pp_vs_torch.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# hp-pp vs torch.distributed.pipelining (CPU, gloo, one thread per rank)",
        "",
        f"Decoder: vocab {VOCAB}, dim {DIM}, {BLOCKS} blocks, seq {SEQ}; 2 pipeline ranks, "
        f"{N_MB} micro-batches of {MB_ROWS} rows; {args.steps} timed steps after "
        f"{args.warmup} warm-up, call order alternating, both build orders, "
        f"{args.repeats} run(s) of each (step time: median of the per-step ratios, quartiles in "
        "brackets). Simulator: step time predicted from costs profiled on the real stages "
        "(error = predicted / measured - 1).",
        "",
        "| schedule | step time ours/torch [quartiles] | peak tensor memory ours/torch | "
        "last stage peak ours/torch | ours median (s) | simulated (s) | simulator error | "
        "load average |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ROWS:
        entry = report["rows"].get(name)
        if entry is None:
            continue
        sim = entry.get("simulated_step_s")
        err = entry.get("simulation_error")
        lines.append(
            f"| {name} | {entry['step_time_ratio']:.3f} {_range(entry)} | "
            f"{entry['peak_memory_ratio']:.3f} | "
            f"{entry.get('last_stage_peak_memory_ratio', float('nan')):.3f} | "
            f"{statistics.median(entry['ours_median_s']):.4f} | "
            + ("-" if sim is None else f"{sim:.4f}")
            + " | "
            + ("-" if err is None else f"{100 * err:+.0f}%")
            + f" | {entry.get('load_average_1min', float('nan')):.1f} |"
        )
    lines += [
        "",
        "Rows `A / B (ours, same model)`: step time of our schedule A over our schedule B on the"
        " same stages (the `1F1B / 1F1B` row is their noise floor); the memory column is A's"
        " peak over B's. On this CPU toy a step is mostly per-action overhead (A has twice the"
        " stages and splits its backwards), so the simulator's ratio of the same two tables"
        " with every action costing its FLOPs (transfers free: time following compute, as on a"
        " GPU at scale) is given too, and the same with W costing a full backward (the weight"
        " pass before the split re-walked the graph):",
        "",
        "| A / B | measured [quartiles] | simulated from FLOPs | same, W re-walking |",
        "|---|---|---|---|",
    ]
    for name in ROWS:
        entry = report["rows"].get(name)
        if entry is None or "flop_simulated_ratio" not in entry:
            continue
        lines.append(
            f"| {name} | {entry['step_time_ratio']:.3f} {_range(entry)} | "
            f"{entry['flop_simulated_ratio']:.3f} | {entry['rewalk_simulated_ratio']:.3f} |"
        )
    lines += [
        "",
        "Zero-bubble backward FLOPs per step (all ranks; `FlopCounterMode` around each I, W and"
        " B action), as a fraction of one full backward of every stage per micro-batch:",
        "",
        "| schedule | I | W | B | I + W + B | torch's I + W + B | full backward (GFLOP) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ROWS:
        entry = report["rows"].get(name)
        if entry is None or "backward_flops_vs_full" not in entry:
            continue
        ours = entry["backward_flops_vs_full"]["ours"]
        theirs = entry["backward_flops_vs_full"]["torch"]
        full = entry["backward_flops_per_step"]["full_backward"]
        lines.append(
            f"| {name} | {ours['I']:.3f} | {ours['W']:.3f} | {ours['B']:.3f} | "
            f"{ours['total']:.3f} | {theirs['total']:.3f} | {full / 1e9:.3f} |"
        )
    lines.append("")
    (args.out / "pp_vs_torch.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
