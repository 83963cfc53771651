"""Time a training step with hp-fsdp's ``fully_shard`` against PyTorch's FSDP2.

A small decoder-only transformer (tied embeddings) is sharded per block plus the root, once with
``hp_fsdp.fully_shard`` and once with ``torch.distributed.fsdp.fully_shard``, with the same mesh
and policy. Both copies live in the same processes (gloo, one intra-op thread per rank) and are
stepped alternately (forward, cross-entropy, backward, AdamW) after a discarded warm-up. The
median of each implementation is taken on every rank (the slowest rank counts); the run is
repeated with the build and call order swapped, and the figure is the geometric mean of the two
``ours / torch`` ratios (below 1 means ours is faster). A ``torch vs torch`` row shows the noise
floor. Peak tensor memory per rank is measured with a tensor-level tracker
(``torch.distributed._tools.mem_tracker.MemTracker``, not process RSS) over one step of each,
and collectives per step are counted, as is the deterministic host work of one step per unit:
Python function calls (all, and the FSDP engine's own) and ops dispatched, ours against torch's
(the measure to follow on a loaded machine, where times are noisy). Beside the wall-clock ratio
each row reports the ratio of process CPU time per step (all threads, summed over ranks), which
other load on the machine inflates far less. Absolute times only mean something on a quiet
machine or a GPU.

Rows of plain FSDP (one mesh dimension, fp32) also time a *bound*: what any FSDP with one
all-gather and one reduce-scatter per unit must do on this machine and nothing more. The same
model unsharded computes forward and backward, AdamW steps sharded DTensor parameters, and the
same collectives (9 all-gathers, 5 reduce-scatters per step, same sizes) with their necessary
copies (all-gather copy-in and copy-out, reduce-scatter packing) are all issued before the
forward, so they overlap compute as far as the cores allow: no hooks, no per-unit waits, no
resharding. ``bound / torch`` is the best ratio an FSDP engine could reach here.

``--counts`` times nothing: per unit and step it counts Python calls (all, engine), ops (all,
allocating, profiler ranges), DTensor and ``nn.Parameter`` constructions and page faults, and
takes the CPU time per step, for ours and torch's (``results/fsdp_counts.md``).

Usage::

    python benchmarks/fsdp_vs_torch.py [--steps 12] [--warmup 3] [--rows ws3 ...] [--out DIR]
    python benchmarks/fsdp_vs_torch.py --quick      # ws2, ws3, ws4, noise: 8 steps, 2 warm-up
    python benchmarks/fsdp_vs_torch.py --counts [--rows ws3]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import hp_fsdp

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common.py is beside it

from _common import TiedTransformer

VOCAB, DIM, HEADS, SEQ, BATCH, BLOCKS = 1000, 192, 6, 128, 4, 4
UNITS = BLOCKS + 1  # one fully_shard unit per block, plus the root


ROWS: dict[str, dict[str, Any]] = {
    "FSDP ws=2 fp32": {"world": 2, "mesh": (2,), "mp": False},
    "FSDP ws=2 bf16/fp32": {"world": 2, "mesh": (2,), "mp": True},
    "FSDP ws=3 fp32": {"world": 3, "mesh": (3,), "mp": False},
    "FSDP ws=4 fp32": {"world": 4, "mesh": (4,), "mp": False},
    "HSDP 2x2 fp32": {"world": 4, "mesh": (2, 2), "mp": False},
    "FSDP ws=4, MLP weights on a 2x2 HSDP mesh (two groups per block)": {
        "world": 4,
        "mesh": (4,),
        "mp": False,
        "mlp_mesh": (2, 2),
    },
    "torch vs torch ws=2 (noise floor)": {"world": 2, "mesh": (2,), "mp": False, "control": True},
}

#: Short names for ``--rows``.
ROW_ALIASES = {
    "ws2": "FSDP ws=2 fp32",
    "bf16": "FSDP ws=2 bf16/fp32",
    "ws3": "FSDP ws=3 fp32",
    "ws4": "FSDP ws=4 fp32",
    "hsdp": "HSDP 2x2 fp32",
    "mlp": "FSDP ws=4, MLP weights on a 2x2 HSDP mesh (two groups per block)",
    "noise": "torch vs torch ws=2 (noise floor)",
}


def _mlp_placement(api: Any, mlp_mesh: DeviceMesh) -> Callable[[nn.Parameter], Any]:
    """Send the MLP weights (4*DIM rows or columns) to their own HSDP mesh."""
    if api is hp_fsdp:
        result_cls, info_cls = hp_fsdp.ShardPlacementResult, hp_fsdp.HSDPMeshInfo
    else:
        from torch.distributed.fsdp._fully_shard import _fsdp_common as common

        result_cls, info_cls = common.ShardPlacementResult, common.HSDPMeshInfo
    info = info_cls(mlp_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)

    def placement(param: nn.Parameter) -> Any:
        return result_cls(None, info) if 4 * DIM in param.shape and param.ndim == 2 else None

    return placement


def _shard(
    model: TiedTransformer, api: Any, mesh: DeviceMesh, mp: bool, mlp_mesh: DeviceMesh | None = None
) -> None:
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mlp_mesh is not None:
        kwargs["shard_placement_fn"] = _mlp_placement(api, mlp_mesh)
    if mp:
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for layer in model.layers:
        api.fully_shard(layer, **kwargs)
    api.fully_shard(model, **kwargs)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _step_fn(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[int], None]:
    def step(i: int) -> None:
        tokens, targets = _batch(i)
        logits = model(tokens)
        F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()

    return step


def _count_collectives(step: Callable[[int], None], i: int) -> dict[str, int]:
    counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    names = {
        "all_gather_single": "all_gather",
        "reduce_scatter_single": "reduce_scatter",
        "all_reduce": "all_reduce",
    }
    originals = {name: getattr(dist, name) for name in names}

    def wrap(name: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[names[name]] += 1
            return originals[name](*args, **kwargs)

        return counted

    try:
        for name in names:
            setattr(dist, name, wrap(name))
        step(i)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return counts


def _peak_bytes(model: nn.Module, step: Callable[[int], None], i: int) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        step(i)
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


#: Ops that return a fresh tensor storage (what the caching allocator or malloc serves).
_ALLOC_OPS = frozenset(
    {
        "aten.empty.memory_format",
        "aten.empty_strided.default",
        "aten.new_empty.default",
        "aten.new_empty_strided.default",
        "aten.new_zeros.default",
        "aten.zeros.default",
        "aten.zeros_like.default",
        "aten.empty_like.default",
        "aten.clone.default",
        "aten._to_copy.default",
    }
)


class _OpCounter(TorchDispatchMode):
    """Counts the ops dispatched (aten, c10d, hp_kernels) inside the block, and of them the
    allocating ones and the profiler ranges (``record_function`` enters)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.count = 0
        self.allocs = 0
        self.ranges = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        name = str(func)
        if name in _ALLOC_OPS:
            self.allocs += 1
        elif name.startswith("profiler._record_function_enter"):
            self.ranges += 1
        return func(*args, **(kwargs or {}))


