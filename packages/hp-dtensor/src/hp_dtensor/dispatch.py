"""DTensor dispatch controls: run ops on local shards, and register custom sharding rules.

See Also:
    :pt:`torch.distributed.tensor.experimental.register_sharding`: torch's rule registration;
    :pt:`torch.distributed.tensor.experimental.local_map`: torch's per-function local execution.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import register_sharding
from torch.overrides import TorchFunctionMode

from hp_dtensor._torch_compat import (
    OpOverload,
    clear_native_sharding_propagator_cache,
    dtensor_sharding_propagator,
    tree_map,
)

__all__ = ["SkipDTensorDispatch", "register_sharding_rule", "sharding_rule"]

ShardingRule = Callable[..., Sequence[tuple[Sequence[Any], Sequence[Any]]]]


def _to_local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


class _LocalShardMode(TorchFunctionMode):
    """The torch-function mode behind :class:`SkipDTensorDispatch`."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        args = tree_map(_to_local, tuple(args))
        kwargs = tree_map(_to_local, kwargs or {})
        return func(*args, **kwargs)


class SkipDTensorDispatch:
    """A context in which ops on DTensors run on their local tensors and return plain tensors.

    Semantics inside the ``with`` block:

    - every torch function, ``Tensor`` method or property called with a DTensor argument sees
      that DTensor's local shard instead (through ``DTensor.to_local()``, which is differentiable:
      gradients flow back to the DTensor with its placements); results are plain tensors;
    - no sharding propagation and no communication happen; ``Partial`` values are seen as the
      raw per-rank partial values, ``.shape`` is the local shape;
    - in-place ops on a DTensor write its local shard;
    - ops without DTensor arguments are not affected; blocks nest; on exit DTensor dispatch is
      back to normal. The flag is a torch-function mode (per thread), nothing global.

    Example:
        .. code-block:: python

            with SkipDTensorDispatch():
                local_sum = dtensor.sum()  # this rank's shard only, a plain tensor

    See Also:
        :pt:`torch.distributed.tensor.experimental.local_map`: torch's per-function equivalent.
    """

    def __init__(self) -> None:
        self._modes: list[_LocalShardMode] = []

    def __enter__(self) -> SkipDTensorDispatch:
        mode = _LocalShardMode()
        mode.__enter__()  # type: ignore[no-untyped-call]
        self._modes.append(mode)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._modes.pop().__exit__(*exc_info)  # type: ignore[no-untyped-call]


def _overloads(op: OpOverload | Sequence[OpOverload]) -> list[OpOverload]:
    if isinstance(op, OpOverload):
        overloads = [op]
    elif isinstance(op, list | tuple):
        overloads = list(op)
    else:
        raise TypeError(
            f"a sharding rule is registered for an operator overload such as "
            f"torch.ops.aten.mm.default (or a list of them), got {op!r}"
        )
    if not overloads:
        raise ValueError("give at least one operator overload")
    for overload in overloads:
        if not isinstance(overload, OpOverload):
            raise TypeError(
                f"a sharding rule is registered for an operator overload such as "
                f"torch.ops.aten.mm.default, got {overload!r}"
            )
    return overloads


def _clear_propagation_cache() -> None:
    """Drop cached propagation results (Python LRU and the C++ fast path) after a rule change."""
    propagator = dtensor_sharding_propagator
    cache = getattr(propagator, "propagate_op_sharding", None)
    if cache is not None and hasattr(cache, "cache_clear"):
        cache.cache_clear()
    clear_native_sharding_propagator_cache()


def register_sharding_rule(
    op: OpOverload | Sequence[OpOverload], rule: ShardingRule
) -> ShardingRule:
    """Register a custom DTensor sharding rule for one or more operator overloads.

    ``rule`` receives the op's arguments with ``DTensorSpec`` in place of DTensors and returns
    the acceptable ``(output_placements, input_placements)`` pairs for one mesh dim, exactly as
    for torch's ``register_sharding`` (which this calls). Cached propagation results are cleared
    so that a replaced rule takes effect.

    Args:
        op: an ``OpOverload`` (for example ``torch.ops.aten.mm.default`` or a ``torch.library``
            custom op's ``.default``) or a list of them.
        rule: the rule.

    Returns:
        ``rule``.

    Raises:
        TypeError: when ``op`` is not an operator overload or ``rule`` is not callable.
        ValueError: when ``op`` is an empty list.

    See Also:
        :pt:`torch.distributed.tensor.experimental.register_sharding`: the decorator form.
    """
    overloads = _overloads(op)
    if not callable(rule):
        raise TypeError(f"rule must be callable, got {rule!r}")
    register_sharding(overloads)(rule)
    _clear_propagation_cache()
    return rule


@contextlib.contextmanager
def sharding_rule(op: OpOverload | Sequence[OpOverload], rule: ShardingRule) -> Iterator[None]:
    """Use a custom sharding rule inside a ``with`` block; the previous rule is restored after.

    Args:
        op: an operator overload or a list of them.
        rule: the rule (see :func:`register_sharding_rule`).

    Yields:
        Nothing.

    Raises:
        TypeError: when ``op`` is not an operator overload or ``rule`` is not callable.

    See Also:
        :pt:`torch.distributed.tensor.experimental.register_sharding`: permanent registration.
    """
    overloads = _overloads(op)
    propagator = dtensor_sharding_propagator
    saved = [
        (
            overload,
            propagator.op_strategy_funcs.get(overload),
            propagator.op_to_schema_info.get(overload),
        )
        for overload in overloads
    ]
    register_sharding_rule(overloads, rule)
    try:
        yield
    finally:
        for overload, strategy, schema_info in saved:
            if strategy is None:
                propagator.op_strategy_funcs.pop(overload, None)
            else:
                propagator.op_strategy_funcs[overload] = strategy
            if schema_info is None:
                propagator.op_to_schema_info.pop(overload, None)
            else:
                propagator.op_to_schema_info[overload] = schema_info
        _clear_propagation_cache()
