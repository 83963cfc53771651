"""The planner's predictions checked on this machine: 9 layouts of the debug models on 4 ranks.

Every layout's trainer (FSDP 4, HSDP 2 x 2, FSDP 2 x TP 2, PP 2 x FSDP 2 with 1F1B and with
Interleaved 1F1B, CP 2 x FSDP 2, EP 2 over FSDP 4 on the MoE debug model, and FSDP 4 and
FSDP 2 x TP 2 with full AC) is built in the same 4 gloo worker processes (debug models, seq 128,
local batch 4 per data-parallel rank, micro-batch 1 under PP, fp32; torch's default intra-op
threads, as in the tests and in ``hp-plan calibrate``); their steps alternate (one
step of each per round, a barrier around each), warm-up rounds discarded, median step time per
layout. Then each layout is built again alone and its second step is measured at tensor level
(``hp_trainer.planner._measure``: the bytes alive at the step's start plus the peak of
allocations minus frees; the worst rank).

The predictions come from :func:`hp_trainer.planner.estimate_layout` with the ``cpu`` profile
(``hp-plan calibrate --world-size 4`` on this machine). Reported: Spearman's rank correlation of
predicted and measured step times (target >= 0.8), and the peak-memory error of each layout
(target <= 15%).

``--offload`` checks hyper-offload instead, in one process (where host memory is device memory,
so the figures are tensor-level: the device side is what the training thread allocates): the tiny
Llama (seq 32, local batch 2, fp32, AdamW; the job of ``test_offload.py`` and
``test_param_offload.py``) without offload, with ``offload.optimizer`` (the peak of a step with
optimizer state, the bytes between steps, the host bytes) and with ``offload.params`` (the peak
of a forward + backward, the bytes copied per step), each against the planner's prediction.

Usage::

    python benchmarks/planner_check.py [--rounds 6] [--profile cpu] [--out benchmarks/results]
    python benchmarks/planner_check.py --offload
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common.py is beside it

# name -> (model, flavor, [parallelism] overrides, AC mode)
LAYOUTS: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "fsdp4": ("llama3", "debugmodel", {"data_parallel_shard_degree": 4}, "none"),
    "hsdp2 x fsdp2": ("llama3", "debugmodel",
                      {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2},
                      "none"),
    "fsdp2 x tp2": ("llama3", "debugmodel",
                    {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}, "none"),
    "pp2 x fsdp2 1F1B": ("llama3", "debugmodel",
                         {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 2,
                          "pipeline_parallel_schedule": "1F1B"}, "none"),
    "pp2 x fsdp2 Interleaved1F1B": ("llama3", "debugmodel",
                                    {"pipeline_parallel_degree": 2,
                                     "data_parallel_shard_degree": 2,
                                     "pipeline_parallel_schedule": "Interleaved1F1B"}, "none"),
    "cp2 x fsdp2": ("llama3", "debugmodel",
                    {"context_parallel_degree": 2, "data_parallel_shard_degree": 2}, "none"),
    "fsdp4 ep2 (moe)": ("qwen3_moe", "debugmodel",
                        {"data_parallel_shard_degree": 4, "expert_parallel_degree": 2}, "none"),
    "fsdp4 + full AC": ("llama3", "debugmodel", {"data_parallel_shard_degree": 4}, "full"),
    "fsdp2 x tp2 + full AC": ("llama3", "debugmodel",
                              {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2},
                              "full"),
}  # fmt: skip
WARMUP = 2
SEQ = 128
LOCAL_BATCH = 4


def _job(folder: str, name: str, suffix: str = "") -> Any:
    from hp_trainer import ConfigManager

    model, flavor, par, ac = LAYOUTS[name]
    return ConfigManager().from_dict(
        {
            "job": {"run_name": name.split()[0] + suffix, "dump_folder": folder},
            "model": {"name": model, "flavor": flavor},
            "training": {
                "local_batch_size": LOCAL_BATCH,
                "seq_len": SEQ,
                "steps": 1000,
                "seed": 0,
                "mixed_precision_param": "float32",
                "mixed_precision_reduce": "float32",
            },
            "parallelism": {"pipeline_parallel_microbatch_size": 1, **par},
            "activation_checkpoint": {"mode": ac},
            "metrics": {"log_freq": 100000, "enable_plot": False, "enable_progress_bar": False},
            "data": {"dataset": str(Path(folder) / "corpus.txt")},
        }
    )


def _worker(folder: str, rounds: int, names: list[str]) -> dict[str, Any]:
    import torch.distributed as dist

    from hp_trainer import Trainer
    from hp_trainer.planner._measure import step_peak

    times: dict[str, list[float]] = {name: [] for name in names}
    if rounds:
        from _common import alternating_train_steps

        trainers = {name: Trainer(_job(folder, name)) for name in names}
        batches = {name: t.data_iterator() for name, t in trainers.items()}
        times = alternating_train_steps(
            trainers, batches, rounds, warmup=WARMUP, reverse_odd_rounds=True
        )
        for trainer in trainers.values():
            trainer.close()
    # memory: one trainer alive at a time (no other trainer's tensors are freed during the
    # profiled step), its second step (with optimizer state)
    peaks, where = {}, {}
    for name in names:
        dist.barrier()
        trainer = Trainer(_job(folder, name, "_mem"))
        it = trainer.data_iterator()
        trainer.train_step(next(it))
        peaks[name], at, _ = step_peak(trainer, next(it))
        where[name] = {
            "at": " > ".join(at.at[-3:]),
            "live_mib": {k: round(v / 2**20, 2) for k, v in list(at.live.items())[:8]},
        }
        trainer.close()
    median = {n: statistics.median(ts) if ts else 0.0 for n, ts in times.items()}
    return {"median": median, "peak": peaks, "where": where}


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (Pearson on the ranks, ties averaged)."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return float(cov / (va * vb))


def predict(name: str, profile: Any) -> Any:
    """The planner's estimate of one layout."""
    from hp_trainer.planner import LayoutCandidate, estimate_layout, model_stats

    model, flavor, par, ac = LAYOUTS[name]
    cand = LayoutCandidate(
        dp_replicate=par.get("data_parallel_replicate_degree", 1),
        dp_shard=par.get("data_parallel_shard_degree", 1),
        tp=par.get("tensor_parallel_degree", 1),
        pp=par.get("pipeline_parallel_degree", 1),
        cp=par.get("context_parallel_degree", 1),
        ep=par.get("expert_parallel_degree", 1),
        schedule=par.get("pipeline_parallel_schedule", "1F1B"),
        microbatch_size=1,
        local_batch_size=LOCAL_BATCH,
        seq_len=SEQ,
        ac=ac,  # type: ignore[arg-type]
        compute_dtype_bytes=4,
    )
    return estimate_layout(model_stats(model, flavor, SEQ), cand, profile)


