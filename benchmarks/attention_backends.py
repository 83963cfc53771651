"""Attention backends per mask kind on CPU: time and tensor memory against SDPA with a dense mask.

For each mask kind (causal, block_causal documents, sliding window, Llama 4 chunks, prefix) and
sequence length (1k, 4k), hp-trainer's attention backends run one attention of
``(batch 1, heads 4, seq, head_dim 64)`` fp32 against the baseline,
``F.scaled_dot_product_attention`` with the kind's dense boolean ``(seq x seq)`` mask:

- ``sdpa``: hp-trainer's SDPA lowering (SDPA's own causal path for plain causal, the dense mask
  otherwise), forward + backward;
- ``varlen``: cumulative sequence lengths; on CPU the reference (one SDPA call per segment,
  torch's ``varlen_attn`` being CUDA-only), forward + backward; a prefix has no varlen form;
- ``flex``: FlexAttention compiled (``torch.compile(flex_attention)``) with the batch's
  ``BlockMask``, **forward only**: torch 2.13 has no FlexAttention backward on CPU.

Statistic (as every benchmark here): both sides built in one process and called alternately
after a discarded warm-up, the median of each, the run repeated with the order swapped, the
geometric mean of the two ``backend / baseline`` ratios (below 1: faster). Peak tensor memory:
the tensors one call allocates at their peak (PyTorch's tensor-level ``MemTracker`` for eager
code; for compiled code, which allocates outside the dispatcher, the buffers the generated
wrapper allocates, counted by wrapping inductor's CPU allocation entry point while they live)
plus the mask the call needs (dense booleans for the baseline, the backend's lowered mask).
What must hold: block_causal memory of ``flex`` and ``varlen`` does not grow as ``seq^2``.

Usage::

    python benchmarks/attention_backends.py [--repeats 3] [--seqs 1024 4096]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hp_trainer.models.common.attention import AttentionMasks, MaskSpec, attention

B, H, D = 1, 4, 64
KINDS: dict[str, MaskSpec] = {
    "causal": MaskSpec(),
    "block_causal": MaskSpec(documents=True),
    "sliding_window_128": MaskSpec(sliding_window=128),
    "chunked_256": MaskSpec(chunk_size=256),
    "prefix_128": MaskSpec(prefix_length=128),
}


def _documents(seq: int) -> torch.Tensor:
    """Packed documents of 96..352 tokens (mean 224), as a batch of pretraining data packs."""
    lengths = [96, 224, 352, 160, 288]
    ids: list[int] = []
    doc = 0
    while len(ids) < seq:
        ids += [doc] * lengths[doc % len(lengths)]
        doc += 1
    return torch.tensor(ids[:seq]).view(1, seq)


def _peak_bytes(fn: Callable[[], Any]) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        fn()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


class _CompiledAllocations:
    """Peak bytes of the buffers compiled CPU code allocates (inductor's wrapper calls one entry
    point for them, bound when the generated module loads: installed before compiling)."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self.on = False
        guards: Any = torch._C._dynamo.guards
        self._original = guards._empty_strided_cpu
        guards._empty_strided_cpu = self._allocate

    def _allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        t: torch.Tensor = self._original(*args, **kwargs)
        if self.on:
            size = t.untyped_storage().nbytes()
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, size)
        return t

    def _free(self, size: int) -> None:
        self.live -= size

    def measure(self, fn: Callable[[], Any]) -> int:
        self.live = self.peak = 0
        self.on = True
        try:
            fn()
        finally:
            self.on = False
        return self.peak


_COMPILED = _CompiledAllocations()


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(o) for o in obj)
    if hasattr(obj, "as_tuple"):  # a FlexAttention BlockMask
        return _tensor_bytes(obj.as_tuple())
    fields = getattr(obj, "__dataclass_fields__", None)  # varlen segments
    return sum(_tensor_bytes(getattr(obj, f)) for f in fields) if fields else 0


