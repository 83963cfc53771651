"""A memo of DTensor's output-metadata propagation, for pool workers.

When its sharding cache misses, DTensor derives an op's global output shape, stride and dtype by
running the op on fake tensors built from the arguments' global metadata
(``ShardingPropagator._propagate_tensor_meta_non_cached``): a fake-tensor mode, one fake tensor
per argument (per element of a list: an optimizer step's op has six lists of parameters' size)
and a fake run. Its cache keys the whole call with the arguments' meshes and placements, so each
new layout of the same model pays again, although the answer depends only on the op and the
global metadata, which the layouts of one model share.

This memo keys on exactly what the fake arguments are built from (global shape, stride, dtype
and device type of every DTensor argument) and the other arguments by value. A call it cannot
key that way (a plain tensor argument, a symbolic size, an outer fake mode: a trace) goes to
DTensor uncached. Answers are immutable ``TensorMeta`` tuples; a list is handed out as a copy.
Cleared with DTensor's caches (``_worker._clear_dtensor_caches``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from hp_dtensor.testing._expansion_memo import _UnkeyableError, _value_key

#: The method on DTensor's sharding propagator that this memo wraps (an instance attribute).
ENTRY = "_propagate_tensor_meta_non_cached"


def _meta_key(value: Any, spec_type: Any) -> Hashable:
    import torch  # here, not at import: a worker sets its threads before it imports torch

    if isinstance(value, torch.Tensor):  # a plain tensor: no value key
        raise _UnkeyableError
    if isinstance(value, spec_type):
        meta = value.tensor_meta
        if meta is None or not all(type(n) is int for n in (*meta.shape, *meta.stride)):
            raise _UnkeyableError
        return ("spec", tuple(meta.shape), tuple(meta.stride), meta.dtype, value.mesh.device_type)
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_meta_key(v, spec_type) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _meta_key(v, spec_type)) for k, v in value.items())))
    return _value_key(value)  # raises for an unhashable value


class MetaMemo:
    """Memoizes DTensor's output-metadata propagation by value while installed."""

    def __init__(self) -> None:
        self._results: dict[Hashable, Any] = {}
        self._original: Callable[[Any], Any] | None = None
        #: calls answered from the memo, and computed
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._results)

    @property
    def original(self) -> Callable[[Any], Any] | None:
        """DTensor's own propagation while the memo is installed (None otherwise)."""
        return self._original

    def install(self) -> None:
        """Route the propagator's metadata propagation through the memo (once per process)."""
        from hp_dtensor._torch_compat import (
            DTensorSpec,
            detect_fake_mode,
            dtensor_sharding_propagator,
        )

        if self._original is not None:
            return
        propagator = dtensor_sharding_propagator
        original = getattr(propagator, ENTRY)
        self._original = original

        def memoized(op_schema: Any) -> Any:
            try:
                if detect_fake_mode() is not None:  # tracing: sizes may be symbolic
                    raise _UnkeyableError
                key = (
                    op_schema.op,
                    _meta_key(op_schema.args_schema, DTensorSpec),
                    _meta_key(op_schema.kwargs_schema, DTensorSpec),
                )
                hash(key)
            except (_UnkeyableError, TypeError):
                return original(op_schema)
            if key in self._results:
                self.hits += 1
                result = self._results[key]
            else:
                self.misses += 1
                result = self._results[key] = original(op_schema)
            return list(result) if isinstance(result, list) else result

        # an instance attribute: DTensor calls it as self._propagate_tensor_meta_non_cached
        setattr(propagator, ENTRY, memoized)

    def clear(self) -> None:
        """Forget every result (with DTensor's caches)."""
        self._results.clear()
