"""Context-parallel attention: peak tensor memory per rank and step time against one device.

For each sequence length, CP degree (1, 2, 4: one spawn of 4 ranks, cp = 2 on two pairs) and
mode (ring, all-gather-KV, Ulysses), every rank runs one forward + backward of causal attention
(fp32, load-balanced shards) on its shard of q/k/v ``[1, heads, seq / cp, head_dim]``; the peak
tensor memory of that step (everything allocated during it: outputs, saved tensors, gradients,
communication buffers; PyTorch's tensor-level ``MemTracker``, not RSS) is reported for the
largest rank. cp = 1 is single-device ``F.scaled_dot_product_attention``
on the whole sequence. Step time: every rank alternates the CP step with a single-device step on
the full sequence (same process, warm-up discarded); the figure is the slowest rank's median CP
step over the median single-device step. On this 2-core CPU machine the ranks share cores, so
the time ratio shows overhead, not speed-up; the memory columns are the point here. The noise
column is the single-device step timed against itself (same alternation): time ratios within
its distance from 1.00 are noise. Packed documents: the same call with document ids (documents of
uneven lengths crossing every chunk boundary) reports its host synchronisations per call
(forward + backward, ``hp_dtensor.testing.count_host_syncs``), its peak memory over the causal
call's and its time over the causal call's. PyTorch's own
``context_parallel`` is not a baseline here: it has no CPU attention kernels (a GPU comparison is
still to be written).

Usage::

    python benchmarks/cp_scaling.py [--seqs 256 512 1024] [--steps 3] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from hp_cp_ep import ContextParallelAttention, shard_sequence
from hp_dtensor.testing import count_host_syncs

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common.py is beside it

from _common import spawn_ranks

HEADS, HEAD_DIM = 8, 32
MODES = ("ring", "allgather", "ulysses")


def _inputs(seq: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seq)
    return tuple(torch.randn(1, HEADS, seq, HEAD_DIM, generator=gen) for _ in range(4))


def _documents(seq: int) -> torch.Tensor:
    """``[1, seq]`` ids of packed documents of uneven lengths (crossing chunk boundaries)."""
    lengths, doc = [7, 29, 13, 51, 5, 37, 97], 0
    ids: list[int] = []
    while len(ids) < seq:
        ids += [doc] * lengths[doc % len(lengths)]
        doc += 1
    return torch.tensor([ids[:seq]])


def _peak_bytes(step: Any) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        step()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def _single_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> Any:
    def step() -> None:
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).backward(g)

    return step


def measure(mesh: Any, seqs: list[int], steps: int) -> dict[str, Any]:
    """This rank's figures on ``mesh`` (None: single-device SDPA only)."""
    out: dict[str, Any] = {}
    for seq in seqs:
        q, k, v, g = _inputs(seq)
        single = _single_step(q, k, v, g)
        if mesh is None:
            out[str(seq)] = {"single": {"peak": _peak_bytes(single)}}
            continue
        local = [shard_sequence(t, mesh, 2) for t in (q, k, v, g)]
        local_docs = shard_sequence(_documents(seq), mesh, 1)
        row = {}
        for mode in MODES:
            attn = ContextParallelAttention(mesh, mode=mode, load_balance=True)

            def cp_step(
                attn: ContextParallelAttention = attn, local: Any = local, docs: Any = None
            ) -> None:
                ql, kl, vl = (t.detach().requires_grad_() for t in local[:3])
                attn(ql, kl, vl, is_causal=True, document_ids=docs).backward(local[3])

            def doc_step(cp_step: Any = cp_step, docs: Any = local_docs) -> None:
                cp_step(docs=docs)

            cp_step()
            doc_step()
            single()  # warm-up
            peak, peak_docs = _peak_bytes(cp_step), _peak_bytes(doc_step)
            with count_host_syncs() as syncs_plain:
                cp_step()
            with count_host_syncs() as syncs_docs:
                doc_step()
            steps_of = {"cp": cp_step, "docs": doc_step, "single": single, "single2": single}
            times: dict[str, list[float]] = {name: [] for name in steps_of}
            for _ in range(steps):
                for name, fn in steps_of.items():
                    dist.barrier()
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            row[mode] = {
                "peak": peak,
                "peak_docs": peak_docs,
                "syncs": syncs_plain.total,
                "syncs_docs": syncs_docs.total,
                **{f"{name}_ms": 1e3 * statistics.median(t) for name, t in times.items()},
            }
        out[str(seq)] = row
    return out


