"""Time hp-dcp's save and load against torch.distributed.checkpoint on the same state dict.

The state dict (a few hundred MB of fp32/bf16 tensors of mixed sizes, plus optimizer-style
scalars) is saved to a fresh directory and loaded back into preallocated tensors, alternating
implementations after a discarded warm-up, in one process (``no_dist``). hp-dcp does everything it
does in production: CRC-32 per item while writing, the checksum sidecar, the save lock, fsync
of files and directories, the commit by directory rename, and on load the allow-list unpickling,
path and size checks and checksum verification. torch uses its
default ``FileSystemWriter`` (fsync on) and ``FileSystemReader``. The median of each
implementation is taken, the run is repeated with the order swapped, and each figure is the
geometric mean of the two ``ours / torch`` ratios (below 1 means ours is faster). A
``torch vs torch`` row shows the noise floor. Absolute times depend on the disk and page cache.

With ``--zstd`` both implementations compress every item with PyTorch's ``ZStandard`` stream
extension (``FileSystemWriter(_extensions=[ZStandard()])``, needs ``zstandard``); hp-dcp's load
then also bounds each item's expansion by its size in the metadata. Results go to
``dcp_zstd.{json,md}``.

Usage::

    python benchmarks/dcp_vs_torch.py [--mb 300] [--reps 5] [--zstd] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as tdcp

import hp_dcp
from hp_dcp._checksum import CRC32_BACKEND


def make_state(total_mb: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    sd: dict[str, Any] = {}
    sizes = [4096 * 1024, 1024 * 1024, 256 * 1024, 4096]  # elements, cycled
    used, i = 0, 0
    while used < total_mb * 2**20:
        n = sizes[i % len(sizes)]
        dtype = torch.bfloat16 if i % 3 == 2 else torch.float32
        t = torch.randn(n, generator=g).to(dtype).reshape(-1, 64)
        sd[f"layers.{i}.weight"] = t
        sd[f"optim.{i}.step"] = torch.tensor(float(i))
        sd[f"optim.{i}.lr"] = 1e-3
        used += t.nbytes
        i += 1
    return sd


def empty_like(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else 0.0 for k, v in sd.items()}


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Return (wall seconds, CPU seconds of this process) of one call."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _compressed(save: Callable[..., Any], writer: type) -> Callable[..., Any]:
    """``save`` through ``writer(path, _extensions=[ZStandard()])``."""
    from torch.distributed.checkpoint._extension import ZStandard

    def run(sd: dict[str, Any], *, checkpoint_id: Path, no_dist: bool) -> Any:
        storage = writer(checkpoint_id, _extensions=[ZStandard()])
        return save(sd, storage_writer=storage, no_dist=no_dist)

    return run


def run_once(
    sd: dict[str, Any], root: Path, order: list[str], reps: int, zstd: bool = False
) -> dict[str, Any]:
    impls: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
        "hp": (hp_dcp.save, hp_dcp.load),
        "torch": (tdcp.save, tdcp.load),
        "torch2": (tdcp.save, tdcp.load),
    }
    if zstd:
        impls = {
            "hp": (_compressed(hp_dcp.save, hp_dcp.FileSystemWriter), hp_dcp.load),
            "torch": (_compressed(tdcp.save, tdcp.FileSystemWriter), tdcp.load),
            "torch2": (_compressed(tdcp.save, tdcp.FileSystemWriter), tdcp.load),
        }
    ops = ("save", "load", "save_cpu", "load_cpu")
    times: dict[str, dict[str, list[float]]] = {k: {op: [] for op in ops} for k in order}
    for rep in range(reps + 1):  # rep 0 is the warm-up
        for name in order:
            save, load = impls[name]
            path = root / f"{name}_{rep}"
            ts = _timed(functools.partial(save, sd, checkpoint_id=path, no_dist=True))
            target = empty_like(sd)
            tl = _timed(functools.partial(load, target, checkpoint_id=path, no_dist=True))
            assert torch.equal(target["layers.0.weight"], sd["layers.0.weight"])
            shutil.rmtree(path)
            if rep:
                times[name]["save"].append(ts[0])
                times[name]["load"].append(tl[0])
                times[name]["save_cpu"].append(ts[1])
                times[name]["load_cpu"].append(tl[1])
    return {k: {op: statistics.median(v) for op, v in d.items()} for k, d in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=300)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--zstd", action="store_true", help="compress with the ZStandard extension")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    sd = make_state(args.mb)
    nbytes = sum(v.nbytes for v in sd.values() if isinstance(v, torch.Tensor))
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        a = run_once(sd, Path(tmp), ["hp", "torch", "torch2"], args.reps, args.zstd)
        b = run_once(sd, Path(tmp), ["torch2", "torch", "hp"], args.reps, args.zstd)
    rows = {}
    for op in ("save", "load", "save_cpu", "load_cpu"):
        ours = math.sqrt((a["hp"][op] / a["torch"][op]) * (b["hp"][op] / b["torch"][op]))
        noise = math.sqrt((a["torch2"][op] / a["torch"][op]) * (b["torch2"][op] / b["torch"][op]))
        rows[op] = {
            "ratio_ours_over_torch": round(ours, 3),
            "ratio_torch_over_torch": round(noise, 3),
            "median_s_hp": round(statistics.mean([a["hp"][op], b["hp"][op]]), 4),
            "median_s_torch": round(statistics.mean([a["torch"][op], b["torch"][op]]), 4),
        }
    result = {
        "benchmark": "dcp_vs_torch" + ("_zstd" if args.zstd else ""),
        "state_dict_mb": round(nbytes / 2**20, 1),
        "tensors": sum(isinstance(v, torch.Tensor) for v in sd.values()),
        "reps": args.reps,
        "crc32_backend": CRC32_BACKEND,
        "torch": torch.__version__,
        "required_max_ratio": 1.1,
        "results": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "dcp_zstd" if args.zstd else "dcp"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        "# hp-dcp vs torch DCP (save / load, one process, fsync on"
        + (", ZStandard stream extension on both)" if args.zstd else ")"),
        "",
        f"State dict: {result['state_dict_mb']} MB in {result['tensors']} tensors plus scalars; "
        f"median of {args.reps} runs per implementation, order swapped, geometric mean.",
        "hp-dcp includes CRC-32 per item, the checksum sidecar, the save lock, fsync of every file",
        "and directory, the rename commit, and verified, path-confined, size-checked allow-list",
        f"loading (CRC-32 backend: {CRC32_BACKEND}). Rows ending in _cpu compare the process CPU",
        "time instead of the wall clock (steadier on a shared machine).",
        "",
        "| op | ours / torch | torch / torch (noise) | hp median s | torch median s |",
        "|---|---|---|---|---|",
    ]
    for op, r in rows.items():
        md.append(
            f"| {op} | {r['ratio_ours_over_torch']} | {r['ratio_torch_over_torch']} | "
            f"{r['median_s_hp']} | {r['median_s_torch']} |"
        )
    (args.out / f"{stem}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
