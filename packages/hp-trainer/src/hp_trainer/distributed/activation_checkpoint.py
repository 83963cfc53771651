"""Activation checkpointing and swap of transformer blocks: full, every N-th block, per op, swap.

Also HyperParallel's function-level API: :func:`~hp_trainer.checkpoint`, :func:`checkpoint_wrapper`,
:func:`~hp_trainer.swap` and :func:`swap_wrapper`.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from hp_trainer._torch_compat import (
    SAVED_PRIVATE_OPS,
    TorchDispatchMode,
    functorch_config,
    ptd_checkpoint_wrapper,
    register_load_state_dict_pre_hook,
    register_state_dict_hook,
    tree_map,
    tree_map_only,
)
from hp_trainer.config import ActivationCheckpointConfig
from hp_trainer.distributed.swap import CheckpointPolicy as HPCheckpointPolicy
from hp_trainer.distributed.swap import SwapGroup, SwapManager

__all__ = ["apply_ac", "checkpoint", "checkpoint_wrapper", "swap", "swap_wrapper"]

# Ops whose outputs selective per-op AC keeps: compute-heavy kernels and communication.
_SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten.max.default,
    *SAVED_PRIVATE_OPS,
}


def _op_sac_context() -> Any:
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[f"{mode}_mm"] += 1
            # save every other matmul output, recompute the rest
            if counts[f"{mode}_mm"] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if func in _SAVE_LIST:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)  # type: ignore[no-untyped-call]


def _wrap(block: nn.Module, config: ActivationCheckpointConfig) -> nn.Module:
    if config.mode == "selective" and config.selective_ac_option == "op":
        return ptd_checkpoint_wrapper(
            block,
            context_fn=_op_sac_context,
            preserve_rng_state=config.preserve_rng_state,
        )
    return ptd_checkpoint_wrapper(block, preserve_rng_state=config.preserve_rng_state)


class _MemoryBudgetScope:
    """Sets the partitioner's activation memory budget while one block runs (and compiles).

    AOT autograd partitions the joint graph when the block's forward is compiled, i.e. inside
    the block's call; scoping the setting to the call leaves other blocks and models alone.
    """

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self._previous: list[float] = []

    def enter(self, module: nn.Module, args: Any) -> None:
        self._previous.append(functorch_config.activation_memory_budget)
        functorch_config.activation_memory_budget = self.budget

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        functorch_config.activation_memory_budget = self._previous.pop()


class _SwapScope:
    """Swaps one block's saved activations from module hooks (outside a compiled forward)."""

    def __init__(self, manager: SwapManager) -> None:
        self.manager = manager
        self._open: list[contextlib.AbstractContextManager[Any]] = []

    def enter(self, module: nn.Module, args: Any) -> None:
        region = self.manager.region()
        region.__enter__()
        self._open.append(region)

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self._open.pop().__exit__(None, None, None)


def apply_ac(model: nn.Module, ac_config: ActivationCheckpointConfig) -> None:
    """Apply activation checkpointing, swap or a memory budget to ``model.layers`` (in place).

    ``full`` recomputes every block in backward; ``selective`` with an integer N wraps every
    N-th block; ``selective`` with ``op`` keeps the outputs of matmuls (every other one),
    attention and communication ops and recomputes cheap element-wise ops. ``swap`` moves the
    saved activations of every ``every_n_layers``-th block to host memory (one
    :class:`~hp_trainer.SwapManager` for the model, so each block's activations are prefetched
    during the backward of the block after it). ``memory_budget`` makes ``torch.compile``'s min-cut
    partitioner keep ``memory_budget`` of the activations of every ``every_n_layers``-th block
    (the blocks must be compiled, :func:`~hp_trainer.apply_compile`).

    Args:
        model: A model with a ``layers`` ``ModuleDict``.
        ac_config: The ``[activation_checkpoint]`` section.

    Raises:
        ValueError: If ``mode`` is ``none`` (nothing to apply) or the model has no ``layers``.

    See Also:
        :titan:`torchtitan.distributed.activation_checkpoint.apply_ac`: TorchTitan's AC (its
        ``memory_budget`` mode sets :pt:`torch._functorch.config.activation_memory_budget`).
    """
    if ac_config.mode == "none":
        raise ValueError("apply_ac() called with activation_checkpoint.mode = 'none'")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError("activation checkpointing needs the model's blocks in model.layers")
    every = 1
    if ac_config.mode == "selective" and ac_config.selective_ac_option != "op":
        every = int(ac_config.selective_ac_option)
    elif ac_config.mode in ("swap", "memory_budget"):
        every = ac_config.every_n_layers
    manager = SwapManager() if ac_config.mode == "swap" else None
    for i, (name, block) in enumerate(list(layers.items())):
        if (i + 1) % every != 0 and every != 1:
            continue
        if manager is not None:
            swap_scope = _SwapScope(manager)
            block.register_forward_pre_hook(swap_scope.enter)
            block.register_forward_hook(swap_scope.exit, always_call=True)
        elif ac_config.mode == "memory_budget":
            scope = _MemoryBudgetScope(ac_config.memory_budget)
            block.register_forward_pre_hook(scope.enter)
            block.register_forward_hook(scope.exit, always_call=True)
        else:
            layers.register_module(name, _wrap(block, ac_config))


