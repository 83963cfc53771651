"""Expert-parallel token dispatch and grouped experts: time and bytes per step, EP 1/2/4.

PyTorch has no expert parallelism, so the baselines are the two obvious alternatives:

- **dispatch + combine**: hp-cp-ep's all-to-all dispatcher (split sizes exchanged, tokens sent
  only to the ranks holding their experts, outputs returned the same way) against the
  *all-gather-all-tokens* scheme (every rank all-gathers every rank's tokens and routing, runs
  its local experts on the rows routed to them, and a reduce-scatter sums and returns the
  outputs). The experts are the identity here, so only communication and reordering are timed.
  Bytes are those a rank sends per step, counted from the actual split sizes, next to the
  theoretical minimum (the rows routed to experts on other ranks, out and back).
- **grouped experts**: ``GroupedExperts`` forward+backward with ``torch._grouped_mm`` against
  the per-expert loop, on each rank's local experts with the rows dispatch delivers.
- **noise**: the dispatcher timed against itself (the same statistic; reads 1.00 on a quiet
  machine), so the spread of the other ratios on a loaded machine is visible.
- **host syncs**: the operations that would stop the host on an accelerator, per MoE layer
  forward and backward (steady state, counted by :func:`hp_dtensor.testing.count_host_syncs`).

Both alternatives are built in the same processes (gloo, one intra-op thread per rank) and
stepped alternately after a discarded warm-up; each rank takes the median, the slowest rank
counts, the run is repeated with the order swapped and the figure is the geometric mean of the
two ``ours / baseline`` ratios (below 1: ours faster). Routing is the real router's, on random
tokens (mildly uneven). Absolute times only mean something on a quiet machine or a GPU.

Usage::

    python benchmarks/ep_dispatch.py [--steps 10] [--warmup 2] [--ep 1 2 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from hp_cp_ep import ExpertParallel, GroupedExperts, MoE, MoEArgs, TokenDispatcher
from hp_dtensor.testing import count_host_syncs
from hp_kernels import permute_tokens

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common.py is beside it

from _common import cpu_environment, spawn_ranks

EXPERTS, DIM, HIDDEN, TOKENS, TOP_K = 8, 128, 256, 1024, 2


class _Routed:
    """One rank's routed batch: rows grouped by global expert and their counts."""

    def __init__(self, rank: int) -> None:
        torch.manual_seed(0)
        moe = MoE(MoEArgs(num_experts=EXPERTS, top_k=TOP_K), DIM, HIDDEN)
        gen = torch.Generator().manual_seed(1 + rank)
        self.tokens = torch.randn(TOKENS, DIM, generator=gen)
        with torch.no_grad():
            _, self.selected, _ = moe.router(self.tokens)
        self.rows, _, self.counts = permute_tokens(self.tokens, self.selected, EXPERTS)


def _a2a_step(dispatcher: TokenDispatcher, routed: _Routed) -> torch.Tensor:
    dispatched = dispatcher.dispatch(routed.rows, routed.counts)
    return dispatcher.combine(dispatched.wait(), dispatched)


def _allgather_step(routed: _Routed, ep: int, rank: int) -> torch.Tensor:
    """All-gather every rank's tokens and choices, compute local experts' rows, reduce-scatter."""
    tokens = torch.empty(ep * TOKENS, DIM)
    dist.all_gather_into_tensor(tokens, routed.tokens)
    selected = torch.empty(ep * TOKENS, TOP_K, dtype=routed.selected.dtype)
    dist.all_gather_into_tensor(selected, routed.selected.contiguous())
    local = EXPERTS // ep
    mine = (selected >= rank * local) & (selected < (rank + 1) * local)
    token_index = mine.nonzero()[:, 0]
    expert_out = tokens.index_select(0, token_index)  # identity experts
    summed = torch.zeros(ep * TOKENS, DIM).index_add_(0, token_index, expert_out)
    out = torch.empty(TOKENS, DIM)
    dist.reduce_scatter_tensor(out, summed)
    return out