def _compare(ours: Callable[[], Any], ref: Callable[[], Any], repeats: int) -> dict[str, float]:
    ratios, medians = [], {"ours": [], "ref": []}
    fns = {"ours": ours, "ref": ref}
    for first in ("ours", "ref"):
        order = [first, "ref" if first == "ours" else "ours"]
        for name in order:
            fns[name]()  # warm-up, discarded
        times: dict[str, list[float]] = {"ours": [], "ref": []}
        for _ in range(repeats):
            for name in order:
                t0 = time.perf_counter()
                fns[name]()
                times[name].append(time.perf_counter() - t0)
        m_ours, m_ref = statistics.median(times["ours"]), statistics.median(times["ref"])
        medians["ours"].append(m_ours)
        medians["ref"].append(m_ref)
        ratios.append(m_ours / m_ref)
    return {
        "ratio": math.sqrt(ratios[0] * ratios[1]),
        "ms": 1e3 * statistics.fmean(medians["ours"]),
        "baseline_ms": 1e3 * statistics.fmean(medians["ref"]),
    }


def _row(kind: str, spec: MaskSpec, seq: int, backend: str, repeats: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seq)
    q, k, v = (torch.randn(B, H, seq, D, generator=gen) for _ in range(3))
    docs = _documents(seq) if spec.documents else None
    dense = spec.dense(seq, docs, q.device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    forward_only = backend == "flex"

    def run(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            if forward_only:
                with torch.no_grad():
                    fn()
                return
            for t in leaves:
                t.grad = None
            fn().sum().backward()

        return step

    def baseline() -> torch.Tensor:
        qq, kk, vv = (q, k, v) if forward_only else leaves
        return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=dense)

    masks = AttentionMasks(backend, seq, batch_size=B, document_ids=docs)
    spec_for_batch = spec  # documents already in the kinds that have them
    lowered = masks.lowered(spec_for_batch)
    if backend == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        # a fresh Dynamo cache per row: each kind's mask_mod recompiles flex_attention, and past
        # Dynamo's recompile limit it would silently run eagerly (the math reference)
        torch._dynamo.reset()  # type: ignore[no-untyped-call]
        compiled = torch.compile(flex_attention, dynamic=False)
        t0 = time.perf_counter()
        compiled(q, k, v, block_mask=lowered)
        compile_s = time.perf_counter() - t0

        def ours() -> torch.Tensor:
            out: torch.Tensor = compiled(q, k, v, block_mask=lowered)
            return out
    else:
        compile_s = 0.0

        def ours() -> torch.Tensor:
            return attention(*leaves, spec=spec_for_batch, masks=masks)

    # the two implementations agree (the benchmark measures the same attention)
    with torch.no_grad():
        torch.testing.assert_close(ours(), baseline(), atol=1e-4, rtol=1e-4)
    timing = _compare(run(ours), run(baseline), repeats)
    mask_bytes = _tensor_bytes(lowered)
    row: dict[str, Any] = {
        "kind": kind,
        "seq": seq,
        "backend": backend,
        "measured": "forward" if forward_only else "forward+backward",
        **timing,
        "mask_bytes": mask_bytes,
        "dense_mask_bytes": _tensor_bytes(dense),
        "compile_s": compile_s,
    }
    measure = _COMPILED.measure if backend == "flex" else _peak_bytes
    row["peak_bytes"] = measure(run(ours)) + mask_bytes
    row["baseline_peak_bytes"] = _peak_bytes(run(baseline)) + row["dense_mask_bytes"]
    return row


def _markdown(rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    mib = 1024 * 1024

    def fmt(b: int | None) -> str:
        return "n/a" if b is None else f"{b / mib:.2f}"

    lines = [
        "# Attention backends vs SDPA with a dense mask (CPU)",
        "",
        f"batch {B}, {H} heads, head_dim {D}, fp32, {env['threads']} thread, torch "
        f"{env['torch']}, {env['repeats']} timed repeats per order ({env['note']}). Ratio = "
        "backend / dense-mask SDPA time, geometric mean of both call orders (below 1: faster). "
        "Peak (MiB) = tensors allocated at their peak during the measured call plus the mask "
        "it needs; flex is compiled and forward only (no CPU backward in torch 2.13), its "
        "baseline then forward only too.",
        "",
        "| kind | seq | backend | measured | ratio | ms | dense ms | peak MiB | dense peak MiB "
        "| mask MiB | dense mask MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(
                f"| {r['kind']} | {r['seq']} | {r['backend']} | {r['skipped']} | | | | | | | |"
            )
            continue
        lines.append(
            f"| {r['kind']} | {r['seq']} | {r['backend']} | {r['measured']} | {r['ratio']:.3f} "
            f"| {r['ms']:.1f} | {r['baseline_ms']:.1f} | {fmt(r['peak_bytes'])} "
            f"| {fmt(r['baseline_peak_bytes'])} | {r['mask_bytes'] / mib:.4f} "
            f"| {r['dense_mask_bytes'] / mib:.2f} |"
        )
    lines += ["", "## block_causal growth from the shortest to the longest sequence", ""]
    lines += ["| backend | seq ratio | peak ratio | seq^2 |", "|---|---|---|---|"]
    seqs = sorted({r["seq"] for r in rows})
    if len(seqs) > 1:
        lo, hi = seqs[0], seqs[-1]
        for backend in ("dense sdpa", "sdpa", "varlen", "flex"):
            pick = {}
            for r in rows:
                if r["kind"] != "block_causal" or "skipped" in r:
                    continue
                if backend == "dense sdpa" and r["backend"] == "sdpa":
                    pick[r["seq"]] = r["baseline_peak_bytes"]
                elif r["backend"] == backend:
                    pick[r["seq"]] = r["peak_bytes"]
            if lo in pick and hi in pick and pick[lo]:
                lines.append(
                    f"| {backend} | {hi / lo:.0f}x | {pick[hi] / pick[lo]:.1f}x | "
                    f"{(hi / lo) ** 2:.0f}x |"
                )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--backends", nargs="+", default=["sdpa", "varlen", "flex"])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS))
    parser.add_argument("--note", default="loaded shared machine: ratios indicative only")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--resume",
        type=Path,
        nargs="*",
        default=[],
        help="logs of earlier runs: their printed rows are kept, not measured again",
    )
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        help="rows not to run, as kind:seq:backend=reason",
    )
    args = parser.parse_args()
    done = {}
    for log in args.resume:
        for line in log.read_text().splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                done[(row["kind"], row["seq"], row["backend"])] = row
    skips = {}
    for item in args.skip:
        key, _, reason = item.partition("=")
        kind, seq, backend = key.split(":")
        skips[(kind, int(seq), backend)] = reason or "not run"
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    rows: list[dict[str, Any]] = []
    for seq in args.seqs:
        for kind in args.kinds:
            spec = KINDS[kind]
            for backend in args.backends:
                if (kind, seq, backend) in done:
                    rows.append(done[(kind, seq, backend)])
                    continue
                if (kind, seq, backend) in skips:
                    rows.append(
                        {"kind": kind, "seq": seq, "backend": backend,
                         "skipped": skips[(kind, seq, backend)]}
                    )  # fmt: skip
                    continue
                if backend == "varlen" and spec.varlen_error() is not None:
                    rows.append(
                        {"kind": kind, "seq": seq, "backend": backend, "skipped": "no varlen form"}
                    )
                    continue
                row = _row(kind, spec, seq, backend, args.repeats)
                rows.append(row)
                print(json.dumps(row), flush=True)
    env = {
        "threads": 1,
        "torch": torch.__version__,
        "repeats": args.repeats,
        "note": args.note,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_backends.json").write_text(
        json.dumps({"environment": env, "rows": rows}, indent=2) + "\n"
    )
    (args.out / "attention_backends.md").write_text(_markdown(rows, env))
    print(_markdown(rows, env))


if __name__ == "__main__":
    main()
