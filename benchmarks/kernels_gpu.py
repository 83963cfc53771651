"""Time each hp-kernels Triton kernel against the torch op sequence it replaces, on a GPU.

Prepared for a CUDA machine with ``triton`` installed; it has not run on a GPU yet. For every
case it first checks the kernel's result against the torch sequence on the same device
(bitwise for the copy/cast/divide kernels, a tolerance for the combine and the merge), then
times both with CUDA events (median of ``--steps`` after a warm-up, which also runs Triton's
autotuning), and reports the ratio ``triton / torch`` and the achieved memory bandwidth of each
(bytes read + written / time) against the device's peak (from its memory clock and bus width,
or ``--peak-gbps``).

Usage::

    python benchmarks/kernels_gpu.py [--steps 50] [--scale 1] [--out benchmarks/results]
    TRITON_INTERPRET=1 python benchmarks/kernels_gpu.py --smoke   # CPU dry run, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import hp_kernels as hk
from hp_kernels.triton_kernels import launcher

# (triton, torch, bytes moved, parity check of the two results -> description)
Case = tuple[Callable[[], Any], Callable[[], Any], int, Callable[[Any, Any], str]]


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> str:
    return "bitwise" if torch.equal(a, b) else "MISMATCH"


def _first_bitwise(a: Any, b: Any) -> str:
    return _bitwise(a[0], b[0])


def _close(a: Any, b: Any) -> str:
    a, b = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
    return f"max abs diff {(a.float() - b.float()).abs().max().item():.1e}"


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    if device.type == "cpu":

        def cpu_time(fn: Callable[[], Any]) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        return cpu_time

    def gpu_time(fn: Callable[[], Any]) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return gpu_time


def _peak_bytes_per_s(device: torch.device, override_gbps: float | None) -> float | None:
    if override_gbps:
        return override_gbps * 1e9
    if device.type == "cpu":
        return None
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8  # double data rate


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _cases(device: torch.device, dim: int, tokens_n: int, seq: int, ws: int) -> dict[str, Case]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(3 * dim, dim), (dim,), (dim, dim), (4 * dim, dim), (dim, 4 * dim), (dim + 2, dim)]
    dims = [0, 0, 1, 0, 1, 0]
    fulls = [torch.randn(s, generator=gen).to(device) for s in shapes]
    padded_shapes = [list(torch.chunk(f, ws, d)[0].shape) for f, d in zip(fulls, dims, strict=True)]
    splits = [math.prod(p) for p in padded_shapes]
    total = sum(splits)
    shards = [torch.randn(n, generator=gen).to(device) for n in splits]  # fp32, padded
    cases: dict[str, Case] = {}

    # all-gather copy-in: fp32 shards -> bf16 buffer.
    ag_ours = torch.empty(ws * total, dtype=torch.bfloat16, device=device)
    ag_torch = torch.empty_like(ag_ours)

    def agin_torch() -> None:
        flat = torch.empty(total, dtype=torch.bfloat16, device=device)
        torch._foreach_copy_(list(torch.split(flat, splits)), shards)
        ag_torch.narrow(0, total, total).copy_(flat)

    cases["all_gather_copy_in (fp32 -> bf16)"] = (
        lambda: launcher("all_gather_copy_in")(shards, splits, 1, ag_ours),
        agin_torch,
        _nbytes(*shards) + 2 * total,
        lambda a, b: _bitwise(ag_ours.narrow(0, total, total), ag_torch.narrow(0, total, total)),
    )

    gathered = torch.randn(ws * total, generator=gen).to(device)
    outs_ours = [torch.empty(ws * n, device=device) for n in splits]
    outs_torch = [torch.empty_like(o) for o in outs_ours]
    cases["all_gather_copy_out"] = (
        lambda: launcher("all_gather_copy_out")(gathered, splits, ws, outs_ours),
        lambda: torch.split_with_sizes_copy(
            gathered.view(ws, -1), splits, dim=1, out=[o.view(ws, -1) for o in outs_torch]
        ),
        2 * _nbytes(gathered),
        lambda a, b: (
            "bitwise"
            if all(torch.equal(x, y) for x, y in zip(outs_ours, outs_torch, strict=True))
            else "MISMATCH"
        ),
    )

    grads = [f.to(torch.bfloat16) for f in fulls]
    numel = hk.reduce_scatter_numel([g.shape for g in grads], dims, ws)

    def rs_torch() -> torch.Tensor:
        arranged = [
            torch.cat(torch.chunk(g, ws, dim=d), dim=0) if d else g
            for g, d in zip(grads, dims, strict=True)
        ]
        out = torch.empty(numel, device=device)
        torch._chunk_cat(arranged, 0, ws, out=out.view(ws, -1))
        return out

    cases["reduce_scatter_copy_in (bf16 -> fp32)"] = (
        lambda: launcher("reduce_scatter_copy_in")(grads, dims, ws, torch.float32, None),
        rs_torch,
        _nbytes(*grads) + 4 * numel,
        _bitwise,
    )

    per_rank = numel // ws
    reduced = torch.randn(per_rank, generator=gen).to(device)
    main_ours = torch.zeros(per_rank, device=device)
    main_torch = torch.zeros_like(main_ours)

    def post_torch() -> None:
        main_torch.add_((reduced / 3).to(torch.bfloat16))

    cases["post_reduce (div 3, bf16 cast, fp32 accumulate)"] = (
        lambda: launcher("post_reduce_accumulate")(reduced, main_ours, 3.0, None, torch.bfloat16),
        post_torch,
        3 * _nbytes(reduced),
        lambda a, b: _bitwise(main_ours, main_torch),
    )

    tokens = torch.randn(tokens_n, dim, generator=gen).to(device, torch.bfloat16)
    idx = torch.randint(0, 8, (tokens.shape[0], 2), generator=gen).to(device)
    probs = torch.rand(tokens.shape[0], 2, generator=gen).to(device)
    permuted, order, _ = hk.reference_kernel("permute_tokens")(tokens, idx, 8)

    def perm_torch() -> Any:
        flat = idx.reshape(-1)
        sorted_idx = torch.argsort(flat, stable=True)
        return tokens[sorted_idx // 2], sorted_idx, torch.bincount(flat, minlength=8)

    cases["permute_tokens (top-2 of 8, bf16)"] = (
        lambda: launcher("permute_tokens")(tokens, idx, 8),
        perm_torch,
        3 * _nbytes(tokens),
        _first_bitwise,
    )

    def unperm_torch() -> torch.Tensor:
        out = torch.zeros_like(tokens)
        weighted = permuted * probs.reshape(-1)[order].unsqueeze(1).to(permuted.dtype)
        return out.index_add_(0, order // 2, weighted)

    cases["unpermute_tokens (weighted, bf16)"] = (
        lambda: launcher("unpermute_tokens")(permuted, order, probs, 2),
        unperm_torch,
        3 * _nbytes(tokens),
        _close,
    )

    aligned, positions, _ = hk.reference_kernel("permute_tokens_aligned")(tokens, idx, 8, 16)
    capacity = aligned.shape[0]

    def perm_aligned_torch() -> torch.Tensor:
        # TorchTitan's way: a zero row appended, then one gather by precomputed row indices.
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=8)
        padded = (counts + 15) // 16 * 16
        shift = (torch.cumsum(padded, 0) - padded) - (torch.cumsum(counts, 0) - counts)
        rows = torch.arange(flat.numel(), device=device) + shift[flat[order]]
        source = torch.full((capacity,), tokens.shape[0], device=device, dtype=torch.int64)
        source[rows] = order // 2
        padded_tokens = torch.vstack((tokens, tokens.new_zeros((1, tokens.shape[1]))))
        return padded_tokens[source]

    cases["permute_tokens_aligned (top-2 of 8, align 16, bf16)"] = (
        lambda: launcher("permute_tokens_aligned")(tokens, idx, 8, 16),
        perm_aligned_torch,
        3 * _nbytes(tokens),
        lambda a, b: _bitwise(a[0], b),
    )

    def combine_torch() -> torch.Tensor:
        rows = aligned.index_select(0, positions).view(-1, 2, aligned.shape[1])
        return (rows * probs.unsqueeze(-1).to(rows.dtype)).sum(1)

    cases["combine_tokens (aligned layout, weighted, bf16)"] = (
        lambda: launcher("combine_tokens")(aligned, positions, probs, 2),
        combine_torch,
        3 * _nbytes(tokens),
        _close,
    )

    oa, ob = (torch.randn(4, 16, seq, 128, generator=gen).to(device) for _ in range(2))
    la, lb = (torch.randn(4, 16, seq, generator=gen).to(device) for _ in range(2))

    def merge_torch() -> Any:
        lse = torch.logaddexp(la, lb)
        return torch.exp(la - lse).unsqueeze(-1) * oa + torch.exp(lb - lse).unsqueeze(-1) * ob, lse

    cases["merge_attention_partials (fp32)"] = (
        lambda: launcher("merge_attention_partials")(oa, la, ob, lb),
        merge_torch,
        3 * _nbytes(oa),
        _close,
    )
    return cases


def main() -> None:
    """Run every case and write ``kernels_gpu.json`` and ``kernels_gpu.md``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dim", type=int, default=1024, help="model width")
    parser.add_argument("--tokens", type=int, default=16384, help="MoE tokens")
    parser.add_argument("--seq", type=int, default=4096, help="attention rows per head")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--peak-gbps", type=float, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (interpreter)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if args.smoke:
        device, args.dim, args.tokens, args.seq, args.steps = torch.device("cpu"), 16, 32, 8, 2
    elif not torch.cuda.is_available():
        raise SystemExit(
            "kernels_gpu.py needs a CUDA GPU and triton (or --smoke under TRITON_INTERPRET=1)"
        )
    else:
        device = torch.device("cuda")
    timer = _timer(device)
    cases = _cases(device, args.dim, args.tokens, args.seq, args.world_size)
    peak = _peak_bytes_per_s(device, args.peak_gbps)
    rows: dict[str, dict[str, Any]] = {}
    for name, (ours, ref, nbytes, check) in cases.items():
        parity = check(ours(), ref())
        for fn in (ours, ref):
            for _ in range(3):
                fn()
        t_ours = statistics.median(timer(ours) for _ in range(args.steps))
        t_torch = statistics.median(timer(ref) for _ in range(args.steps))
        row = {
            "parity": parity,
            "ratio": t_ours / t_torch,
            "triton_us": 1e6 * t_ours,
            "torch_us": 1e6 * t_torch,
            "triton_gbps": nbytes / t_ours / 1e9,
            "torch_gbps": nbytes / t_torch / 1e9,
        }
        if peak:
            row["triton_peak_fraction"] = nbytes / t_ours / peak
        rows[name] = row
        print(f"{name:50s} {parity:22s} ratio {row['ratio']:.3f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name() if device.type != "cpu" else "cpu (smoke)",
        "torch": torch.__version__,
        "steps": args.steps,
        "dim": args.dim,
        "tokens": args.tokens,
        "seq": args.seq,
        "world_size_simulated": args.world_size,
        "peak_gbps": None if peak is None else peak / 1e9,
    }
    suffix = "_smoke" if args.smoke else ""
    (out / f"kernels_gpu{suffix}.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n"
    )
    lines = [
        "# hp-kernels Triton kernels vs the torch sequence they replace (GPU)",
        "",
        f"{meta['device']}, torch {torch.__version__}, median of {args.steps} CUDA-event timings.",
        "",
        "| op | parity vs torch | ratio | triton us | torch us | triton GB/s | torch GB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['parity']} | {r['ratio']:.3f} | {r['triton_us']:.1f} | "
            f"{r['torch_us']:.1f} | {r['triton_gbps']:.0f} | {r['torch_gbps']:.0f} |"
        )
    (out / f"kernels_gpu{suffix}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