def _merge(gathered: list[Any]) -> dict[str, Any]:
    """Largest peaks and sync counts, and the slowest rank's times, over ranks."""
    merged: dict[str, Any] = gathered[0]
    for seq, row in merged.items():
        for mode, entry in row.items():
            others = [g[seq][mode] for g in gathered]
            for key in ("peak", "peak_docs", "syncs", "syncs_docs"):
                entry[key] = max(o[key] for o in others)
            slow = max(others, key=lambda o: o["cp_ms"])
            for key in ("cp_ms", "docs_ms", "single_ms", "single2_ms"):
                entry[key] = slow[key]
    return merged


def worker(rank: int, ws: int, init_file: str, seqs: list[int], steps: int, out_file: str) -> None:
    """One spawn for every degree: cp = ws on the whole group, smaller cp on sub-meshes."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws)
    try:
        results: dict[str, Any] = {}
        if rank == 0:
            results["1"] = measure(None, seqs, steps)
        dist.barrier()
        cp = 2
        while cp <= ws:
            mesh = init_device_mesh("cpu", (ws // cp, cp), mesh_dim_names=("rest", "cp"))["cp"]
            result = measure(mesh, seqs, steps)
            gathered: list[Any] = [None] * ws
            dist.all_gather_object(gathered, result)
            results[str(cp)] = _merge(gathered)
            if rank == 0:
                print(f"cp={cp}: {json.dumps(results[str(cp)])}", flush=True)
            cp *= 2
        if rank == 0:
            Path(out_file).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _table(results: dict[str, Any], steps: int) -> str:
    seqs = list(results["cp"]["1"])
    lines = [
        "# hp-cp-ep context parallel: peak attention memory per rank and step time",
        "",
        f"Causal attention fwd+bwd, fp32, 1 x {HEADS} heads x head_dim {HEAD_DIM}, load-balanced "
        f"shards. cpu/gloo, 1 thread per rank, {os.cpu_count()} CPU cores shared by all ranks, "
        f"torch {torch.__version__}, {steps} timed steps. Memory: largest rank's peak tensor "
        "memory (MemTracker) as a fraction of single-device SDPA on the whole sequence (ideal "
        "1/cp for the sequence-sharded tensors). Time: slowest rank's median CP step / median "
        "single-device step in the same process (cores are shared: overhead, not speed-up).",
        "",
        "| seq | single MB | cp | mode | peak MB | memory / single | time / single | noise "
        "| syncs / call | docs: syncs / call | docs: peak / causal | docs: time / causal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for seq in seqs:
        single = results["cp"]["1"][seq]["single"]["peak"]
        for cp, by_seq in results["cp"].items():
            if cp == "1":
                continue
            for mode, e in by_seq[seq].items():
                lines.append(
                    f"| {seq} | {single / 2**20:.2f} | {cp} | {mode} | {e['peak'] / 2**20:.2f} | "
                    f"{e['peak'] / single:.3f} | {e['cp_ms'] / e['single_ms']:.2f} | "
                    f"{e['single2_ms'] / e['single_ms']:.2f} | {e['syncs']} | "
                    f"{e['syncs_docs']} | {e['peak_docs'] / e['peak']:.3f} | "
                    f"{e['docs_ms'] / e['cp_ms']:.2f} |"
                )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--ws", type=int, default=4, help="largest cp (a power of two)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, Any] = {
        "config": {
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "steps": args.steps,
            "device": "cpu",
            "backend": "gloo",
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
        },
        "cp": {},
    }
    results["cp"] = spawn_ranks(worker, args.ws, args.seqs, args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cp_scaling.json").write_text(json.dumps(results, indent=2) + "\n")
    table = _table(results, args.steps)
    (args.out / "cp_scaling.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
