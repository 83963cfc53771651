"""The main job with hp's engines against the same trainer with PyTorch's FSDP2 + TP swapped in.

Both trainers run the README's main job (debug Llama 3, FSDP 2 x TP 2 on 4 CPU ranks, seq 128,
local batch 4, fp32) in the same 4 worker processes from the same job and the same data. The
only difference is the engine: hp-trainer takes ``fully_shard``, the FSDP policies, the TP styles,
``parallelize_module`` and ``loss_parallel`` from one module (``hp_trainer._parallel_api``); for
the PyTorch trainer every hp-trainer module's binding of those names is pointed at torch's
object while that trainer is built and while each of its steps runs, and pointed back after.

Steps alternate (one step of each per round, a barrier around each), warm-up rounds are
discarded, and the median step time of hp's trainer is divided by PyTorch's; the run is repeated
with the order reversed and the geometric mean of the two ratios is reported, so that order
effects cancel. The losses of every step are compared: they must be bitwise equal, or the ratio
compares different work and the script exits 1.

Target (issue "No host syncs", item 6): ratio <= 0.95 (lower is faster).

Usage::

    python benchmarks/trainer_engines.py [--rounds 30 | --quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from math import sqrt
from pathlib import Path
from typing import Any

WARMUP = 3
ENGINES = ("hp", "torch")


def _torch_objects() -> dict[str, Any]:
    """PyTorch's object for every name ``hp_trainer._parallel_api`` exports."""
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.tensor.parallel as torch_tp
    from torch.distributed.tensor.parallel.style import ParallelStyle

    from hp_trainer import _parallel_api

    objects: dict[str, Any] = {}
    for name in _parallel_api.__all__:
        if name == "ParallelStyle":
            objects[name] = ParallelStyle
        elif hasattr(torch_fsdp, name):
            objects[name] = getattr(torch_fsdp, name)
        elif hasattr(torch_tp, name):
            objects[name] = getattr(torch_tp, name)
        else:
            # FSDPMeshInfo and friends live in torch's private FSDP package
            from torch.distributed.fsdp._fully_shard import _fsdp_common

            objects[name] = getattr(_fsdp_common, name)
    return objects


@contextlib.contextmanager
def _torch_engines(objects: dict[str, Any]) -> Iterator[None]:
    """Point every hp-trainer module's binding of an engine name at torch's object."""
    from hp_trainer import _parallel_api

    # hp's objects read before anything is swapped (``_parallel_api`` itself is swapped too)
    hp_objects = {name: getattr(_parallel_api, name) for name in objects}
    swapped: list[tuple[Any, str, Any]] = []
    for module in list(sys.modules.values()):
        if module is None or not getattr(module, "__name__", "").startswith("hp_trainer"):
            continue
        for name, torch_object in objects.items():
            hp_object = hp_objects[name]
            if getattr(module, name, None) is hp_object:
                swapped.append((module, name, hp_object))
                setattr(module, name, torch_object)
    try:
        yield
    finally:
        for module, name, hp_object in swapped:
            setattr(module, name, hp_object)


def _job(folder: str, name: str) -> Any:
    from hp_trainer import ConfigManager

    return ConfigManager().from_dict(
        {
            "job": {"run_name": name, "dump_folder": folder},
            "model": {"name": "llama3", "flavor": "debugmodel"},
            "training": {
                "local_batch_size": 4,
                "seq_len": 128,
                "steps": 1000,
                "seed": 0,
                "mixed_precision_param": "float32",
                "mixed_precision_reduce": "float32",
            },
            "parallelism": {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2},
            "metrics": {"log_freq": 100000, "enable_plot": False, "enable_progress_bar": False},
            "data": {"dataset": str(Path(folder) / "corpus.txt")},
        }
    )