def _offload_job(folder: str, run: str, *, optimizer: bool, params: bool) -> Any:
    from hp_trainer import ConfigManager

    cfg = ConfigManager().from_dict(
        {
            "job": {"run_name": run, "dump_folder": folder},
            "model": {"name": "llama3", "flavor": "tiny"},
            "training": {
                "local_batch_size": 2,
                "seq_len": 32,
                "steps": 1000,
                "seed": 0,
                "max_norm": 1.0,
                "mixed_precision_param": "float32",
                "mixed_precision_reduce": "float32",
            },
            "optimizer": {"lr": 5e-3, "eps": 1e-6},
            "lr_scheduler": {"warmup_steps": 1},
            "metrics": {"log_freq": 100000, "enable_plot": False, "enable_progress_bar": False},
            "data": {"dataset": str(Path(folder) / "corpus.txt")},
        }
    )
    cfg.offload.optimizer = optimizer
    cfg.offload.params = params
    return cfg


def _offload_measure(folder: str, run: str, *, optimizer: bool, params: bool) -> dict[str, Any]:
    """Tensor-level figures of the tiny Llama's second step (the one with optimizer state)."""
    import torch

    from hp_trainer import Trainer
    from hp_trainer.planner._measure import (
        forward_backward_peak,
        live_device_bytes,
        step_peak_bytes,
    )

    trainer = Trainer(_offload_job(folder, run, optimizer=optimizer, params=params))
    try:
        batches = trainer.data_iterator()
        trainer.train_step(next(batches))
        batch = next(batches)
        fb_peak, where = forward_backward_peak(trainer, batch)
        out: dict[str, Any] = {"fb_peak": fb_peak, "fb_at": " > ".join(where.at[-3:])}
        out["fb_live"] = {k: v for k, v in list(where.live.items())[:6]}
        if trainer.param_offload is not None:
            # the host step's temporaries are host memory allocated by this thread: the step's
            # peak is the forward + backward's
            trainer.param_offload.reset_stats()
            trainer.train_step(batch)
            out["step_peak"] = 0
        else:
            out["step_peak"] = step_peak_bytes(trainer, batch)[0]
        if trainer.param_offload is not None:
            out["copied"] = trainer.param_offload.copied_bytes
            # parameters and gradient buffers, and the optimizer's state (created on the host)
            state = [
                v for opt in trainer.optimizers for st in opt.state.values() for v in st.values()
            ]
            out["host"] = trainer.param_offload.host_bytes + sum(
                v.untyped_storage().nbytes() for v in state if isinstance(v, torch.Tensor)
            )
        else:
            out["host"] = int(getattr(trainer.optimizers, "host_bytes", 0))
        trainer.optimizers.zero_grad()
        if trainer.param_offload is None:
            out["between_steps"] = live_device_bytes(trainer.model_parts, [trainer.optimizers])
        else:  # the parameters are their host tensors between steps: the buffers stay
            buffers = trainer.model.buffers()
            out["between_steps"] = sum(b.untyped_storage().nbytes() for b in buffers)
        out["params"] = sum(p.numel() for p in trainer.model.parameters())
        return out
    finally:
        trainer.close()


