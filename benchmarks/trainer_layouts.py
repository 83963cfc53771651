"""Step time of the debug Llama 3 in each shipped layout on 4 CPU ranks, relative to dp 4.

Every layout's trainer (dp 4 alone, FSDP 2 x TP 2 = ``debug``, PP 2 x FSDP 2 = ``debug_pp``,
CP 2 x FSDP 2 = ``debug_cp``) is built in the same 4 worker processes from the same job
(debug model, seq 128, local batch 4 per data-parallel rank in every layout, fp32); their
steps alternate (one step of each per round, a barrier around each), the warm-up rounds are
discarded, and the median step time of each layout is divided by dp 4's. The run is repeated
with the layouts in reverse order and the geometric mean of the two ratios is reported, so
that order effects cancel. A regression in any engine (FSDP, TP, PP executor, CP attention)
shows as a ratio that grows.

The layouts do not do the same work per rank: dp 4 processes 4 x 4 samples per step, the
others 2 x 4 (their second axis splits the model, the sequence or the stages, not the batch),
so these are ratios of the time of one optimizer step, not of throughput per sample.

Usage::

    python benchmarks/trainer_layouts.py [--rounds 8] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from math import sqrt
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common.py is beside it

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp4": {"data_parallel_shard_degree": 4},
    "fsdp2 x tp2 (debug)": {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2},
    "pp2 x fsdp2 (debug_pp)": {
        "pipeline_parallel_degree": 2,
        "data_parallel_shard_degree": 2,
        "pipeline_parallel_microbatch_size": 1,
    },
    "cp2 x fsdp2 (debug_cp)": {"context_parallel_degree": 2, "data_parallel_shard_degree": 2},
}
WARMUP = 2


def _job(folder: str, name: str, par: dict[str, Any]) -> Any:
    from hp_trainer import ConfigManager

    return ConfigManager().from_dict(
        {
            "job": {"run_name": name.split()[0], "dump_folder": folder},
            "model": {"name": "llama3", "flavor": "debugmodel"},
            "training": {
                "local_batch_size": 4,
                "seq_len": 128,
                "steps": 1000,
                "seed": 0,
                "mixed_precision_param": "float32",
                "mixed_precision_reduce": "float32",
            },
            "parallelism": par,
            "metrics": {"log_freq": 100000, "enable_plot": False, "enable_progress_bar": False},
            "data": {"dataset": str(Path(folder) / "corpus.txt")},
        }
    )


def _worker(folder: str, rounds: int, order: list[str]) -> dict[str, list[float]]:
    import torch

    from _common import alternating_train_steps
    from hp_trainer import Trainer

    torch.set_num_threads(1)
    trainers = {name: Trainer(_job(folder, name, LAYOUTS[name])) for name in order}
    batches = {name: t.data_iterator() for name, t in trainers.items()}
    times = alternating_train_steps(trainers, batches, rounds, warmup=WARMUP)
    for trainer in trainers.values():
        trainer.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results")
    opts = parser.parse_args()

    from hp_dtensor.testing import run_distributed

    names = list(LAYOUTS)
    medians: dict[str, list[float]] = {name: [] for name in names}
    from hp_trainer import load_documents

    with tempfile.TemporaryDirectory() as folder:
        # 600 documents (tokenizing the whole shipped corpus in 4 trainers x 4 ranks is slow)
        text = "\n".join(load_documents("tiny_stories_synth")[:600]) + "\n"
        (Path(folder) / "corpus.txt").write_text(text)
        for order in (names, names[::-1]):
            result = run_distributed(_worker, 4, folder, opts.rounds, order, timeout=600)[0]
            for name in names:
                medians[name].append(statistics.median(result[name]))
    rows = []
    for name in names:
        ratios = [m / b for m, b in zip(medians[name], medians["dp4"], strict=True)]
        rows.append(
            {
                "layout": name,
                "ratio_vs_dp4": sqrt(ratios[0] * ratios[1]),
                "ratios_each_order": ratios,
            }
        )
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trainer_layouts.json").write_text(
        json.dumps({"rounds": opts.rounds, "warmup": WARMUP, "rows": rows}, indent=2) + "\n"
    )
    lines = [
        "# Trainer layouts: debug Llama 3 step time on 4 CPU ranks, relative to dp 4",
        "",
        f"{opts.rounds} alternating steps per layout after {WARMUP} warm-up rounds, both "
        "orders, geometric mean (lower is faster; seq 128, local batch 4, fp32, gloo).",
        "",
        "| layout | step time / dp 4 | per order |",
        "|---|---|---|",
    ]
    for row in rows:
        each = ", ".join(f"{r:.2f}" for r in row["ratios_each_order"])
        lines.append(f"| {row['layout']} | {row['ratio_vs_dp4']:.2f} | {each} |")
    (out / "trainer_layouts.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
