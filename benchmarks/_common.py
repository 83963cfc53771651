"""What several benchmarks share: the pre-norm transformer they train (block, tied-embedding
model), a free TCP port, the description of a CPU run, launching one process per rank that
writes its result to a JSON file, and timing trainers' steps in alternation.

Not a benchmark itself (``scripts/run_benchmarks.py`` skips files starting with ``_``); the
scripts run as ``python benchmarks/x.py`` and import it from their own folder (or, for
``benchmarks/gpu/``, from the folder above).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm causal self-attention and a GELU MLP (4x hidden), both residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TiedTransformer(nn.Module):
    """Token embedding, ``blocks`` :class:`Block` s, a final norm and an output head that shares
    the embedding's weight (tied embeddings)."""

    def __init__(self, vocab: int, dim: int, heads: int, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_environment() -> dict[str, Any]:
    """Where a CPU run measured: gloo, one intra-op thread per rank, torch version, cores."""
    return {
        "device": "cpu",
        "backend": "gloo",
        "threads_per_rank": 1,
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
    }


def spawn_ranks(worker: Callable[..., None], world: int, *args: Any) -> Any:
    """Run ``worker(rank, world, init_file, *args, out_file)`` on ``world`` processes and return
    the JSON that rank 0 wrote to ``out_file`` (``init_file`` is for ``file://`` rendezvous)."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = str(Path(tmp) / "result.json")
        init_file = str(Path(tmp) / "init")
        mp.spawn(worker, args=(world, init_file, *args, out_file), nprocs=world, join=True)
        return json.loads(Path(out_file).read_text())


def alternating_train_steps(
    trainers: Mapping[str, Any],
    batches: Mapping[str, Iterator[Any]],
    rounds: int,
    *,
    warmup: int,
    reverse_odd_rounds: bool = False,
) -> dict[str, list[float]]:
    """Time ``train_step`` of several trainers built in the same ranks, one step of each per
    round (in the mapping's order; reversed on odd rounds with ``reverse_odd_rounds``), a
    barrier of the default group before and after each step, the batch fetched outside the
    timing. Returns each trainer's seconds per step after the ``warmup`` rounds."""
    import torch.distributed as dist

    names = list(trainers)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds + warmup):
        order = names[::-1] if reverse_odd_rounds and r % 2 else names
        for name in order:
            batch = next(batches[name])
            dist.barrier()
            start = time.perf_counter()
            trainers[name].train_step(batch)
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    return {name: ts[warmup:] for name, ts in times.items()}