class _SwappedOutputs:
    """The swapped outputs of ``MUST_SWAP`` ops of one checkpointed call, by op, in call order.

    Filled from the policy wrapper (PyTorch's caching mode calls it after each op with the op's
    output); read back by :class:`_SwappedOutputRestore` during the recompute.
    """

    def __init__(self, group: SwapGroup) -> None:
        self.group = group
        # per op: for every call that reaches the recompute (not served from PyTorch's cache),
        # the swapped outputs' handles, or None for a call that is really recomputed
        self.calls: dict[Any, list[Any]] = defaultdict(list)

    def record(self, func: Any, output: Any, swapped: bool) -> None:
        if not swapped:
            self.calls[func].append(None)
            return
        manager = self.group.manager

        def add(t: torch.Tensor) -> Any:
            return self.group.add(t.detach()) if manager.can_swap(t) else t.detach()

        self.calls[func].append(tree_map_only(torch.Tensor, add, output))


class _SwappedOutputRestore(TorchDispatchMode):
    """Recompute side of ``MUST_SWAP``: returns the op's swapped-back output instead of running it.

    Enters PyTorch's recompute mode above itself, so it only sees the calls PyTorch recomputes;
    the swapped ones were recorded as recomputed for PyTorch and are answered here.
    """

    def __init__(self, outputs: _SwappedOutputs, torch_recompute: Any) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.outputs = outputs
        self.torch_recompute = torch_recompute
        self._seen: dict[Any, int] = defaultdict(int)

    def __enter__(self) -> _SwappedOutputRestore:
        self._seen.clear()  # a second backward (retain_graph) recomputes from the start
        super().__enter__()  # type: ignore[no-untyped-call]
        self.torch_recompute.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.torch_recompute.__exit__(*exc)
        super().__exit__(*exc)  # type: ignore[no-untyped-call]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        index = self._seen[func]
        self._seen[func] += 1
        calls = self.outputs.calls.get(func, [])
        saved = calls[index] if index < len(calls) else None
        if saved is None:
            return func(*args, **kwargs)
        return tree_map(self.outputs.group.restore, saved)


def _torch_policy_fn(
    policy_fn: Callable[..., Any], outputs: _SwappedOutputs | None
) -> Callable[..., Any]:
    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        value = policy_fn(ctx, func, *args, **kwargs)
        if not isinstance(value, CheckpointPolicy):
            value = HPCheckpointPolicy(value)
            if value is HPCheckpointPolicy.MUST_SWAP:
                if outputs is None:
                    raise RuntimeError(
                        f"checkpoint(): policy_fn returned MUST_SWAP for {func} with no swap "
                        "group; call checkpoint(..., policy_fn=...) rather than building "
                        "PyTorch's selective-checkpoint contexts from this policy"
                    )
                # PyTorch's cache keeps nothing: the recompute gets the output from host memory
                outputs.record(func, ctx.op_output, swapped=True)
                return CheckpointPolicy.PREFER_RECOMPUTE
            value = value.to_torch()
        if outputs is not None and value in _RECOMPUTED:
            outputs.record(func, None, swapped=False)
        return value

    return policy


_RECOMPUTED = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
# ops PyTorch's selective checkpointing neither asks the policy about nor caches
_SAC_IGNORED_OPS: frozenset[Any] = frozenset(
    getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", {torch.ops.aten.detach.default})
)


