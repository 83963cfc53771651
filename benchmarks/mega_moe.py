"""``hp_kernels.mega_moe`` (reference kernel, CPU) against the composed ops it fuses.

The composed side is what ``hp_cp_ep.MoE`` runs unfused on one device: ``permute_tokens``, the
grouped SwiGLU of ``GroupedExperts.compute`` (``torch._grouped_mm``) and ``unpermute_tokens``,
differentiated by autograd. One forward + backward per call; both sides built in one process and
called alternately after a discarded warm-up, the median of each, the run repeated with the order
swapped, and the figure the geometric mean of the two ``fused / composed`` ratios (a
``composed vs composed`` row gives the noise floor). Memory, counted exactly (no timing):

- saved for backward: bytes of the tensors autograd keeps between forward and backward
  (``torch.autograd.graph.saved_tensors_hooks``), the activation memory of a training step;
- forward allocations: bytes of every tensor the forward's ATen ops return;
- permuted copy: whether some op returns a ``[T k, dim]`` gather of the tokens (the reference
  does, as the composed ops do; the Triton kernel loads rows by index instead: see
  ``benchmarks/gpu/mega_moe_check.py`` and the interpreter test).

Usage::

    python benchmarks/mega_moe.py [--steps 15] [--out benchmarks/results]
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
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import hp_kernels as hk

TOKENS, TOPK, EXPERTS, DIM, HIDDEN = 512, 2, 8, 128, 256


def composed(
    x: torch.Tensor,
    idx: torch.Tensor,
    probs: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
) -> torch.Tensor:
    rows, order, counts = hk.permute_tokens(x, idx, w1.shape[0])
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gm = torch._grouped_mm
    hidden = F.silu(gm(rows, w1.transpose(-2, -1), offs=offs)) * gm(
        rows, w3.transpose(-2, -1), offs=offs
    )
    return hk.unpermute_tokens(gm(hidden, w2.transpose(-2, -1), offs=offs), order, probs)


def fused(
    x: torch.Tensor,
    idx: torch.Tensor,
    probs: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
) -> torch.Tensor:
    return hk.mega_moe(x, idx, probs, w1, w2, w3)


def inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, DIM, generator=gen).to(dtype).requires_grad_()
    idx = torch.randint(0, EXPERTS, (TOKENS, TOPK), generator=gen)
    probs = torch.rand(TOKENS, TOPK, generator=gen).to(dtype).requires_grad_()
    ws = [
        (torch.randn(shape, generator=gen) * 0.05).to(dtype).requires_grad_()
        for shape in ((EXPERTS, HIDDEN, DIM), (EXPERTS, DIM, HIDDEN), (EXPERTS, HIDDEN, DIM))
    ]
    return [x, idx, probs, *ws]


def step(fn: Callable[..., torch.Tensor], args: list[torch.Tensor]) -> None:
    out = fn(*args)
    leaves = [a for a in args if a.requires_grad]
    torch.autograd.grad(out, leaves, torch.ones_like(out))


def ratio(
    a: Callable[..., torch.Tensor], b: Callable[..., torch.Tensor], args: Any, steps: int
) -> float:
    ratios = []
    for order in ((a, b), (b, a)):
        times: dict[int, list[float]] = {id(a): [], id(b): []}
        for i in range(steps + 2):
            for fn in order:
                t0 = time.perf_counter()
                step(fn, args)
                if i >= 2:  # warm-up discarded
                    times[id(fn)].append(time.perf_counter() - t0)
        ratios.append(statistics.median(times[id(a)]) / statistics.median(times[id(b)]))
    return math.sqrt(ratios[0] * ratios[1])


class _Allocations(TorchDispatchMode):
    def __init__(self, gather_shape: tuple[int, int]) -> None:
        super().__init__()
        self.bytes = 0
        self.gather_shape = gather_shape
        self.permuted_copy = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "hp_kernels":  # enter the custom op: count its kernel's own ops
            with self:
                return hk.reference_kernel(func.overloadpacket.__name__)(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t._base is None:
                self.bytes += t.numel() * t.element_size()
                name = func.overloadpacket.__name__
                if name in ("index_select", "index") and tuple(t.shape) == self.gather_shape:
                    self.permuted_copy = True
        return out


def memory(fn: Callable[..., torch.Tensor], args: list[torch.Tensor]) -> dict[str, Any]:
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if not any(t is a for a in args):  # inputs are held by the caller anyway
            saved += t.numel() * t.element_size()
        return t

    alloc = _Allocations((TOKENS * TOPK, DIM))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), alloc:
        fn(*args)
    return {
        "saved_for_backward_bytes": saved,
        "forward_allocated_bytes": alloc.bytes,
        "permuted_copy_of_x": alloc.permuted_copy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        args = inputs(dtype)
        f_out, c_out = fused(*args), composed(*args)
        rows.append(
            {
                "dtype": str(dtype).replace("torch.", ""),
                "bitwise_equal": bool(torch.equal(f_out, c_out)),
                "time_ratio_fused_over_composed": round(
                    ratio(fused, composed, args, opts.steps), 3
                ),
                "noise_composed_over_composed": round(
                    ratio(composed, lambda *a: composed(*a), args, opts.steps), 3
                ),
                "fused": memory(fused, args),
                "composed": memory(composed, args),
            }
        )
    result = {
        "shape": {"tokens": TOKENS, "topk": TOPK, "experts": EXPERTS, "dim": DIM, "hidden": HIDDEN},
        "device": "cpu",
        "threads": 1,
        "torch": torch.__version__,
        "rows": rows,
    }
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "mega_moe.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# mega_moe (reference, CPU) vs composed ops: forward + backward",
        "",
        f"T={TOKENS}, k={TOPK}, E={EXPERTS}, dim={DIM}, hidden={HIDDEN}; one thread; "
        "ratio = geometric mean over both call orders of median(fused) / median(composed).",
        "",
        "| dtype | bitwise | time fused/composed | noise | saved for bwd fused / composed (MiB) "
        "| fwd allocations fused / composed (MiB) | permuted copy of x (fused) |",
        "|---|---|---|---|---|---|---|",
    ]
    mib = 1 << 20
    for r in rows:
        f, c = r["fused"], r["composed"]
        saved = [m["saved_for_backward_bytes"] / mib for m in (f, c)]
        allocated = [m["forward_allocated_bytes"] / mib for m in (f, c)]
        lines.append(
            f"| {r['dtype']} | {r['bitwise_equal']} | {r['time_ratio_fused_over_composed']} "
            f"| {r['noise_composed_over_composed']} | {saved[0]:.2f} / {saved[1]:.2f} "
            f"| {allocated[0]:.2f} / {allocated[1]:.2f} | {f['permuted_copy_of_x']} |"
        )
    (opts.out / "mega_moe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
