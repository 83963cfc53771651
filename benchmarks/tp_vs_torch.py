"""Time a tensor-parallel training step with hp-tp against torch.distributed.tensor.parallel.

A small decoder-only transformer is parallelized with the same TP + sequence-parallel plan
(embedding row-wise, norms sequence-parallel, attention/MLP column-then-row-wise, vocabulary-
parallel head with ``loss_parallel``) once with ``hp_tp`` and once with PyTorch's styles. Both
copies live in the same processes (gloo, one intra-op thread per rank) and are stepped
alternately (forward, ``loss_parallel`` cross-entropy, backward, SGD) after a discarded warm-up.
The per-rank median of each implementation is taken (the slowest rank counts), the run is
repeated with the build and call order swapped, and the figure is the geometric mean of the two
``ours / torch`` ratios (below 1 means ours is faster); the same figure is given for the CPU time
the ranks' processes spend per step, which other load on a shared machine disturbs less. A
``torch vs torch`` row shows the noise floor. Collectives per step are counted with
``CommDebugMode``. Absolute times only mean something on a quiet machine or a GPU.

Usage::

    python benchmarks/tp_vs_torch.py [--steps 20] [--warmup 3] [--tp 2 4] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel as torch_tp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import hp_tp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common.py is beside it

from _common import cpu_environment, spawn_ranks

VOCAB, DIM, HEADS, HIDDEN, SEQ, BATCH, BLOCKS = 1024, 128, 8, 512, 64, 4, 2


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.w2(F.gelu(self.w1(self.ffn_norm(x))))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def plan(ns: Any) -> dict[str, Any]:
    """The TorchTitan-style TP+SP plan; ``ns`` is hp_tp or torch's module (same names)."""
    return {
        "tok_embeddings": ns.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "layers.*.attention_norm": ns.SequenceParallel(),
        "layers.*.attention": ns.PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "layers.*.attention.w[qkv]": ns.ColwiseParallel(),
        "layers.*.attention.wo": ns.RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": ns.SequenceParallel(),
        "layers.*.w1": ns.ColwiseParallel(input_layouts=Shard(1)),
        "layers.*.w2": ns.RowwiseParallel(output_layouts=Shard(1)),
        "norm": ns.SequenceParallel(),
        "output": ns.ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        ),
    }


NAMESPACES = {"ours": hp_tp, "torch": torch_tp, "torch2": torch_tp}


def build(impl: str, mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Transformer()
    ns = NAMESPACES[impl]
    ns.parallelize_module(model, mesh, plan(ns))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def step(impl: str, model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> float:
    tokens, labels = batch
    logits = model(tokens)
    assert isinstance(logits, DTensor)
    with NAMESPACES[impl].loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach().to_local())


def time_pair(
    pair: tuple[str, str], mesh: Any, steps: int, warmup: int
) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) step seconds of each implementation of ``pair``, built and called in
    that order. CPU time (all threads of the rank's process) is less sensitive to other load on
    a shared machine than wall time."""
    built = {impl: build(impl, mesh) for impl in pair}
    gen = torch.Generator().manual_seed(1)
    wall: dict[str, list[float]] = {impl: [] for impl in pair}
    cpu: dict[str, list[float]] = {impl: [] for impl in pair}
    for i in range(warmup + steps):
        batch = (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
        )
        for impl in pair:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step(impl, *built[impl], batch)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if i >= warmup:
                wall[impl].append(dt)
                cpu[impl].append(dc)
    medians = torch.tensor(
        [[statistics.median(wall[impl]), statistics.median(cpu[impl])] for impl in pair],
        dtype=torch.float64,
    )
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return {impl: (row[0], row[1]) for impl, row in zip(pair, medians.tolist(), strict=True)}


def count_collectives(impl: str, mesh: Any) -> int:
    model, opt = build(impl, mesh)
    gen = torch.Generator().manual_seed(2)
    batch = (
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
    )
    step(impl, model, opt, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # CommDebugMode's module backward hooks
        with CommDebugMode() as comm:
            step(impl, model, opt, batch)
    return int(comm.get_total_counts())


def worker(rank: int, ws: int, init_file: str, steps: int, warmup: int, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws)
    try:
        mesh = init_device_mesh("cpu", (ws,))
        rows: dict[str, Any] = {}
        for ours, theirs in (("ours", "torch"), ("torch2", "torch")):
            a = time_pair((ours, theirs), mesh, steps, warmup)
            b = time_pair((theirs, ours), mesh, steps, warmup)
            r1, r2 = a[ours][0] / a[theirs][0], b[ours][0] / b[theirs][0]
            c1, c2 = a[ours][1] / a[theirs][1], b[ours][1] / b[theirs][1]
            rows[ours] = {
                "ratio": math.sqrt(r1 * r2),
                "ours_first": r1,
                "torch_first": r2,
                "cpu_ratio": math.sqrt(c1 * c2),
                "ours_median_ms": 1e3 * statistics.mean([a[ours][0], b[ours][0]]),
                "torch_median_ms": 1e3 * statistics.mean([a[theirs][0], b[theirs][0]]),
            }
        counts = {impl: count_collectives(impl, mesh) for impl in ("ours", "torch")}
        if rank == 0:
            Path(out_file).write_text(json.dumps({"rows": rows, "collectives": counts}))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    results: dict[str, Any] = {
        "config": {
            "vocab": VOCAB,
            "dim": DIM,
            "heads": HEADS,
            "hidden": HIDDEN,
            "seq": SEQ,
            "batch": BATCH,
            "blocks": BLOCKS,
            "steps": args.steps,
            "warmup": args.warmup,
            **cpu_environment(),
        },
        "tp": {},
    }
    for ws in args.tp:
        results["tp"][str(ws)] = spawn_ranks(worker, ws, args.steps, args.warmup)
        print(f"tp={ws}: {json.dumps(results['tp'][str(ws)])}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tp.json").write_text(json.dumps(results, indent=2) + "\n")
    cfg = results["config"]
    lines = [
        "# hp-tp vs torch.distributed.tensor.parallel: training step",
        "",
        f"Transformer: vocab {VOCAB}, dim {DIM}, {HEADS} heads, hidden {HIDDEN}, {BLOCKS} blocks, "
        f"seq {SEQ}, batch {BATCH}; TP + SP + loss_parallel, SGD. {cfg['device']}/gloo, 1 thread "
        f"per rank, {args.steps} alternating steps per order after {args.warmup} warm-up, torch "
        f"{torch.__version__}, {os.cpu_count()} CPU cores. Ratio = ours / torch (below 1: ours "
        "faster), geometric mean of both build/call orders; slowest rank's median; the CPU-time "
        "ratio is the same statistic on the CPU time of the ranks' processes (less disturbed by "
        "other load on a shared machine).",
        "",
        "| tp | pair | ratio (wall) | ours first | torch first | ratio (CPU time) "
        "| ours median (ms) | torch median (ms) | collectives/step ours | torch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ws, res in results["tp"].items():
        for name, row in res["rows"].items():
            label = "hp-tp vs torch" if name == "ours" else "torch vs torch (noise floor)"
            counts = res["collectives"]
            lines.append(
                f"| {ws} | {label} | {row['ratio']:.3f} | {row['ours_first']:.3f} | "
                f"{row['torch_first']:.3f} | {row['cpu_ratio']:.3f} | "
                f"{row['ours_median_ms']:.1f} | {row['torch_median_ms']:.1f} | "
                + (f"{counts['ours']} | {counts['torch']} |" if name == "ours" else "| |")
            )
    (args.out / "tp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