def _worker(folder: str, rounds: int, order: list[str]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from hp_trainer import Trainer

    torch.set_num_threads(1)
    objects = _torch_objects()
    contexts = {"hp": contextlib.nullcontext, "torch": lambda: _torch_engines(objects)}
    trainers = {}
    for name in order:
        with contexts[name]():
            trainers[name] = Trainer(_job(folder, name))
    batches = {name: t.data_iterator() for name, t in trainers.items()}
    times: dict[str, list[float]] = {name: [] for name in order}
    cpu: dict[str, list[float]] = {name: [] for name in order}
    losses: dict[str, list[float]] = {name: [] for name in order}
    for _ in range(rounds + WARMUP):
        for name in order:
            batch = next(batches[name])
            with contexts[name]():
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                loss, _ = trainers[name].train_step(batch)
                dist.barrier()
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
            losses[name].append(float(loss))
    for trainer in trainers.values():
        trainer.close()
    # process CPU time (all threads of the rank): much less sensitive to other load than wall
    mine = {n: ts[WARMUP:] for n, ts in cpu.items()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    cpu_sum = {
        n: statistics.median([sum(g[n][i] for g in gathered) for i in range(rounds)]) for n in order
    }
    return {
        "times": {n: ts[WARMUP:] for n, ts in times.items()},
        "cpu_s": cpu_sum,
        "losses": losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed steps per engine")
    parser.add_argument(
        "--quick", action="store_true", help="short run: 8 rounds (unless --rounds is given)"
    )
    parser.add_argument("--out", default="benchmarks/results")
    opts = parser.parse_args()
    if opts.quick and "--rounds" not in sys.argv:
        opts.rounds = 8

    from hp_dtensor.testing import run_distributed
    from hp_trainer import load_documents

    names = list(ENGINES)
    medians: dict[str, list[float]] = {name: [] for name in names}
    cpu_medians: dict[str, list[float]] = {name: [] for name in names}
    equal = True
    with tempfile.TemporaryDirectory() as folder:
        text = "\n".join(load_documents("tiny_stories_synth")[:600]) + "\n"
        (Path(folder) / "corpus.txt").write_text(text)
        for order in (names, names[::-1]):
            result = run_distributed(_worker, 4, folder, opts.rounds, order, timeout=900)[0]
            for name in names:
                medians[name].append(statistics.median(result["times"][name]))
                cpu_medians[name].append(result["cpu_s"][name])
            equal = equal and result["losses"]["hp"] == result["losses"]["torch"]
            last_losses = result["losses"]
    ratios = [h / t for h, t in zip(medians["hp"], medians["torch"], strict=True)]
    ratio = sqrt(ratios[0] * ratios[1])
    cpu_ratios = [h / t for h, t in zip(cpu_medians["hp"], cpu_medians["torch"], strict=True)]
    cpu_ratio = sqrt(cpu_ratios[0] * cpu_ratios[1])
    try:
        load = f"{os.getloadavg()[0]:.2f}"
    except (AttributeError, OSError):
        load = "n/a"
    report = {
        "rounds": opts.rounds,
        "warmup": WARMUP,
        "load_1min": load,
        "median_step_s": medians,
        "ratio_hp_over_torch": ratio,
        "ratios_each_order": ratios,
        "median_cpu_s_all_ranks": cpu_medians,
        "cpu_ratio_hp_over_torch": cpu_ratio,
        "losses_bitwise_equal": equal,
        "losses": last_losses,
    }
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trainer_engines.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Main job: hp's engines vs PyTorch's FSDP2 + TP in the same trainer (4 CPU ranks)",
        "",
        f"FSDP 2 x TP 2, debug Llama 3, seq 128, local batch 4, fp32, gloo; {opts.rounds} "
        f"alternating steps per engine after {WARMUP} warm-up rounds, both orders, geometric "
        "mean (lower is faster; target <= 0.95).",
        "",
        "| engine | median step (s), each order |",
        "|---|---|",
    ]
    for name in names:
        lines.append(f"| {name} | {', '.join(f'{m:.4f}' for m in medians[name])} |")
    lines += [
        "",
        f"hp / torch step time: **{ratio:.3f}** (each order: "
        f"{', '.join(f'{r:.3f}' for r in ratios)}); losses bitwise equal over "
        f"{opts.rounds + WARMUP} steps: **{equal}**.",
        "",
        f"Process CPU time per step (all threads, summed over the 4 ranks) hp / torch: "
        f"**{cpu_ratio:.3f}** (each order: {', '.join(f'{r:.3f}' for r in cpu_ratios)}); "
        f"1-minute load average at the end: {load}.",
    ]
    (out / "trainer_engines.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not equal:
        sys.exit(1)


if __name__ == "__main__":
    main()
