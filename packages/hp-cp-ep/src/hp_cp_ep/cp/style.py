"""HyperParallel's class-style context parallelism: a parallel style for an attention module.

``ContextParallel(...)`` is applied to the *core attention* module (the one whose forward takes
``q, k, v`` and calls ``F.scaled_dot_product_attention``) like any ``ParallelStyle``: its
``_apply(module, device_mesh)`` registers forward hooks that check the module's q/k/v inputs
(sequence length at ``seq_dim``, heads at ``head_dim``) and make the SDPA calls of that forward
context-parallel. The mode follows HyperParallel's ``ulysses_degree``: ``None`` (= the mesh
size) is pure Ulysses, ``1`` keeps heads whole and exchanges K/V (all-gather, or ring with
``kv_exchange="ring"``), and a 2-D mesh ``(outer, ulysses)`` gives the hybrids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from hp_cp_ep.cp._sdpa_redirect import SdpaRedirect
from hp_cp_ep.cp.attention import ContextParallelAttention

__all__ = ["AsyncContextParallel", "ContextParallel"]

_KV_EXCHANGES = ("allgather", "ring")


class _ForwardRedirect:
    """Per-module hook state: the redirect mode entered for the forward running now."""

    def __init__(self, style: ContextParallel, engine: ContextParallelAttention) -> None:
        self.style, self.engine = style, engine
        self.active: list[SdpaRedirect] = []

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.style._check_inputs(self.engine, args, kwargs)
        mode = SdpaRedirect(self.engine)
        mode.__enter__()  # type: ignore[no-untyped-call]
        self.active.append(mode)

    def after(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        if self.active:  # always_call: also runs when the forward raised
            self.active.pop().__exit__(None, None, None)  # type: ignore[no-untyped-call]


class ContextParallel(ParallelStyle):
    """Make an attention module's SDPA context-parallel over a mesh (HyperParallel's style).

    The module's inputs are this rank's sequence shard (shard them with
    :func:`shard_sequence`, ``load_balance`` matching); its output is this rank's shard.

    Args:
        seq_dim: Sequence dimension of the module's q/k/v inputs.
        head_dim: Head dimension of the module's q/k/v inputs.
        ulysses_degree: ``None``: pure Ulysses over a 1-D mesh; ``1``: no head split (K/V
            exchanged, see ``kv_exchange``); on a 2-D ``(outer, ulysses)`` mesh it must be
            ``None`` or ``mesh.size(1)``.
        qkv_indices: Positions of q, k, v in the module's positional arguments.
        qkv_kwarg_names: Names of q, k, v when passed by keyword (checked first).
        load_balance: The inputs are head-tail (zigzag) sharded.
        kv_exchange: Keyword-only extension: ``"allgather"`` (HyperParallel's) or ``"ring"``
            for the K/V exchange outside Ulysses.

    Raises:
        ValueError: Unknown ``kv_exchange``; at apply time a ``ulysses_degree`` that does not
            fit the mesh; at forward time inputs whose heads or length do not divide.

    Example:
        >>> # ContextParallel(seq_dim=2, head_dim=1, ulysses_degree=1)._apply(attn, cp_mesh)

    See Also:
        :pt:`torch.distributed.tensor.experimental.context_parallel`: PyTorch's functional CP;
        :pt:`torch.distributed.tensor.parallel.ParallelStyle`: the style protocol.
    """

    concurrent = False

    def __init__(
        self,
        seq_dim: int = 1,
        head_dim: int = 2,
        ulysses_degree: int | None = None,
        qkv_indices: Sequence[int] = (0, 1, 2),
        qkv_kwarg_names: Sequence[str] = (),
        load_balance: bool = False,
        *,
        kv_exchange: str = "allgather",
    ) -> None:
        super().__init__()
        if kv_exchange not in _KV_EXCHANGES:
            raise ValueError(f"kv_exchange must be one of {_KV_EXCHANGES}, got {kv_exchange!r}")
        if ulysses_degree is not None and ulysses_degree < 1:
            raise ValueError(f"ulysses_degree must be None or >= 1, got {ulysses_degree}")
        self.seq_dim, self.head_dim = seq_dim, head_dim
        self.ulysses_degree = ulysses_degree
        self.qkv_indices, self.qkv_kwarg_names = tuple(qkv_indices), tuple(qkv_kwarg_names)
        self.load_balance, self.kv_exchange = load_balance, kv_exchange

    def _mode(self, mesh: DeviceMesh) -> str:
        degree = self.ulysses_degree
        if mesh.ndim == 2:
            if degree not in (None, mesh.size(1)):
                raise ValueError(
                    f"on a 2-D (outer, ulysses) mesh ulysses_degree must be None or "
                    f"{mesh.size(1)}; got {degree}"
                )
            return "hybrid" if self.kv_exchange == "ring" else "allgather"
        if degree is None or (degree == mesh.size() and degree > 1):
            return "ulysses"
        if degree == 1:
            return self.kv_exchange
        raise ValueError(
            f"ulysses_degree {degree} on a 1-D mesh of {mesh.size()} ranks: pass a 2-D mesh "
            f"(outer, ulysses) with dim 1 of size {degree} for the hybrid"
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        mode = self._mode(device_mesh)
        if device_mesh.size() == 1:
            return module  # CP degree 1: nothing to do
        engine = ContextParallelAttention(
            device_mesh, mode=mode, load_balance=self.load_balance, concurrent=self.concurrent
        )
        state = _ForwardRedirect(self, engine)
        module.register_forward_pre_hook(state.before, with_kwargs=True)
        module.register_forward_hook(state.after, with_kwargs=True, always_call=True)
        return module

    def _check_inputs(
        self,
        engine: ContextParallelAttention,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
    ) -> None:
        named = [kwargs[n] for n in self.qkv_kwarg_names if n in kwargs]
        tensors = named or [args[i] for i in self.qkv_indices if i < len(args)]
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                continue
            heads, length = t.shape[self.head_dim], t.shape[self.seq_dim]
            # Query heads must split; K/V heads that do not are repeated by the engine.
            if i == 0 and engine.ulysses_size > 1 and heads % engine.ulysses_size:
                raise ValueError(
                    f"Ulysses splits heads: {heads} heads (dim {self.head_dim}) are not "
                    f"divisible by the Ulysses degree {engine.ulysses_size}"
                )
            engine.layout.check_length(length * engine.degree)


class AsyncContextParallel(ContextParallel):
    """:class:`ContextParallel` with the Q/K/V exchanges issued concurrently.

    The Ulysses all-to-alls of q, k and v (and the all-gathers of k and v) are all issued as
    asynchronous collectives before the first is awaited, instead of one after the other; the
    ring overlaps its hops with compute in both styles. Same arguments as
    :class:`ContextParallel`.

    See Also:
        :pt:`torch.distributed.tensor.experimental.context_parallel`
    """

    concurrent = True