def _bytes_per_step(routed: _Routed, ep: int, rank: int) -> dict[str, int]:
    elem = routed.rows.element_size()
    sent_per_rank = routed.counts.view(ep, EXPERTS // ep).sum(1)
    remote_rows = int(sent_per_rank.sum() - sent_per_rank[rank])
    minimum = 2 * remote_rows * DIM * elem  # out and back
    a2a = minimum + (ep * EXPERTS // ep) * 8  # plus the split-size exchange (int64 counts)
    # all-gather: tokens and choices to ep - 1 peers; reduce-scatter: (ep - 1) / ep of ep*T rows
    gather = (ep - 1) * TOKENS * (DIM * elem + TOP_K * 8)
    scatter = (ep - 1) * TOKENS * DIM * elem
    return {"a2a": a2a, "allgather": gather + scatter, "minimum": minimum}


def _median_times(
    fns: dict[str, Callable[[], Any]], order: list[str], steps: int, warmup: int
) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in order}
    for step in range(warmup + steps):
        for name in order:
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            fns[name]()
            elapsed = time.perf_counter() - t0
            if step >= warmup:
                times[name].append(elapsed)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    if dist.is_initialized():  # the slowest rank counts
        packed = torch.tensor([medians[name] for name in order], dtype=torch.float64)
        dist.all_reduce(packed, op=dist.ReduceOp.MAX)
        medians = dict(zip(order, packed.tolist(), strict=True))
    return medians


def _ratio(
    fns: dict[str, Callable[[], Any]], ours: str, base: str, steps: int, warmup: int
) -> dict[str, float]:
    a = _median_times(fns, [ours, base], steps, warmup)
    b = _median_times(fns, [base, ours], steps, warmup)
    r1, r2 = a[ours] / a[base], b[ours] / b[base]
    return {
        "ratio": math.sqrt(r1 * r2),
        "ours_first": r1,
        "base_first": r2,
        "ours_ms": 1e3 * (a[ours] + b[ours]) / 2,
        "base_ms": 1e3 * (a[base] + b[base]) / 2,
    }


def _experts_fns(local_rows: torch.Tensor, local_counts: torch.Tensor, local: int) -> Any:
    torch.manual_seed(2)
    grouped = GroupedExperts(DIM, HIDDEN, local, use_grouped_mm=True)
    looped = GroupedExperts(DIM, HIDDEN, local, use_grouped_mm=False)
    looped.load_state_dict(grouped.state_dict())
    grad = torch.randn(local_rows.shape[0], DIM)

    def run(experts: GroupedExperts) -> None:
        experts.zero_grad()
        experts.compute(local_rows, local_counts).backward(grad)

    return {"grouped_mm": lambda: run(grouped), "loop": lambda: run(looped)}


def _moe_syncs(ep: int, rank: int) -> dict[str, int]:
    """Host syncs of one MoE layer forward and backward (after a warm-up step), dropless and
    with a capacity factor of 1."""
    counts: dict[str, int] = {}
    for name, capacity in (("", None), ("capacity_", 1.0)):
        torch.manual_seed(0)
        moe = MoE(MoEArgs(num_experts=EXPERTS, top_k=TOP_K, capacity_factor=capacity), DIM, HIDDEN)
        if ep > 1:
            parallelize_module(moe.experts, init_device_mesh("cpu", (ep,)), ExpertParallel())
        x = torch.randn(TOKENS // 4, DIM, generator=torch.Generator().manual_seed(7 + rank))
        moe(x).sum().backward()
        with count_host_syncs() as forward:
            out = moe(x)
        loss = out.sum()
        with count_host_syncs() as backward:
            loss.backward()
        counts[f"{name}forward"] = forward.total
        counts[f"{name}backward"] = backward.total
    return counts


def measure(ep: int, rank: int, steps: int, warmup: int) -> dict[str, Any]:
    routed = _Routed(rank)
    result: dict[str, Any] = {"syncs": _moe_syncs(ep, rank)}
    if ep > 1:
        mesh = init_device_mesh("cpu", (ep,))
        experts = GroupedExperts(DIM, HIDDEN, EXPERTS)
        parallelize_module(experts, mesh, ExpertParallel())
        dispatcher = experts.token_dispatcher
        fns = {
            "a2a": lambda: _a2a_step(dispatcher, routed),
            "allgather": lambda: _allgather_step(routed, ep, rank),
        }
        result["dispatch"] = _ratio(fns, "a2a", "allgather", steps, warmup)
        fns["a2a_again"] = fns["a2a"]
        result["noise"] = _ratio(fns, "a2a", "a2a_again", steps, warmup)
        result["bytes"] = _bytes_per_step(routed, ep, rank)
        dispatched = dispatcher.dispatch(routed.rows, routed.counts)
        local_rows, local_counts = dispatched.wait(), dispatched.num_tokens_per_expert
    else:
        local_rows, local_counts = routed.rows, routed.counts
    result["experts"] = _ratio(
        _experts_fns(local_rows, local_counts, EXPERTS // ep), "grouped_mm", "loop", steps, warmup
    )
    result["local_rows"] = int(local_rows.shape[0])
    return result


def worker(rank: int, ws: int, init_file: str, steps: int, warmup: int, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws)
    try:
        result = measure(ws, rank, steps, warmup)
        if "bytes" in result:  # per rank: report the largest (slowest rank's) traffic
            packed = torch.tensor(list(result["bytes"].values()), dtype=torch.int64)
            dist.all_reduce(packed, op=dist.ReduceOp.MAX)
            result["bytes"] = dict(zip(result["bytes"], packed.tolist(), strict=True))
        if rank == 0:
            Path(out_file).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _table(results: dict[str, Any], steps: int, warmup: int) -> str:
    lines = [
        "# hp-cp-ep expert parallel: dispatch + combine, grouped experts",
        "",
        f"MoE: {EXPERTS} experts, top-{TOP_K}, dim {DIM}, hidden {HIDDEN}, {TOKENS} tokens per "
        f"rank, fp32, real router on random tokens. cpu/gloo, 1 thread per rank, {steps} "
        f"alternating steps per order after {warmup} warm-up, torch {torch.__version__}, "
        f"{os.cpu_count()} CPU cores. Ratio = ours / baseline (below 1: ours faster), geometric "
        "mean of both orders, slowest rank's median. Bytes: sent per rank per step (largest "
        "rank); minimum = rows routed to other ranks' experts, out and back. Noise: the "
        "dispatcher against itself. Host syncs: per MoE layer forward / backward, dropless and "
        "with capacity factor 1 (count_host_syncs; budget 1 / 0 under EP).",
        "",
        "| ep | a2a / all-gather (time) | noise (a2a / a2a) | a2a ms | all-gather ms | a2a MB "
        "| all-gather MB | minimum MB | grouped_mm / loop (fwd+bwd) | grouped ms | loop ms "
        "| local rows | syncs fwd / bwd | capacity syncs fwd / bwd |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ep, res in results["ep"].items():
        ex = res["experts"]
        if "dispatch" in res:
            d, b = res["dispatch"], res["bytes"]
            mb = {key: value / 2**20 for key, value in b.items()}
            comm = (
                f"{d['ratio']:.3f} | {res['noise']['ratio']:.3f} | {d['ours_ms']:.2f} | "
                f"{d['base_ms']:.2f} | {mb['a2a']:.2f} | {mb['allgather']:.2f} | "
                f"{mb['minimum']:.2f}"
            )
        else:
            comm = "- | - | - | - | 0 | 0 | 0"
        sy = res["syncs"]
        lines.append(
            f"| {ep} | {comm} | {ex['ratio']:.3f} | {ex['ours_ms']:.2f} | {ex['base_ms']:.2f} | "
            f"{res['local_rows']} | {sy['forward']} / {sy['backward']} | "
            f"{sy['capacity_forward']} / {sy['capacity_backward']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, Any] = {
        "config": {
            "experts": EXPERTS,
            "top_k": TOP_K,
            "dim": DIM,
            "hidden": HIDDEN,
            "tokens_per_rank": TOKENS,
            "steps": args.steps,
            "warmup": args.warmup,
            **cpu_environment(),
        },
        "ep": {},
    }
    for ep in args.ep:
        if ep == 1:
            results["ep"]["1"] = measure(1, 0, args.steps, args.warmup)
        else:
            results["ep"][str(ep)] = spawn_ranks(worker, ep, args.steps, args.warmup)
        print(f"ep={ep}: {json.dumps(results['ep'][str(ep)])}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ep_dispatch.json").write_text(json.dumps(results, indent=2) + "\n")
    table = _table(results, args.steps, args.warmup)
    (args.out / "ep_dispatch.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
