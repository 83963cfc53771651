"""``hp_kernels.mega_moe`` on a GPU: the Triton kernels against the composed ops.

One script for a machine with one CUDA GPU and ``triton`` installed (about a minute). For each
dtype (bfloat16, float32) and mode (probs weighting the outputs, or scaling the inputs) on a
DeepSeek-like layer slice (T=4096 tokens, top-8 of 64 experts, dim 2048, expert hidden 1408):

- parity: output and the five gradients of ``hk.mega_moe`` (dispatched to the Triton kernels,
  checked: ``shipped_device_kernels()["mega_moe"]`` holds ``cuda``) against the composed ops
  (``permute_tokens`` + ``torch._grouped_mm`` SwiGLU + ``unpermute_tokens``, autograd) and
  against the reference kernel called directly; reported as the max abs error over the max abs
  value (float32 expected below 1e-5, bfloat16 below 1e-2);
- time: forward + backward, CUDA events, median of 20 after 5 warm-ups, alternating the two
  sides, both orders; the ratio triton / composed (below 1: faster) and absolute milliseconds;
- memory: peak allocated bytes of one forward + backward (``torch.cuda.max_memory_allocated``
  above the inputs), and the saved-for-backward bytes;
- host syncs: ``count_host_syncs`` (device tensors: the GPU's) over forward + backward, and
  ``torch.cuda.set_sync_debug_mode("error")`` for one more step (expected: 0 and no error).

Without a GPU or triton it prints a line saying so and exits with status 0.

Usage::

    python benchmarks/gpu/mega_moe_check.py [--out mega_moe_gpu.json] [--small]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import hp_kernels as hk
from hp_dtensor.testing import count_host_syncs

SHAPES = {"tokens": 4096, "topk": 8, "experts": 64, "dim": 2048, "hidden": 1408}
SMALL = {"tokens": 512, "topk": 4, "experts": 16, "dim": 256, "hidden": 384}


def composed(x, idx, probs, w1, w2, w3, *, score_before_experts=False):  # type: ignore[no-untyped-def]
    rows, order, counts = hk.permute_tokens(x, idx, w1.shape[0])
    if score_before_experts:
        rows = rows * probs.reshape(-1)[order].unsqueeze(-1)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gm = torch._grouped_mm
    if x.dtype == torch.bfloat16:
        hidden = F.silu(gm(rows, w1.transpose(-2, -1), offs=offs)) * gm(
            rows, w3.transpose(-2, -1), offs=offs
        )
        out = gm(hidden, w2.transpose(-2, -1), offs=offs)
    else:  # torch._grouped_mm takes bfloat16 only on CUDA: the per-expert loop (host sync)
        parts = []
        for e, r in enumerate(torch.split(rows, counts.tolist())):
            parts.append((F.silu(r @ w1[e].t()) * (r @ w3[e].t())) @ w2[e].t())
        out = torch.cat(parts)
    if score_before_experts:
        return hk.unpermute_tokens(out, order, topk=idx.shape[1])
    return hk.unpermute_tokens(out, order, probs)


def fused(x, idx, probs, w1, w2, w3, *, score_before_experts=False):  # type: ignore[no-untyped-def]
    return hk.mega_moe(x, idx, probs, w1, w2, w3, score_before_experts=score_before_experts)


def make(shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    t, k, e, d, h = (shape[n] for n in ("tokens", "topk", "experts", "dim", "hidden"))
    x = torch.randn(t, d, generator=gen, device=device).to(dtype)
    scores = torch.rand(t, e, generator=gen, device=device)
    probs, idx = scores.topk(k, dim=-1)
    ws = [
        (torch.randn(s, generator=gen, device=device) * d**-0.5).to(dtype)
        for s in ((e, h, d), (e, d, h), (e, h, d))
    ]
    return [
        t.requires_grad_() if t.is_floating_point() else t for t in (x, idx, probs.to(dtype), *ws)
    ]


def step(fn: Callable[..., torch.Tensor], args: list[torch.Tensor], sbe: bool) -> list[Any]:
    out = fn(*args, score_before_experts=sbe)
    leaves = [a for a in args if a.requires_grad]
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    return [out.detach(), *grads]


def _bound(fn: Callable[..., torch.Tensor], args: list[torch.Tensor], sbe: bool) -> Any:
    return lambda: step(fn, args, sbe)


def timed(
    a: Callable[..., Any], b: Callable[..., Any], steps: int = 20
) -> tuple[float, float, float]:
    medians: dict[int, list[float]] = {id(a): [], id(b): []}
    for order in ((a, b), (b, a)):
        times: dict[int, list[float]] = {id(a): [], id(b): []}
        for i in range(steps + 5):
            for fn in order:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                if i >= 5:
                    times[id(fn)].append(start.elapsed_time(end))
        for key in medians:
            medians[key].append(statistics.median(times[key]))
    ma, mb = statistics.mean(medians[id(a)]), statistics.mean(medians[id(b)])
    ratio = (medians[id(a)][0] / medians[id(b)][0] * medians[id(a)][1] / medians[id(b)][1]) ** 0.5
    return ratio, ma, mb


def peak(fn: Callable[[], Any]) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("mega_moe_gpu.json"))
    parser.add_argument("--small", action="store_true", help="a small shape (smoke test)")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("mega_moe_check: no CUDA GPU here; nothing checked")
        return 0
    if "cuda" not in hk.shipped_device_kernels()["mega_moe"]:
        print("mega_moe_check: the Triton kernels are not registered (pip install triton)")
        return 0
    device = torch.device("cuda")
    shape = SMALL if opts.small else SHAPES
    rows: list[dict[str, Any]] = []
    for dtype in (torch.bfloat16, torch.float32):
        for sbe in (False, True):
            args = make(shape, dtype, device)
            ours = step(fused, args, sbe)
            ref = step(composed, args, sbe)
            with torch.no_grad():
                errors = [
                    float(
                        (a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)
                    )
                    for a, b in zip(ours, ref, strict=True)
                ]
            with count_host_syncs(device_tensors=lambda t: t.device.type == "cuda") as syncs:
                step(fused, args, sbe)
                torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                step(fused, args, sbe)
                sync_error = None
            except RuntimeError as err:
                sync_error = str(err)[:200]
            finally:
                torch.cuda.set_sync_debug_mode("default")
            run_ours = _bound(fused, args, sbe)
            run_ref = _bound(composed, args, sbe)
            ratio, ms_ours, ms_ref = timed(run_ours, run_ref)
            rows.append(
                {
                    "dtype": str(dtype).replace("torch.", ""),
                    "score_before_experts": sbe,
                    "relative_errors_out_x_probs_w1_w2_w3": errors,
                    "time_ratio_triton_over_composed": round(ratio, 3),
                    "ms_triton": round(ms_ours, 3),
                    "ms_composed": round(ms_ref, 3),
                    "peak_bytes_triton": peak(run_ours),
                    "peak_bytes_composed": peak(run_ref),
                    "host_syncs_triton": syncs.total,
                    "sync_debug_error": sync_error,
                }
            )
            print(json.dumps(rows[-1]))
    result = {"device": torch.cuda.get_device_name(), "shape": shape, "rows": rows}
    opts.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