def _host_counts(step: Callable[[int], None], i: int) -> dict[str, int]:
    """Deterministic host work of one step: Python function calls and ops dispatched.

    Python calls are counted with ``sys.setprofile`` (every Python-level call, C calls apart),
    split into the FSDP engine's own frames (hp-fsdp / hp-kernels / hp-dtensor's device layer,
    or torch's ``_fully_shard``) and the rest, with the DTensor and ``nn.Parameter``
    constructions among them; ops with a dispatch mode over the next step (all, allocating,
    profiler ranges); minor page faults of the process over a third step (fresh memory the
    kernel maps and zeroes: a host cost outside Python).
    """
    engine_markers = ("hp_fsdp", "hp_kernels", "hp_dtensor", "_fully_shard", "_composable")
    counts = {"python_calls": 0, "engine_calls": 0, "dtensors": 0, "parameters": 0}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            counts["python_calls"] += 1
            code = frame.f_code
            filename = code.co_filename
            if any(marker in filename for marker in engine_markers):
                counts["engine_calls"] += 1
            elif code.co_name == "__new__" and filename.endswith(
                ("nn/parameter.py", "nn\\parameter.py")
            ):
                counts["parameters"] += 1

    # DTensor.__new__ is a C function (torch 2.13): count constructions with a wrapper whose
    # own frames are left out of the Python call counts.
    from torch.distributed.tensor import DTensor

    original_new = DTensor.__dict__["__new__"]
    native_new = DTensor.__new__

    def counted_new(*args: Any, **kwargs: Any) -> Any:
        counts["dtensors"] += 1
        return native_new(*args, **kwargs)

    DTensor.__new__ = counted_new  # type: ignore[method-assign]
    sys.setprofile(profile)
    try:
        step(i)
    finally:
        sys.setprofile(None)
        DTensor.__new__ = original_new  # type: ignore[method-assign]
    counts["python_calls"] -= counts["dtensors"]
    ops = _OpCounter()
    with ops:
        step(i + 1)
    counts["ops"] = ops.count
    counts["allocs"] = ops.allocs
    counts["ranges"] = ops.ranges
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else 0
    step(i + 2)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else 0
    counts["page_faults"] = after - before
    return counts