class _SwappedInputs:
    """A checkpointed call's tensor arguments, swapped to host once its forward has run them.

    The forward gets the caller's tensors; afterwards only the swap handles are kept, so the
    recompute gets tensors rebuilt from the loaded copies (same values, dtype, views and
    ``requires_grad``, so the recompute saves the same tensors as the forward).
    """

    def __init__(self, group: SwapGroup, args: tuple[Any, ...]) -> None:
        self.group = group
        self._live: tuple[Any, ...] | None = args
        manager = group.manager
        self._saved = tuple(
            group.add(a) if isinstance(a, torch.Tensor) and manager.can_swap(a) else a for a in args
        )

    def take(self) -> tuple[Any, ...]:
        """The arguments: the caller's tensors the first time, swapped-back copies after."""
        if self._live is not None:
            live, self._live = self._live, None
            return live
        return tuple(self._restore(a) for a in self._saved)

    def _restore(self, saved: Any) -> Any:
        return self.group.restore(saved, requires_grad=True)


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    swap_inputs: bool = False,
    policy_fn: Callable[..., Any] | None = None,
    context_fn: Callable[[], Any] | None = None,
    manager: SwapManager | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args)`` without keeping its activations; recompute them in backward.

    Non-reentrant PyTorch checkpointing. ``policy_fn`` makes it selective: it is called as
    ``policy_fn(ctx, op, *op_args, **op_kwargs)`` and returns a
    :class:`~hp_trainer.CheckpointPolicy`. An op whose policy is ``MUST_SWAP`` is neither
    recomputed nor kept on the device: its output is copied to host memory after the forward and
    loaded back for the recompute, which uses it instead of running the op. ``swap_inputs=True``
    moves the region's tensor arguments (what the recompute starts from) to host memory the same
    way. Both go through one :class:`~hp_trainer.SwapManager` group per call (side-stream
    copies, pooled host buffers, device storages dropped; on CPU a pass-through in memory terms
    that runs the same hooks).

    Args:
        fn: The function to checkpoint.
        *args: Its arguments.
        swap_inputs: Swap the tensor arguments to host memory until the recompute (a caller
            that drops its own references frees their device storages).
        policy_fn: Selective-checkpoint policy (PyTorch's four values or ``MUST_SWAP``).
        context_fn: PyTorch's ``context_fn`` (exclusive with ``policy_fn``).
        manager: Keyword-only extension: the :class:`~hp_trainer.SwapManager` of the swapped
            tensors, shared between layers so that each one's loads are prefetched during the
            backward of the layer after it (a new one per call by default).
        **kwargs: Passed to ``torch.utils.checkpoint.checkpoint`` (e.g. ``preserve_rng_state``).

    Returns:
        ``fn(*args)``.

    Raises:
        ValueError: If both ``policy_fn`` and ``context_fn`` are given, or swapping is asked
            with ``use_reentrant=True``.

    See Also:
        :pt:`torch.utils.checkpoint.checkpoint` and ``create_selective_checkpoint_contexts``;
        HyperParallel's ``checkpoint``.
    """
    if policy_fn is not None and context_fn is not None:
        raise ValueError("checkpoint(): give policy_fn or context_fn, not both")
    kwargs.setdefault("use_reentrant", False)
    swapping = swap_inputs or policy_fn is not None
    if swapping and kwargs["use_reentrant"]:
        raise ValueError(
            "checkpoint(): swap_inputs/policy_fn need use_reentrant=False, got use_reentrant=True"
        )
    if not swapping or not torch.is_grad_enabled():
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
        return torch_checkpoint(fn, *args, **kwargs)

    mgr = manager if manager is not None else SwapManager()
    group = mgr.new_group()
    outputs = _SwappedOutputs(group)
    if policy_fn is not None:
        torch_policy = _torch_policy_fn(policy_fn, outputs)

        def policy_context() -> Any:
            forward, recompute = create_selective_checkpoint_contexts(torch_policy)  # type: ignore[no-untyped-call]
            return forward, _SwappedOutputRestore(outputs, recompute)

        kwargs["context_fn"] = policy_context
    try:
        if not swap_inputs:
            return torch_checkpoint(fn, *args, **kwargs)
        inputs = _SwappedInputs(group, args)
        # PyTorch stashes the RNG state of its arguments' devices: hand it an empty tensor on
        # the inputs' device, as the recompute closure must not keep the caller's tensors
        devices = [a.device for a in args if isinstance(a, torch.Tensor)]
        del args
        markers = [torch.empty(0, device=devices[0])] if devices else []
        return torch_checkpoint(_run_with(fn, inputs), *markers, **kwargs)
    finally:
        mgr.finish_forward(group)


def _run_with(fn: Callable[..., Any], inputs: _SwappedInputs) -> Callable[..., Any]:
    def run(*_device_marker: torch.Tensor, **fn_kwargs: Any) -> Any:
        return fn(*inputs.take(), **fn_kwargs)

    return run


class _CheckpointedModule(nn.Module):
    """Runs the wrapped module through ``checkpoint`` (state-dict keys unchanged)."""

    def __init__(self, module: nn.Module, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.module = module
        self._checkpoint_kwargs = kwargs
        register_state_dict_hook(self, _strip_prefix)
        register_load_state_dict_pre_hook(self, _add_prefix)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.module, *args, **kwargs, **self._checkpoint_kwargs)


class _SwappedModule(nn.Module):
    """Runs the wrapped module through :meth:`SwapManager.swap_region`."""

    def __init__(
        self, module: nn.Module, manager: SwapManager, policy_fn: Callable[..., Any] | None
    ) -> None:
        super().__init__()
        self.module = module
        self.swap_manager = manager
        self._policy_fn = policy_fn
        register_state_dict_hook(self, _strip_prefix)
        register_load_state_dict_pre_hook(self, _add_prefix)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        def call(*a: Any) -> Any:
            return self.module(*a, **kwargs)

        return self.swap_manager.swap_region(call, *args, policy_fn=self._policy_fn)


def _strip_prefix(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
    inner = prefix + "module."
    for key in [k for k in state if k.startswith(inner)]:
        state[prefix + key[len(inner) :]] = state.pop(key)


def _add_prefix(state: dict[str, Any], prefix: str, *_: Any) -> None:
    inner = prefix + "module."
    for key in [k for k in state if k.startswith(prefix) and not k.startswith(inner)]:
        state[inner + key[len(prefix) :]] = state.pop(key)


def checkpoint_wrapper(module: nn.Module, **kwargs: Any) -> nn.Module:
    """Wrap a module so that its forward runs under :func:`~hp_trainer.checkpoint`.

    Args:
        module: The module.
        **kwargs: :func:`~hp_trainer.checkpoint` options (``policy_fn``, ``context_fn``, ...).

    Returns:
        The wrapper (its state-dict keys are the wrapped module's).

    See Also:
        :pt:`torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper`;
        HyperParallel's ``checkpoint_wrapper``.
    """
    return _CheckpointedModule(module, kwargs)


def swap(
    fn: Callable[..., Any],
    *args: Any,
    policy_fn: Callable[..., Any] | None = None,
    manager: SwapManager | None = None,
) -> Any:
    """Run ``fn(*args)`` with its saved activations moved to host memory until backward.

    Args:
        fn: The function.
        *args: Its arguments.
        policy_fn: ``(ctx, op, *args, **kwargs) -> CheckpointPolicy``: only outputs of ops
            returning ``MUST_SWAP`` are swapped; ``None`` swaps every saved activation.
        manager: Keyword-only extension: the :class:`~hp_trainer.SwapManager` that orders and
            prefetches consecutive calls (a new one per call by default, which prefetches nothing).

    Returns:
        ``fn(*args)``.

    See Also:
        :pt:`torch.autograd.graph.save_on_cpu`; HyperParallel's ``swap``. On CPU this is a
        pass-through in memory terms (see :class:`~hp_trainer.SwapManager`).
    """
    mgr = manager if manager is not None else SwapManager()
    return mgr.swap_region(fn, *args, policy_fn=policy_fn)


def swap_wrapper(
    module: nn.Module,
    policy_fn: Callable[..., Any] | None = None,
    *,
    manager: SwapManager | None = None,
) -> nn.Module:
    """Wrap a module so that its forward's saved activations are swapped to host memory.

    Args:
        module: The module.
        policy_fn: See :func:`~hp_trainer.swap`.
        manager: Keyword-only extension: share one :class:`~hp_trainer.SwapManager` between the
            blocks of a model so that each block's activations are prefetched during the
            backward of the block after it.

    Returns:
        The wrapper (its state-dict keys are the wrapped module's).

    See Also:
        HyperParallel's ``swap_wrapper``.
    """
    return _SwappedModule(module, manager if manager is not None else SwapManager(), policy_fn)
