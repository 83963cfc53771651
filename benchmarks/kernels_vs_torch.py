"""Time each hp-kernels fused op against the sequence of torch ops it replaces.

For every op both implementations are built in one process and called alternately (ours,
torch, ours, ...) after a discarded warm-up; the median of each is taken, the run is repeated
with the order swapped (torch first), and the figure is the geometric mean of the two
``ours / torch`` median ratios (below 1 means ours is faster). A ``torch vs torch`` row shows the
noise floor. Absolute times are written too but only mean something on a quiet machine or a GPU.

The "torch" side is what PyTorch FSDP2 (or a plain implementation) runs today:

- all-gather copy-in, mixed precision: cast the fp32 shards into a flat bf16 buffer with one
  ``_foreach_copy_`` (FSDP2's ``_get_param_all_gather_inputs``), then ``torch.ops.fsdp.
  all_gather_copy_in`` into the all-gather buffer. Ours casts while packing, in one pass.
- all-gather copy-out: ``torch.ops.fsdp.split_with_sizes_copy`` + unpadded views.
- reduce-scatter copy-in: ``cat(chunk(g, ws, dim))`` for ``Shard(1)`` gradients, then
  ``torch._chunk_cat`` into the reduce dtype.
- post-reduce: ``div_`` in place, ``.to(param dtype)``, then ``grad += view`` per parameter.
- MoE permute / unpermute, attention merge: the direct torch expressions.

Usage::

    python benchmarks/kernels_vs_torch.py [--steps 30] [--device cpu] [--out benchmarks/results]
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
import torch.distributed.fsdp._fully_shard._fsdp_collectives  # registers torch.ops.fsdp.*

import hp_kernels as hk

WS = 4
# One transformer block of dim 256 (attention + MLP + norms), as an FSDP unit.
SHAPES: list[tuple[int, ...]] = [
    (768, 256),
    (768,),
    (256, 256),
    (256,),
    (1024, 256),
    (1024,),
    (256, 1024),
    (256,),
    (256,),
    (258, 256),  # uneven rows
]
SHARD_DIMS = [0, 0, 1, 0, 0, 0, 1, 0, 0, 0]


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def _time(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _compare(
    ours: Callable[[], Any], ref: Callable[[], Any], steps: int, device: torch.device
) -> dict[str, float]:
    ratios, medians = [], {"ours": [], "torch": []}
    for first in ("ours", "torch"):
        fns = {"ours": ours, "torch": ref}
        order = [first, "torch" if first == "ours" else "ours"]
        for name in order:  # warm-up
            for _ in range(3):
                fns[name]()
        times: dict[str, list[float]] = {"ours": [], "torch": []}
        for _ in range(steps):
            for name in order:
                times[name].append(_time(fns[name], device))
        m_ours, m_torch = statistics.median(times["ours"]), statistics.median(times["torch"])
        medians["ours"].append(m_ours)
        medians["torch"].append(m_torch)
        ratios.append(m_ours / m_torch)
    return {
        "ratio": math.sqrt(ratios[0] * ratios[1]),
        "ratio_ours_first": ratios[0],
        "ratio_torch_first": ratios[1],
        "median_ours_us": 1e6 * statistics.fmean(medians["ours"]),
        "median_torch_us": 1e6 * statistics.fmean(medians["torch"]),
    }


def _cases(device: torch.device) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=gen).to(device) for s in SHAPES]
    rank = 1
    shards, padded_shapes = [], []
    for full, dim in zip(fulls, SHARD_DIMS, strict=True):
        chunks = torch.chunk(full, WS, dim=dim)
        shards.append(chunks[rank].contiguous())
        padded_shapes.append(list(chunks[0].shape))
    splits = [math.prod(p) for p in padded_shapes]
    total = sum(splits)

    def ag_in_ours() -> Any:
        return hk.all_gather_copy_in(padded, splits, WS, rank, torch.bfloat16)

    def ag_in_torch() -> Any:
        # FSDP2 with param_dtype=bf16: padded shards are stored padded, so numel == split.
        flat = torch.empty(total, dtype=torch.bfloat16, device=device)
        torch._foreach_copy_(list(torch.split(flat, splits)), padded)
        out = torch.empty(WS * total, dtype=torch.bfloat16, device=device)
        return torch.ops.fsdp.all_gather_copy_in(
            list(torch.split(flat, splits)), out, splits, total, rank
        )

    padded = []
    for s, n in zip(shards, splits, strict=True):
        p = torch.zeros(n, device=device)
        p[: s.numel()] = s.reshape(-1)
        padded.append(p)

    gathered = torch.randn(WS * total, generator=gen).to(device)

    # The unsharded-parameter storage is allocated once and reused every step (as in FSDP2).
    ag_outs = [torch.empty(WS * n, device=device) for n in splits]

    def ag_out_ours() -> Any:
        hk.all_gather_copy_out(gathered, splits, WS, ag_outs)
        return ag_outs

    def ag_out_torch() -> Any:
        torch.ops.fsdp.split_with_sizes_copy(
            gathered.view(WS, -1), splits, dim=1, out=[o.view(WS, -1) for o in ag_outs]
        )
        return ag_outs

    def views_ours() -> Any:
        return [
            hk.unpadded_views(o, p, f.shape, d, WS)
            for o, p, f, d in zip(ag_outs, padded_shapes, fulls, SHARD_DIMS, strict=True)
        ]

    def views_torch() -> Any:
        result = []
        for o, p, f, d in zip(ag_outs, padded_shapes, fulls, SHARD_DIMS, strict=True):
            if d == 0:
                result.append(o.view(WS * p[0], *p[1:]).narrow(0, 0, f.shape[0]))
            else:
                chunks = torch.chunk(o.view(WS * p[0], *p[1:]), WS, dim=0)
                result.append(torch.cat(chunks, dim=d))
        return result

    grads = [f.to(torch.bfloat16) for f in fulls]

    def rs_in_ours() -> Any:
        return hk.reduce_scatter_copy_in(grads, SHARD_DIMS, WS, torch.float32)

    def rs_in_torch() -> Any:
        arranged = [
            torch.cat(torch.chunk(g, WS, dim=d), dim=0) if d else g
            for g, d in zip(grads, SHARD_DIMS, strict=True)
        ]
        n = hk.reduce_scatter_numel([g.shape for g in grads], SHARD_DIMS, WS)
        out = torch.empty(n, device=device)
        torch._chunk_cat(arranged, 0, WS, out=out.view(WS, -1))
        return out

    per_rank = hk.reduce_scatter_numel(SHAPES, SHARD_DIMS, WS) // WS
    reduced = torch.randn(per_rank, generator=gen).to(device)
    flat_grad = torch.zeros(per_rank, dtype=torch.bfloat16, device=device)
    local_sizes = [p for p in padded_shapes]
    grad_views = []
    offset = 0
    for p in local_sizes:
        n = math.prod(p)
        grad_views.append(flat_grad[offset : offset + n].view(p))
        offset += n

    def post_ours() -> Any:
        return hk.post_reduce(
            reduced, divide_factor=WS, out_dtype=torch.bfloat16, accumulate_into=flat_grad
        )

    def post_torch() -> Any:
        out = reduced.clone()  # torch divides its reduce-scatter output in place
        out.div_(WS)
        out = out.to(torch.bfloat16)
        off = 0
        for g in grad_views:
            n = g.numel()
            g += torch.as_strided(out, g.shape, g.stride(), off)
            off += n
        return flat_grad

    def post_ours_fair() -> Any:
        out = reduced.clone()
        return hk.post_reduce(out, divide_factor=WS, inplace=True)

    def post_torch_fair() -> Any:
        out = reduced.clone()
        return out.div_(WS)

    tokens = torch.randn(512, 256, generator=gen).to(device)
    idx = torch.randint(0, 8, (512, 2), generator=gen).to(device)
    probs = torch.rand(512, 2, generator=gen).to(device)

    def perm_ours() -> Any:
        return hk.permute_tokens(tokens, idx, 8)

    def perm_torch() -> Any:
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        return tokens[order // 2], order, torch.bincount(flat, minlength=8)

    permuted, order, _ = hk.permute_tokens(tokens, idx, 8)

    def unperm_ours() -> Any:
        return hk.unpermute_tokens(permuted, order, probs)

    def unperm_torch() -> Any:
        out = torch.zeros_like(tokens)
        weighted = permuted * probs.reshape(-1)[order].unsqueeze(1)
        return out.index_add_(0, order // 2, weighted)

    oa, ob = (torch.randn(2, 8, 128, 64, generator=gen).to(device) for _ in range(2))
    la, lb = (torch.randn(2, 8, 128, generator=gen).to(device) for _ in range(2))

    def merge_ours() -> Any:
        return hk.merge_attention_partials(oa, la, ob, lb)

    def merge_torch() -> Any:
        lse = torch.logaddexp(la, lb)
        return torch.exp(la - lse).unsqueeze(-1) * oa + torch.exp(lb - lse).unsqueeze(-1) * ob, lse

    return {
        "torch vs torch (noise floor)": (rs_in_torch, rs_in_torch),
        "all_gather_copy_in (fp32 shards -> bf16)": (ag_in_ours, ag_in_torch),
        "all_gather_copy_out": (ag_out_ours, ag_out_torch),
        "unpadded_views (2x Shard(1) need a copy)": (views_ours, views_torch),
        "reduce_scatter_copy_in (bf16 -> fp32, 2x Shard(1))": (rs_in_ours, rs_in_torch),
        "post_reduce (div, cast, accumulate)": (post_ours, post_torch),
        "post_reduce inplace (div only)": (post_ours_fair, post_torch_fair),
        "permute_tokens (512 x 256, top-2 of 8)": (perm_ours, perm_torch),
        "unpermute_tokens (weighted)": (unperm_ours, unperm_torch),
        "merge_attention_partials (2x8x128x64)": (merge_ours, merge_torch),
    }


def main() -> None:
    """Run every case and write ``kernels.json`` and ``kernels.md``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--only", default="", help="run only the rows whose name contains this")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = {}
    for name, (ours, ref) in _cases(device).items():
        if args.only and args.only not in name and "noise" not in name:
            continue
        rows[name] = _compare(ours, ref, args.steps, device)
        print(f"{name:55s} ratio {rows[name]['ratio']:.3f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": str(device),
        "threads": args.threads,
        "steps": args.steps,
        "world_size_simulated": WS,
        "torch": torch.__version__,
        "statistic": "geometric mean of (median ours / median torch) over both call orders",
    }
    (out / "kernels.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "# hp-kernels vs the torch op sequence they replace",
        "",
        f"device {device}, {args.threads} thread(s), {args.steps} alternating steps per order, "
        f"torch {torch.__version__}. Ratio = ours / torch (below 1: ours faster), geometric mean "
        "of both call orders.",
        "",
        "| op | ratio | ours first | torch first | ours median (us) | torch median (us) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['ratio']:.3f} | {r['ratio_ours_first']:.3f} | "
            f"{r['ratio_torch_first']:.3f} | {r['median_ours_us']:.0f} | "
            f"{r['median_torch_us']:.0f} |"
        )
    (out / "kernels.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