def _row_setup(row: dict[str, Any]) -> tuple[DeviceMesh, DeviceMesh | None, TiedTransformer]:
    """A row's mesh, its MLP mesh (or None) and the seeded unsharded model both engines copy."""
    mesh = init_device_mesh(
        "cpu", row["mesh"], mesh_dim_names=("replicate", "shard") if len(row["mesh"]) == 2 else None
    )
    mlp_mesh = None
    if "mlp_mesh" in row:
        mlp_mesh = init_device_mesh("cpu", row["mlp_mesh"], mesh_dim_names=("mlp_rep", "mlp_shard"))
    torch.manual_seed(0)
    base = TiedTransformer(VOCAB, DIM, HEADS, BLOCKS)
    return mesh, mlp_mesh, base


def _has_bound(row: dict[str, Any]) -> bool:
    """Whether the row is plain FSDP (1-D mesh, fp32, one group per unit): the bound's layout."""
    return (
        len(row["mesh"]) == 1 and not row["mp"] and "mlp_mesh" not in row and not row.get("control")
    )


def _bound_step(base: TiedTransformer, mesh: DeviceMesh) -> Callable[[int], None]:
    """The bound of an FSDP step (see the module docstring): compute, sharded AdamW, and the same
    collectives and copies, issued at once."""
    from torch.distributed.tensor import DTensor, Shard

    world, rank = mesh.size(), mesh.get_local_rank()
    group = mesh.get_group()
    model = copy.deepcopy(base)
    units = [list(layer.parameters()) for layer in model.layers]
    units.append([p for p in model.parameters() if all(p is not q for u in units for q in u)])
    shards = [
        [torch.zeros(-(-p.shape[0] // world), *p.shape[1:]).reshape(-1) for p in unit]
        for unit in units
    ]
    params = []
    for shard in (s for unit in shards for s in unit):
        param = nn.Parameter(DTensor.from_local(shard, mesh, [Shard(0)], run_check=False))
        param.grad = DTensor.from_local(torch.randn_like(shard), mesh, [Shard(0)], run_check=False)
        params.append(param)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    gathers = list(range(len(units))) + list(range(len(units) - 1))  # forward, backward (no root)

    @torch.no_grad()
    def issue() -> tuple[list[Any], list[tuple[int, torch.Tensor]]]:
        works, outputs = [], []
        for u in gathers:
            splits = [s.numel() for s in shards[u]]
            output = torch.empty(world * sum(splits))
            packed = output.narrow(0, rank * sum(splits), sum(splits))
            torch._foreach_copy_(list(packed.split_with_sizes(splits)), shards[u])
            works.append(dist.all_gather_single(output, packed, group=group, async_op=True))
            outputs.append((u, output))
        for u in range(len(units)):
            grads = [torch.empty(world * s.numel()).view(world, -1) for s in shards[u]]
            packed = torch.cat(grads, dim=1).view(-1)  # the reduce-scatter layout's bytes
            reduced = torch.empty(packed.numel() // world)
            works.append(
                dist.reduce_scatter_single(
                    reduced, packed, group=group, op=dist.ReduceOp.AVG, async_op=True
                )
            )
        return works, outputs

    @torch.no_grad()
    def finish(works: list[Any], outputs: list[tuple[int, torch.Tensor]]) -> None:
        for work in works:
            work.wait()
        for u, output in outputs:
            splits = [s.numel() for s in shards[u]]
            full = [torch.empty(world, n) for n in splits]
            torch.split_with_sizes_copy(output.view(world, -1), splits, dim=1, out=full)

    def step(i: int) -> None:
        works, outputs = issue()
        tokens, targets = _batch(i)
        logits = model(tokens)
        F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1)).backward()
        model.zero_grad(set_to_none=True)
        finish(works, outputs)
        opt.step()

    return step


def run_row(row: dict[str, Any], steps: int, warmup: int, ours_first: bool) -> dict[str, Any]:
    """One order of one row, on every rank; returns this rank's medians and peaks."""
    mesh, mlp_mesh, base = _row_setup(row)
    built: dict[str, tuple[nn.Module, Callable[[int], None]]] = {}
    control = bool(row.get("control"))
    order = ["ours", "torch"] if ours_first else ["torch", "ours"]
    for name in order:
        model = copy.deepcopy(base)
        api = torch_fsdp if (name == "torch" or control) else hp_fsdp
        _shard(model, api, mesh, row["mp"], mlp_mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        built[name] = (model, _step_fn(model, opt))
    stepped = list(order)
    if _has_bound(row):
        built["bound"] = (base, _bound_step(base, mesh))
        stepped.append("bound")
    times: dict[str, list[float]] = {name: [] for name in stepped}
    cpu: dict[str, list[float]] = {name: [] for name in stepped}
    for i in range(warmup + steps):
        for name in stepped:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            built[name][1](i)
            elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            if i >= warmup:
                times[name].append(elapsed)
                cpu[name].append(elapsed_cpu)
    result: dict[str, Any] = {name: statistics.median(ts) for name, ts in times.items()}
    for name in stepped:  # process CPU time (all threads): far less sensitive to load than wall
        result[f"{name}_cpu"] = statistics.median(cpu[name])
    for name in order:
        model, step = built[name]
        result[f"{name}_peak"] = _peak_bytes(model, step, warmup + steps)
        result[f"{name}_comms"] = _count_collectives(step, warmup + steps + 1)
        result[f"{name}_host"] = _host_counts(step, warmup + steps + 2)
    return result


def count_row(row: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    """Load-independent figures of one row on every rank (no wall-clock timing).

    Both implementations are built and stepped alternately; after the warm-up, each one's host
    counts (:func:`_host_counts`) and its CPU time per step (process and main thread, median
    over ``steps`` steps: CPU time, not wall time, so other processes on the machine inflate
    it much less than they inflate a step's duration) are taken. A third copy of the model,
    not sharded, runs the same forward and backward in between: each engine's main-thread CPU
    time of forward + backward minus that one is the FSDP work on the main thread (hooks,
    copies, collective calls), the compute left out.
    """
    mesh, mlp_mesh, base = _row_setup(row)
    control = bool(row.get("control"))
    built: dict[str, Callable[[int], None]] = {}
    models: dict[str, nn.Module] = {}
    for name in ("ours", "torch"):
        sharded = copy.deepcopy(base)
        api = torch_fsdp if (name == "torch" or control) else hp_fsdp
        _shard(sharded, api, mesh, row["mp"], mlp_mesh)
        opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3, foreach=True)
        built[name] = _step_fn(sharded, opt)
        models[name] = sharded
    plain = copy.deepcopy(base)
    if row["mp"]:  # the sharded copies compute in bf16
        plain = plain.to(torch.bfloat16)

    def forward_backward(model: nn.Module, i: int) -> float:
        tokens, targets = _batch(i)
        start = time.thread_time()
        logits = model(tokens)
        F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1)).backward()
        return time.thread_time() - start

    cpu: dict[str, list[float]] = {name: [] for name in built}
    main: dict[str, list[float]] = {name: [] for name in built}
    fwd_bwd: dict[str, list[float]] = {name: [] for name in (*built, "plain")}
    for i in range(warmup + steps):
        for name, model in (*models.items(), ("plain", plain)):
            dist.barrier()
            elapsed = forward_backward(model, i)
            model.zero_grad(set_to_none=True)
            if i >= warmup:
                fwd_bwd[name].append(elapsed)
        for name, step in built.items():  # last: the counted steps follow a whole step
            dist.barrier()
            p0, t0 = time.process_time(), time.thread_time()
            step(i)
            if i >= warmup:
                cpu[name].append(time.process_time() - p0)
                main[name].append(time.thread_time() - t0)
    result: dict[str, Any] = {}
    floor = statistics.median(fwd_bwd["plain"])
    for name, step in built.items():
        result[f"{name}_host"] = _host_counts(step, warmup + steps + 10)
        result[f"{name}_cpu_s"] = statistics.median(cpu[name])
        result[f"{name}_main_cpu_s"] = statistics.median(main[name])
        result[f"{name}_fsdp_main_cpu_s"] = statistics.median(fwd_bwd[name]) - floor
    return result


def _gather(results: list[dict[str, Any]]) -> dict[str, Any]:
    timed = ("ours", "torch", "bound") if "bound" in results[0] else ("ours", "torch")
    worst = {key: max(r[key] for r in results) for key in timed}
    peaks = {key: max(r[f"{key}_peak"] for r in results) for key in ("ours", "torch")}
    cpu = {f"{key}_cpu": sum(r[f"{key}_cpu"] for r in results) for key in timed}
    return {
        **worst,
        **cpu,
        "ours_peak": peaks["ours"],
        "torch_peak": peaks["torch"],
        "ours_comms": results[0]["ours_comms"],
        "torch_comms": results[0]["torch_comms"],
        "ours_host": results[0]["ours_host"],
        "torch_host": results[0]["torch_host"],
    }


def _bound_cell(entry: dict[str, Any]) -> str:
    ratio = entry.get("bound_time_ratio")
    return "-" if ratio is None else f"{ratio:.3f} ({entry['bound_cpu_time_ratio']:.3f})"


def _cpu_cell(entry: dict[str, Any]) -> str:
    ratio = entry.get("cpu_time_ratio")
    return "-" if ratio is None else f"{ratio:.3f}"


def _host_cells(entry: dict[str, Any]) -> str:
    ours, theirs = entry.get("ours_host_per_unit"), entry.get("torch_host_per_unit")
    if not ours or not theirs:
        return "- | - | - | - |"
    return (
        f"{ours['python_calls']:.0f} ({ours['engine_calls']:.0f}) | "
        f"{theirs['python_calls']:.0f} ({theirs['engine_calls']:.0f}) | "
        f"{ours['ops']:.0f} | {theirs['ops']:.0f} |"
    )


def _load() -> str:
    """The 1-minute load average (``uptime``), where the platform has one."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except (AttributeError, OSError):
        return "n/a"


def _resolve_rows(names: list[str]) -> list[str]:
    """Full row names from full names or short aliases (``ws3``, ``noise``, ...)."""
    rows = []
    for name in names:
        full = name if name in ROWS else ROW_ALIASES.get(name)
        if full is None:
            raise SystemExit(
                f"unknown row {name!r}; rows are {sorted(ROWS)} or aliases {sorted(ROW_ALIASES)}"
            )
        rows.append(full)
    return rows


def _print_counts(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    keys = ("engine_calls", "python_calls", "ops", "allocs", "ranges", "dtensors", "parameters")
    lines = [
        "# hp-fsdp vs torch FSDP2: host work per unit per step (rank 0; counts, not times)",
        "",
        f"Model: vocab {VOCAB}, dim {DIM}, {BLOCKS} blocks (+ root = {UNITS} units), seq {SEQ}, "
        f"batch {BATCH}; {args.warmup} warm-up and {args.steps} CPU-timed steps per engine.",
        "",
        "| configuration | engine | " + " | ".join(keys) + " | page faults/step | "
        "process CPU ms/step (all ranks) | main-thread CPU ms/step (all ranks) | "
        "FSDP main-thread CPU ms/step (all ranks) |",
        "|---|---|" + "---|" * (len(keys) + 4),
    ]
    for name in ROWS:
        entry = rows.get(name)
        if entry is None:
            continue
        for engine in ("ours", "torch"):
            host = entry[f"{engine}_host_per_unit"]
            lines.append(
                f"| {name} | {engine} | "
                + " | ".join(f"{host[k]:.1f}" for k in keys)
                + f" | {host['page_faults'] * UNITS:.0f} | {entry[f'{engine}_cpu_ms']:.1f} | "
                f"{entry[f'{engine}_main_cpu_ms']:.1f} | "
                f"{entry.get(f'{engine}_fsdp_main_cpu_ms', float('nan')):.1f} |"
            )
    lines.append("")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fsdp_counts.json").write_text(json.dumps(rows, indent=2) + "\n")
    (args.out / "fsdp_counts.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    from hp_dtensor.testing import run_distributed, shutdown_pool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per engine")
    parser.add_argument("--warmup", type=int, default=3, help="discarded steps per engine")
    parser.add_argument(
        "--rows",
        nargs="*",
        default=None,
        help=f"rows to run (full names or aliases {', '.join(ROW_ALIASES)}); default: all",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="short run: rows ws2 ws3 ws4 noise, 8 timed steps after 2 warm-up (unless given)",
    )
    parser.add_argument(
        "--counts",
        action="store_true",
        help="no timing: host work per unit per step (Python calls, ops, allocations, ranges, "
        "DTensor/Parameter constructions, page faults) and CPU time per step, ours and torch's; "
        "writes fsdp_counts.json/.md",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.quick:
        args.rows = args.rows or ["ws2", "ws3", "ws4", "noise"]
        if "--steps" not in sys.argv:
            args.steps = 8
        if "--warmup" not in sys.argv:
            args.warmup = 2
    args.rows = _resolve_rows(args.rows) if args.rows else list(ROWS)
    if args.counts:
        counted: dict[str, dict[str, Any]] = {}
        previous_counts = args.out / "fsdp_counts.json"
        if set(args.rows) != set(ROWS) and previous_counts.exists():  # update those rows only
            counted = json.loads(previous_counts.read_text())
        for name in sorted(args.rows, key=lambda n: ROWS[n]["world"]):
            row = ROWS[name]
            per_rank = run_distributed(
                count_row, row["world"], row, args.steps, args.warmup, timeout=900
            )
            counted[name] = {
                "load": _load(),
                **{
                    f"{engine}_host_per_unit": {
                        k: v / UNITS for k, v in per_rank[0][f"{engine}_host"].items()
                    }
                    for engine in ("ours", "torch")
                },
                **{
                    f"{engine}_{kind}_ms": 1e3 * sum(r[f"{engine}_{kind}_s"] for r in per_rank)
                    for engine in ("ours", "torch")
                    for kind in ("cpu", "main_cpu", "fsdp_main_cpu")
                },
            }
        shutdown_pool()
        _print_counts(counted, args)
        return
    report: dict[str, Any] = {
        "model": {"vocab": VOCAB, "dim": DIM, "blocks": BLOCKS, "seq": SEQ, "batch": BATCH},
        "steps": args.steps,
        "warmup": args.warmup,
        "rows": {},
    }
    previous = args.out / "fsdp.json"
    if set(args.rows) != set(ROWS) and previous.exists():  # a partial rerun updates its rows
        report["rows"] = json.loads(previous.read_text()).get("rows", {})
    for name in sorted(args.rows, key=lambda n: ROWS[n]["world"]):
        row = ROWS[name]
        orders = []
        for ours_first in (True, False):
            per_rank = run_distributed(
                run_row, row["world"], row, args.steps, args.warmup, ours_first, timeout=900
            )
            orders.append(_gather(per_rank))
        time_ratios = [o["ours"] / o["torch"] for o in orders]
        mem_ratios = [o["ours_peak"] / o["torch_peak"] for o in orders]
        cpu_ratios = [o["ours_cpu"] / o["torch_cpu"] for o in orders]
        bound: dict[str, Any] = {}
        if "bound" in orders[0]:
            bound_ratios = [o["bound"] / o["torch"] for o in orders]
            bound_cpu = [o["bound_cpu"] / o["torch_cpu"] for o in orders]
            bound = {
                "bound_time_ratio": math.sqrt(bound_ratios[0] * bound_ratios[1]),
                "bound_cpu_time_ratio": math.sqrt(bound_cpu[0] * bound_cpu[1]),
                "bound_median_s": [o["bound"] for o in orders],
            }
        entry = {
            "load_1min": _load(),  # wall-clock ratios are noise above ~1.5 on 2 cores
            "step_time_ratio": math.sqrt(time_ratios[0] * time_ratios[1]),
            # process CPU time per step, summed over ranks (all threads: compute, gloo, hooks)
            "cpu_time_ratio": math.sqrt(cpu_ratios[0] * cpu_ratios[1]),
            "peak_memory_ratio": math.sqrt(mem_ratios[0] * mem_ratios[1]),
            "timed_steps": args.steps,
            "ours_median_s": [o["ours"] for o in orders],
            "torch_median_s": [o["torch"] for o in orders],
            "ours_peak_bytes": orders[0]["ours_peak"],
            "torch_peak_bytes": orders[0]["torch_peak"],
            "ours_collectives_per_step": orders[0]["ours_comms"],
            "torch_collectives_per_step": orders[0]["torch_comms"],
            # deterministic host work per unit (BLOCKS + root) per step, rank 0
            "ours_host_per_unit": {k: v / UNITS for k, v in orders[0]["ours_host"].items()},
            "torch_host_per_unit": {k: v / UNITS for k, v in orders[0]["torch_host"].items()},
            **bound,
        }
        report["rows"][name] = entry
        print(
            f"{name}: time {entry['step_time_ratio']:.3f} (each order "
            f"{time_ratios[0]:.3f}, {time_ratios[1]:.3f}), CPU time {entry['cpu_time_ratio']:.3f}, "
            f"memory {entry['peak_memory_ratio']:.3f}, bound/torch {_bound_cell(entry)}, "
            f"load {_load()}",
            flush=True,
        )
    shutdown_pool()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fsdp.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# hp-fsdp vs torch FSDP2 (CPU, gloo, one thread per rank)",
        "",
        f"Model: vocab {VOCAB}, dim {DIM}, {BLOCKS} blocks, seq {SEQ}, batch {BATCH} per rank; "
        f"{args.steps} timed steps after {args.warmup} warm-up, both build orders.",
        "",
        "| configuration | step time ours/torch | process CPU time ours/torch | "
        "bound/torch step time (CPU time) | "
        "peak tensor memory ours/torch | "
        "collectives per step (AG/RS/AR) ours | torch | Python calls per unit per step "
        "(engine) ours | torch | ops per unit per step ours | torch |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ROWS:
        entry = report["rows"].get(name)
        if entry is None:
            continue
        oc, tc = entry["ours_collectives_per_step"], entry["torch_collectives_per_step"]
        lines.append(
            f"| {name} | {entry['step_time_ratio']:.3f} | {_cpu_cell(entry)} | "
            f"{_bound_cell(entry)} | "
            f"{entry['peak_memory_ratio']:.3f} | "
            f"{oc['all_gather']}/{oc['reduce_scatter']}/{oc['all_reduce']} | "
            f"{tc['all_gather']}/{tc['reduce_scatter']}/{tc['all_reduce']} | " + _host_cells(entry)
        )
    lines.append("")
    (args.out / "fsdp.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
