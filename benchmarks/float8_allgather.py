"""Float8 all-gather in hp-fsdp: bytes per step and step time against a bf16 all-gather (CPU).

A stack of SwiGLU feed-forward blocks is sharded per block plus the root with
``hp_fsdp.fully_shard`` (``MixedPrecisionPolicy(param_dtype=bfloat16)``) in three variants:

- ``bf16``: plain linears, the weights all-gathered in bf16 (2 bytes per element);
- ``float8``: torchao's ``Float8Linear`` (tensorwise) with ``enable_fsdp_float8_all_gather``:
  the weights all-gathered in float8 (1 byte per element), scales precomputed in one
  all-reduce per step (``precompute_float8_dynamic_scale_for_fsdp``);
- ``float8_no_fp8_ag``: the same float8 linears, all-gathered in bf16.

All three live in the same processes and are stepped alternately (forward, backward, AdamW)
after a discarded warm-up; the median per variant is taken on every rank (the slowest rank
counts), the run repeated with the order reversed, and each figure is the geometric mean of
the two ``variant / bf16`` ratios. All-gather and all-reduce bytes per step are counted by a
dispatch mode. On CPU the float8 matmuls are not faster than bf16 (``torch._scaled_mm`` has no
fast CPU kernel): the time ratio here is a report; the throughput claim belongs to
``benchmarks/gpu/float8_check.py``.

Usage::

    python benchmarks/float8_allgather.py [--world 2] [--steps 8] [--warmup 2] [--small]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import hp_fsdp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common.py is beside it

from _common import cpu_environment

DIM, HIDDEN, BLOCKS, TOKENS = 256, 768, 4, 512  # --small: 128, 384, 2, 256
VARIANTS = ("bf16", "float8", "float8_no_fp8_ag")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block() for _ in range(BLOCKS)])
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class _Bytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Collective calls and bytes (all-reduces from c10d and from DTensor alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        namespace, _, op = func._schema.name.partition("::")
        if namespace in ("c10d", "_c10d_functional") and op != "wait_tensor":
            op = {"allreduce_": "all_reduce", "_allgather_base_": "all_gather",
                  "_reduce_scatter_base_": "reduce_scatter"}.get(op, op)  # fmt: skip
            first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            self.calls[op] += 1
            self.bytes[op] += first.numel() * first.element_size()
        return func(*args, **(kwargs or {}))


def _build(variant: str) -> tuple[nn.Module, torch.optim.Optimizer, bool]:
    torch.manual_seed(0)
    model = _Net()
    precompute = False
    if variant != "bf16":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        fp8_ag = variant == "float8"
        convert_to_float8_training(
            model,
            config=Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_ag),
            module_filter_fn=lambda _m, fqn: fqn != "head",
        )
        precompute = fp8_ag
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = hp_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        hp_fsdp.fully_shard(layer, mesh=mesh, mp_policy=mp)
    hp_fsdp.fully_shard(model, mesh=mesh, mp_policy=mp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), precompute


def _step(model: nn.Module, opt: torch.optim.Optimizer, precompute: bool, x: torch.Tensor) -> None:
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    if precompute:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def run(steps: int, warmup: int, reverse: bool, size: tuple[int, int, int, int]) -> dict[str, Any]:
    """One rank's medians, bytes and counts for the three variants (stepped alternately)."""
    global DIM, HIDDEN, BLOCKS, TOKENS
    DIM, HIDDEN, BLOCKS, TOKENS = size  # the workers import this module with the defaults
    torch.set_num_threads(1)
    order = list(reversed(VARIANTS)) if reverse else list(VARIANTS)
    built = {v: _build(v) for v in order}
    x = torch.randn(TOKENS // 8, 8, DIM, generator=torch.Generator().manual_seed(dist.get_rank()))
    times: dict[str, list[float]] = {v: [] for v in order}
    counts: dict[str, Any] = {}
    for i in range(warmup + steps):
        for v in order:
            model, opt, pre = built[v]
            if i == warmup - 1:  # a warm step, counted
                mode = _Bytes()
                with mode:
                    _step(model, opt, pre, x)
                counts[v] = {"calls": dict(mode.calls), "bytes": dict(mode.bytes)}
                continue
            dist.barrier()
            start = time.perf_counter()
            _step(model, opt, pre, x)
            if i >= warmup:
                times[v].append(time.perf_counter() - start)
    medians = torch.tensor([statistics.median(times[v]) for v in VARIANTS], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank counts
    return {"median_s": dict(zip(VARIANTS, medians.tolist(), strict=True)), "counts": counts}


def main() -> None:
    from hp_dtensor.testing import run_distributed, shutdown_pool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="half widths, 2 blocks")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    global DIM, HIDDEN, BLOCKS, TOKENS
    if args.small:
        DIM, HIDDEN, BLOCKS, TOKENS = 128, 384, 2, 256
    if args.warmup < 1:
        raise ValueError(f"--warmup must be >= 1 (one warm step is counted), got {args.warmup}")
    runs = [
        run_distributed(
            run,
            args.world,
            args.steps,
            args.warmup,
            rev,
            (DIM, HIDDEN, BLOCKS, TOKENS),
            timeout=1800,
        )[0]
        for rev in (False, True)
    ]
    shutdown_pool()
    counts = runs[0]["counts"]
    n_fp8 = BLOCKS * 3 * DIM * HIDDEN
    report: dict[str, Any] = {
        "environment": cpu_environment(),
        "model": {"dim": DIM, "hidden": HIDDEN, "blocks": BLOCKS, "tokens_per_rank": TOKENS},
        "world": args.world,
        "steps": args.steps,
        "float8_weight_elements": n_fp8,
        "variants": {},
    }
    for v in VARIANTS:
        ratios = [r["median_s"][v] / r["median_s"]["bf16"] for r in runs]
        report["variants"][v] = {
            "step_time_ratio_vs_bf16": math.sqrt(ratios[0] * ratios[1]),
            "median_s": [r["median_s"][v] for r in runs],
            "collectives_per_step": counts[v]["calls"],
            "bytes_per_step": counts[v]["bytes"],
        }
    ag = {v: report["variants"][v]["bytes_per_step"].get("all_gather", 0) for v in VARIANTS}
    report["all_gather_bytes_ratio_float8_vs_bf16"] = ag["float8"] / ag["bf16"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "float8_allgather.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# Float8 vs bf16 all-gather in hp-fsdp (CPU, gloo, {args.world} ranks, one thread each)",
        "",
        f"{BLOCKS} SwiGLU blocks (dim {DIM}, hidden {HIDDEN}; {n_fp8:,} float8 weight elements), "
        f"{TOKENS} tokens per rank, bf16 parameters; {args.steps} timed steps after "
        f"{args.warmup} warm-up, both orders. Times on CPU are a report (no fast float8 kernel).",
        "",
        "| variant | all-gather bytes/step | vs bf16 | all-reduce bytes/step | "
        "collectives/step (AG/RS/AR) | step time vs bf16 |",
        "|---|---|---|---|---|---|",
    ]
    for v in VARIANTS:
        e = report["variants"][v]
        b, c = e["bytes_per_step"], e["collectives_per_step"]
        lines.append(
            f"| {v} | {b.get('all_gather', 0):,} | {b.get('all_gather', 0) / ag['bf16']:.3f} | "
            f"{b.get('all_reduce', 0):,} | {c.get('all_gather', 0)}/{c.get('reduce_scatter', 0)}/"
            f"{c.get('all_reduce', 0)} | {e['step_time_ratio_vs_bf16']:.3f} |"
        )
    lines.append("")
    (args.out / "float8_allgather.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
