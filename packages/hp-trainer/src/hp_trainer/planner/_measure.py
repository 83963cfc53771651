"""Tensor-level measurement of one training step (the checks of the planner's predictions).

Peak device memory = the bytes of the tensors alive when the step starts (parameters, buffers,
gradients, optimizer state on the device) + the peak, over the step, of the bytes the calling
thread allocated and has not yet freed.

The profiler's allocator events are replayed in time order and matched by address: a block
counts from its allocation to its free, whichever thread frees it (a gloo worker may drop the
last reference to a tensor the calling thread allocated). Blocks allocated on other threads are
left out: gloo's transient buffers (a device backend's buffers are not the caching allocator's)
and the host thread of optimizer offload (host memory, not device memory). The allocator does
not report the free of a block allocated before the profiler started, so the tensors alive at
the start count throughout (:func:`step_peak` clears the gradients first for that reason).

An operator's own memory total (``FunctionEvent.self_cpu_memory_usage``) is not used: the
profiler adds to it every allocator event inside the operator's time interval, on any thread,
and it lands at the operator's start. Frees that come at an operator's end (an autograd node
releasing its saved tensors, the optimizer step) then count before the allocations they follow,
and another thread's events count on whichever operator was running: the peak above the start of
the same FSDP 4 + full AC step of the debug model read 41 MiB on one rank and 77 MiB on another
that way (35.7 MiB on both, replayed by address).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from hp_dtensor import DTensor
from hp_trainer.components.loss import IGNORE_INDEX

__all__ = [
    "StepPeak",
    "forward_backward_peak",
    "live_device_bytes",
    "peak_step_bytes",
    "saved_tensor_bytes",
    "step_peak_bytes",
    "timed",
]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _state_tensors(
    modules: Iterable[torch.nn.Module], optimizers: Iterable[Any]
) -> list[torch.Tensor]:
    from hp_trainer.distributed.offload import OffloadedOptimizersContainer

    tensors: list[torch.Tensor] = []
    for m in modules:
        for p in m.parameters():
            tensors.append(_local(p))
            if p.grad is not None:
                tensors.append(_local(p.grad))
        tensors += [_local(b) for b in m.buffers()]
    for container in optimizers:
        if isinstance(container, OffloadedOptimizersContainer):
            continue
        for opt in container:
            for state in opt.state.values():
                tensors += [_local(v) for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """Address -> bytes of the unique non-empty storages of ``tensors``."""
    out: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            out[storage.data_ptr()] = storage.nbytes()
    return out


def live_device_bytes(modules: Iterable[torch.nn.Module], optimizers: Iterable[Any]) -> int:
    """Bytes of the unique storages of parameters, buffers, gradients and device optimizer
    state (an offloaded container's state is host memory and is not counted)."""
    return sum(_storages(_state_tensors(modules, optimizers)).values())


@dataclass
class StepPeak:
    """Where the peak of a profiled region is.

    Attributes:
        peak: Bytes above the start at the peak (see :func:`peak_step_bytes`).
        at: The operator scopes around the allocation that reached the peak, outermost first.
        live: Bytes alive at the peak by the operator that allocated them (its innermost
            non-``aten`` scope and the ``aten`` operator), largest first.
    """

    peak: int = 0
    at: tuple[str, ...] = ()
    live: dict[str, int] = field(default_factory=dict)


def _allocator_events(prof: Any) -> list[tuple[int, int, int, int, tuple[str, ...]]]:
    """(time ns, bytes: + allocated / - freed, address, thread, enclosing op names) of every
    allocator event the profiler recorded, in time order."""
    results = getattr(prof.profiler, "kineto_results", None)
    tree = getattr(results, "experimental_event_tree", None)
    if tree is None:  # pragma: no cover - only on an unsupported torch
        raise RuntimeError(
            "tensor-level memory measurement needs the profiler's event tree "
            f"(kineto_results.experimental_event_tree), absent in torch {torch.__version__}"
        )
    out = []
    stack: list[tuple[Any, tuple[str, ...]]] = [(n, ()) for n in tree()]
    while stack:
        node, scopes = stack.pop()
        fields = node.extra_fields
        if hasattr(fields, "alloc_size") and hasattr(fields, "ptr"):
            out.append((node.start_time_ns, fields.alloc_size, fields.ptr, node.start_tid, scopes))
            continue
        stack += [(child, (*scopes, node.name)) for child in node.children]
    out.sort(key=lambda e: e[0])
    return out


def _site(scopes: tuple[str, ...]) -> str:
    outer = [s for s in scopes if not s.startswith("aten::")]
    op = next((s for s in reversed(scopes) if s.startswith("aten::")), "")
    return " > ".join(x for x in (outer[-1] if outer else "", op) if x) or "(outside any op)"


def profile_peak(fn: Callable[[], Any], *, exclude_threads: Iterable[int] = ()) -> StepPeak:
    """Run ``fn`` under the profiler and find the peak of its allocations (see the module).

    Args:
        fn: The region.
        exclude_threads: Threads whose frees are ignored too (the offload host thread).

    Returns:
        The peak above the start and what is alive there.
    """
    from torch.profiler import ProfilerActivity, profile

    excluded = set(exclude_threads)
    marker: list[int] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        probe = torch.empty(8)  # names the calling thread (its allocation event)
        marker.append(probe.untyped_storage().data_ptr())
        del probe
        fn()
    events = _allocator_events(prof)
    thread = next(e[3] for e in events if e[2] == marker[0] and e[1] > 0)
    blocks: dict[int, tuple[int, tuple[str, ...]]] = {}
    live = 0
    best = StepPeak()
    best_blocks: dict[int, tuple[int, tuple[str, ...]]] = {}
    for _, nbytes, ptr, tid, scopes in events:
        if tid in excluded:
            continue
        if nbytes > 0:
            if tid != thread:
                continue
            blocks[ptr] = (nbytes, scopes)
            live += nbytes
            if live > best.peak:
                best = StepPeak(live, scopes)
                best_blocks = dict(blocks)
        elif ptr in blocks:
            live -= blocks.pop(ptr)[0]
    by_site: dict[str, int] = {}
    for nbytes, scopes in best_blocks.values():
        by_site[_site(scopes)] = by_site.get(_site(scopes), 0) + nbytes
    best.live = dict(sorted(by_site.items(), key=lambda kv: -kv[1]))
    return best


def peak_step_bytes(fn: Callable[[], Any], *, exclude_threads: Iterable[int] = ()) -> int:
    """Peak of the bytes the calling thread allocated and has not freed while ``fn`` runs.

    Allocations count on the calling thread only (gloo's workers allocate their own transient
    buffers); a block's free counts on every thread but ``exclude_threads`` (a gloo worker may
    drop the last reference to a tensor the calling thread allocated; the offload host thread
    frees host memory only).
    """
    return profile_peak(fn, exclude_threads=exclude_threads).peak


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_peak(trainer: Any, batch: Any) -> tuple[int, StepPeak, Any]:
    """(peak device bytes, where it is, what the step returned) of one
    ``trainer.train_step(batch)``.

    The gradients are cleared first (the step clears them anyway: the free of a block allocated
    before the profiler started is not reported) and cyclic garbage is collected, so that no
    tensor alive before the step is freed at a random point inside it.
    """
    import gc

    trainer.optimizers.zero_grad()
    gc.collect()
    base = live_device_bytes(trainer.model_parts, [trainer.optimizers])
    out: list[Any] = []
    host = getattr(trainer.optimizers, "host_thread_ids", ())
    gc.disable()
    try:
        where = profile_peak(lambda: out.append(trainer.train_step(batch)), exclude_threads=host)
    finally:
        gc.enable()
    return base + where.peak, where, out[0]


def step_peak_bytes(trainer: Any, batch: Any) -> tuple[int, Any]:
    """Peak device bytes of one ``trainer.train_step(batch)``, and what the step returned
    (see :func:`step_peak`)."""
    peak, _, result = step_peak(trainer, batch)
    return peak, result


def forward_backward_peak(trainer: Any, batch: Any) -> tuple[int, StepPeak]:
    """Peak device bytes of one forward + backward of ``batch`` (no optimizer step), and where
    it is: the tensors alive before it (parameters, buffers, device optimizer state; with
    ``offload.params`` only the buffers, the rest is host memory) + the peak of what it
    allocates."""
    import gc

    trainer.optimizers.zero_grad()
    gc.collect()
    if getattr(trainer, "param_offload", None) is None:
        base = live_device_bytes(trainer.model_parts, [trainer.optimizers])
    else:
        base = sum(b.untyped_storage().nbytes() for m in trainer.model_parts for b in m.buffers())
    inputs, labels = batch[0]
    tokens = (labels != IGNORE_INDEX).sum().float()
    gc.disable()
    try:
        where = profile_peak(lambda: trainer.forward_backward_step(inputs, labels, tokens))
    finally:
        gc.enable()
    return base + where.peak, where


def saved_tensor_bytes(
    fn: Callable[[], Any], *, exclude: Iterable[torch.Tensor] = ()
) -> tuple[int, list[tuple[tuple[int, ...], torch.dtype, int]]]:
    """Bytes of the unique storages autograd saves for the backward while ``fn`` runs (what a
    forward keeps alive for its backward), and each storage's (shape, dtype, bytes) as first
    saved, in order.

    Args:
        fn: The forward region.
        exclude: Tensors whose storages are not activations (parameters, the RoPE table).
    """
    skip = {_local(t).untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, tuple[tuple[int, ...], torch.dtype, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() and ptr not in skip and ptr not in seen:
            seen[ptr] = (tuple(t.shape), t.dtype, storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    rows = list(seen.values())
    return sum(r[2] for r in rows), rows
