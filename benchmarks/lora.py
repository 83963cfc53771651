"""LoRA vs full fine-tuning of the debug Llama 3 on 4 CPU ranks (FSDP 2 x TP 2): memory and time.

Both trainers (the same job; one with ``--model.converters lora``, rank 8 on every linear of
the blocks) are built in the same 4 worker processes; their steps alternate (a barrier around
each), the warm-up rounds are discarded, and the median step time of LoRA is divided by full
fine-tuning's. The run is repeated with the build order swapped and the geometric mean of the
two ratios is reported. Peak tensor memory is measured over one
step of each after the warm-up: rank 0's parameter shards and optimizer state before the step
plus the peak of the storages created during it (gradients, gathered parameters, activations,
temporaries), tracked with a dispatch mode (tensor bytes, not RSS; PyTorch's ``MemTracker``
refuses frozen parameters).

Usage::

    python benchmarks/lora.py [--rounds 6] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from math import sqrt
from pathlib import Path
from typing import Any

KINDS = ("full", "lora")
PAR = {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}
WARMUP = 2


def _job(folder: str, kind: str) -> Any:
    from hp_trainer import ConfigManager

    return ConfigManager().from_dict(
        {
            "job": {"run_name": kind, "dump_folder": folder},
            "model": {
                "name": "llama3",
                "flavor": "debugmodel",
                "converters": ["lora"] if kind == "lora" else [],
            },
            "lora": {"rank": 8, "alpha": 16.0},
            "training": {
                "local_batch_size": 4,
                "seq_len": 128,
                "steps": 1000,
                "seed": 0,
                "mixed_precision_param": "float32",
                "mixed_precision_reduce": "float32",
            },
            "parallelism": PAR,
            "metrics": {"log_freq": 100000, "enable_plot": False, "enable_progress_bar": False},
            "data": {"dataset": str(Path(folder) / "corpus.txt")},
        }
    )


def _local_bytes(tensors: Any) -> int:
    import torch
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _peak(trainer: Any, batch: Any) -> dict[str, int]:
    """Rank-local tensor bytes: the persistent state before a step (parameter shards,
    optimizer state) and the peak of the storages created during it (gradients, gathered
    parameters, activations, temporaries), tracked with a dispatch mode."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Live(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __init__(self) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.live = 0
            self.peak = 0
            self.seen: set[int] = set()

        def _free(self, key: int, nbytes: int) -> None:
            self.seen.discard(key)
            self.live -= nbytes

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and not t.is_meta:
                    storage = t.untyped_storage()
                    key = id(storage)
                    if key not in self.seen:
                        self.seen.add(key)
                        self.live += storage.nbytes()
                        self.peak = max(self.peak, self.live)
                        weakref.finalize(storage, self._free, key, storage.nbytes())
            return out

    params = [p for part in trainer.model_parts for p in part.parameters()]
    states = [v for opt in trainer.optimizers for s in opt.state.values() for v in s.values()]
    persistent = {"parameters": _local_bytes(params), "optimizer_state": _local_bytes(states)}
    with Live() as live:
        trainer.train_step(batch)
    step_peak = live.peak
    return {**persistent, "step_peak": step_peak, "Total": sum(persistent.values()) + step_peak}


def _worker(folder: str, rounds: int, order: list[str]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from hp_trainer import Trainer

    torch.set_num_threads(1)
    trainers = {kind: Trainer(_job(folder, kind)) for kind in order}
    batches = {kind: t.data_iterator() for kind, t in trainers.items()}
    times: dict[str, list[float]] = {kind: [] for kind in order}
    for _ in range(rounds + WARMUP):
        for kind in order:
            batch = next(batches[kind])
            dist.barrier()
            start = time.perf_counter()
            trainers[kind].train_step(batch)
            dist.barrier()
            times[kind].append(time.perf_counter() - start)
    peaks = {}
    for kind in order:
        batch = next(batches[kind])
        peaks[kind] = _peak(trainers[kind], batch)
    counts = {
        kind: {
            "trainable": sum(
                p.numel() for part in t.model_parts for p in part.parameters() if p.requires_grad
            ),
            "optimizer_state_tensors": sum(
                len(s) for opt in t.optimizers for s in opt.state.values()
            ),
        }
        for kind, t in trainers.items()
    }
    for trainer in trainers.values():
        trainer.close()
    return {
        "times": {kind: ts[WARMUP:] for kind, ts in times.items()},
        "peaks": peaks,
        "counts": counts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="benchmarks/results")
    opts = parser.parse_args()

    from hp_dtensor.testing import run_distributed
    from hp_trainer import load_documents

    names = list(KINDS)
    medians: dict[str, list[float]] = {kind: [] for kind in names}
    with tempfile.TemporaryDirectory() as folder:
        text = "\n".join(load_documents("tiny_stories_synth")[:600]) + "\n"
        (Path(folder) / "corpus.txt").write_text(text)
        results = []
        for order in (names, names[::-1]):
            result = run_distributed(_worker, 4, folder, opts.rounds, order, timeout=900)[0]
            results.append(result)
            for kind in names:
                medians[kind].append(statistics.median(result["times"][kind]))
    ratios = [lo / full for lo, full in zip(medians["lora"], medians["full"], strict=True)]
    peaks = results[0]["peaks"]
    counts = results[0]["counts"]
    mem_ratio = peaks["lora"]["Total"] / peaks["full"]["Total"]
    report = {
        "rounds": opts.rounds,
        "warmup": WARMUP,
        "step_time_lora_over_full": sqrt(ratios[0] * ratios[1]),
        "step_time_ratios_each_order": ratios,
        "peak_bytes_rank0": peaks,
        "peak_total_lora_over_full": mem_ratio,
        "counts_rank0": counts,
    }
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora.json").write_text(json.dumps(report, indent=2) + "\n")
    mib = 1024 * 1024
    cats = sorted(set(peaks["full"]) | set(peaks["lora"]))
    lines = [
        "# LoRA vs full fine-tuning: debug Llama 3, 4 CPU ranks (FSDP 2 x TP 2)",
        "",
        f"{opts.rounds} alternating steps each after {WARMUP} warm-up rounds, both build "
        "orders, geometric mean (seq 128, local batch 4, fp32, gloo; LoRA rank 8 on the 42 "
        "block linears).",
        "",
        f"- step time LoRA / full: {report['step_time_lora_over_full']:.2f} "
        f"(per order {', '.join(f'{r:.2f}' for r in ratios)})",
        f"- peak tensor memory of rank 0, LoRA / full: {mem_ratio:.2f}",
        f"- trainable parameters: {counts['lora']['trainable']:,} (LoRA) vs "
        f"{counts['full']['trainable']:,} (full); optimizer state tensors on rank 0 "
        f"{counts['lora']['optimizer_state_tensors']} vs "
        f"{counts['full']['optimizer_state_tensors']}",
        "",
        "| peak (MiB, rank 0) | full | LoRA |",
        "|---|---|---|",
    ]
    for cat in cats:
        full_mib, lora_mib = peaks["full"].get(cat, 0) / mib, peaks["lora"].get(cat, 0) / mib
        lines.append(f"| {cat} | {full_mib:.2f} | {lora_mib:.2f} |")
    (out / "lora.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