def offload_check(profile: Any) -> list[dict[str, Any]]:
    """Measure and predict the tiny Llama without offload, with the optimizer offloaded and
    with the parameters offloaded (one process); print and return one row per setting."""
    from hp_trainer import load_documents
    from hp_trainer.planner import LayoutCandidate, estimate_layout, model_stats

    stats = model_stats("llama3", "tiny", 32)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        text = "\n".join(load_documents("tiny_stories_synth")[:200]) + "\n"
        (Path(folder) / "corpus.txt").write_text(text)
        for name, optimizer, params in (
            ("none", False, False),
            ("offload.optimizer", True, False),
            ("offload.params", False, True),
        ):
            m = _offload_measure(folder, name.replace(".", "_"), optimizer=optimizer, params=params)
            cand = LayoutCandidate(
                local_batch_size=2,
                seq_len=32,
                compute_dtype_bytes=4,
                offload_optimizer=optimizer,
                offload_params=params,
            )
            est = estimate_layout(stats, cand, profile)
            # the planner's peak is of a step with optimizer state; with the parameters
            # offloaded the step's peak is the forward + backward's (the host steps)
            measured = m["fb_peak"] if params else m["step_peak"]
            rows.append({
                "offload": name, **m, "predicted_peak": est.peak_memory,
                "predicted_host": est.host_memory,
                "error": (est.peak_memory - measured) / measured,
            })  # fmt: skip
    n = rows[0]["params"]
    print(f"tiny llama3: {n:,} parameters ({4 * n:,} fp32 bytes), seq 32, local batch 2, AdamW")
    print("| offload | step peak B | fwd+bwd peak B | predicted peak B | error | between steps B "
          "| host B | predicted host B | copied per step B |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        step = f"{r['step_peak']:,}" if r["step_peak"] else "(host step)"
        print(f"| {r['offload']} | {step} | {r['fb_peak']:,} | {r['predicted_peak']:,.0f} | "
              f"{100 * r['error']:+.1f}% | {r['between_steps']:,} | {r['host']:,} | "
              f"{r['predicted_host']:,.0f} | {r.get('copied', 0):,} |")  # fmt: skip
    for r in rows:
        print(f"{r['offload']}: forward + backward peak at {r['fb_at']}; live bytes there by "
              f"site: {r['fb_live']}")  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--profile", default="cpu")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument(
        "--memory-only",
        action="store_true",
        help="measure the peaks only (no timing rounds), print them, write no results",
    )
    parser.add_argument("--layouts", nargs="*", default=None, help="a subset (with --memory-only)")
    parser.add_argument(
        "--offload",
        action="store_true",
        help="check hyper-offload's figures instead (one process, the tiny Llama), print them",
    )
    opts = parser.parse_args()
    if opts.offload:
        from hp_trainer.planner import load_device_profile as _load

        offload_check(_load(opts.profile))
        return
    names = list(LAYOUTS) if not opts.layouts else opts.layouts

    from hp_dtensor.testing import run_distributed
    from hp_trainer import load_documents
    from hp_trainer.planner import load_device_profile

    profile = load_device_profile(opts.profile)
    with tempfile.TemporaryDirectory() as folder:
        text = "\n".join(load_documents("tiny_stories_synth")[:600]) + "\n"
        (Path(folder) / "corpus.txt").write_text(text)
        rounds = 0 if opts.memory_only else opts.rounds
        results = run_distributed(_worker, 4, folder, rounds, names, timeout=1800)
    if opts.memory_only:
        for name in names:
            est = predict(name, profile)
            worst = max(range(len(results)), key=lambda r: results[r]["peak"][name])
            measured = results[worst]["peak"][name]
            print(f"{name}: predicted {est.peak_memory / 2**20:.2f} MiB, measured "
                  f"{measured / 2**20:.2f} MiB (rank {worst}), error "
                  f"{100 * (est.peak_memory - measured) / measured:+.1f}%")  # fmt: skip
            print("  predicted parts:", {k: round(v / 2**20, 2) for k, v in est.memory.items()})
            print("  measured:", results[worst]["where"][name])
        return
    rows = []
    for name in names:
        est = predict(name, profile)
        measured_t = max(r["median"][name] for r in results)
        worst_rank = max(range(len(results)), key=lambda r: results[r]["peak"][name])
        measured_m = results[worst_rank]["peak"][name]
        rows.append({
            "layout": name,
            "predicted_step_s": est.step_time,
            "measured_step_s": measured_t,
            "predicted_peak_mib": est.peak_memory / 2**20,
            "measured_peak_mib": measured_m / 2**20,
            "memory_error": (est.peak_memory - measured_m) / measured_m,
            "predicted_parts_mib": {k: v / 2**20 for k, v in est.memory.items()},
            "measured_peak_at": results[worst_rank]["where"][name],
        })  # fmt: skip
    rho = spearman([r["predicted_step_s"] for r in rows], [r["measured_step_s"] for r in rows])
    worst = max(abs(r["memory_error"]) for r in rows)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "planner_check.json").write_text(
        json.dumps(
            {
                "rounds": opts.rounds,
                "warmup": WARMUP,
                "profile": profile.source,
                "spearman_step_time": rho,
                "max_abs_memory_error": worst,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    lines = [
        "# Planner check: predicted vs measured on 4 CPU ranks (debug models)",
        "",
        f"{opts.rounds} alternating steps per layout after {WARMUP} warm-up rounds, median, "
        f"worst rank; seq {SEQ}, local batch {LOCAL_BATCH}, fp32, gloo; profile "
        f"`{profile.name}`. Spearman rank correlation of step times: **{rho:.2f}** (target "
        f">= 0.8); largest peak-memory error: **{100 * worst:.1f}%** (target <= 15%).",
        "",
        "| layout | predicted step s | measured step s | predicted peak MiB | "
        "measured peak MiB | memory error |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['predicted_step_s']:.3f} | {r['measured_step_s']:.3f} | "
            f"{r['predicted_peak_mib']:.2f} | {r['measured_peak_mib']:.2f} | "
            f"{100 * r['memory_error']:+.1f}% |"
        )
    (out / "planner_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
