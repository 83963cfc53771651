"""A memo of DTensor's expansion of single-mesh-dim sharding strategies, for pool workers.

DTensor computes the sharding of a ``_foreach_*`` op (the optimizer's and gradient clipping's)
element by element: each element's single-dim strategies are expanded over every mesh axis
(``expand_to_full_mesh_op_strategy``), and its sharding cache keys the whole list. A model's
parameters repeat a few shapes and placements, and the tests of a suite repeat a few models, yet
each new parameter list pays every element again: the first step of a 4-rank trainer test spent
most of its CPU time there (19.5 of 33.5 s in one suite's 4-rank jobs, 15.2 in foreach ops).

The expansion is a pure function of the mesh, the op, its arguments' shardings and metadata and
the strategies it is given. This memo keys on all of them, by value, and hands back a copy of the
stored result (callers write into the specs they select); an argument it cannot key by value
(an unhashable one, a validity callback) goes to DTensor uncached. Like DTensor's own caches it
keys meshes by equality, so it is cleared whenever those are (``_worker._clear_dtensor_caches``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from typing import Any

#: The expansion entry point, looked up on its module at each call by DTensor's single-dim path.
_ENTRY = "expand_to_full_mesh_op_strategy"


class _Unbound:
    """Stands for ``OpStrategy`` and ``torch.Tensor`` until they are bound: no value is one."""


#: ``OpStrategy`` and ``torch.Tensor``, bound by :meth:`ExpansionMemo.install` (torch is imported
#: there, not with this module: a worker sets its threads before it imports torch).
_TYPES: tuple[Any, Any] = (_Unbound, _Unbound)


class _UnkeyableError(Exception):
    """An argument without a value key: the call is not memoized."""


def _value_key(value: Any) -> Hashable:
    op_strategy, tensor = _TYPES
    if isinstance(value, op_strategy):
        return (
            "strategy",
            tuple((s.output_specs, _value_key(s.input_specs)) for s in value.strategies),
        )
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_value_key(v) for v in value))
    if isinstance(value, tensor):  # hashed by identity, compared by value: no key
        raise _UnkeyableError
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _value_key(v)) for k, v in value.items())))
    try:
        hash(value)
    except TypeError as exc:
        raise _UnkeyableError from exc
    return (type(value), value)  # 1, 1.0 and True hash alike but may choose differently


def _copy_strategy(strategy: Any) -> Any:
    specs = []
    for spec in strategy.strategies:
        fresh = copy.copy(spec)
        fresh.__dict__.pop("output_spec", None)  # cached properties: recomputed from the copy
        fresh.__dict__.pop("mesh", None)
        outputs = spec.output_specs
        fresh.output_specs = (
            tuple(copy.copy(o) for o in outputs)
            if isinstance(outputs, tuple)
            else copy.copy(outputs)
        )
        if spec.input_specs is not None:
            fresh.input_specs = [copy.copy(i) for i in spec.input_specs]
        if spec.redistribute_cost is not None:
            fresh.redistribute_cost = [list(row) for row in spec.redistribute_cost]
        specs.append(fresh)
    return _TYPES[0](specs)


class ExpansionMemo:
    """Memoizes ``expand_to_full_mesh_op_strategy`` by value while installed."""

    def __init__(self) -> None:
        self._results: dict[Hashable, Any] = {}
        self._original: Callable[..., Any] | None = None
        #: calls answered from the memo, and computed
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._results)

    @property
    def original(self) -> Callable[..., Any] | None:
        """DTensor's own expansion while the memo is installed (None otherwise)."""
        return self._original

    def install(self) -> None:
        """Route DTensor's expansion through the memo (once per process)."""
        global _TYPES
        import torch

        from hp_dtensor._torch_compat import OpStrategy, dtensor_ops_utils

        if self._original is not None:
            return
        _TYPES = (OpStrategy, torch.Tensor)
        original = getattr(dtensor_ops_utils, _ENTRY)
        self._original = original

        def memoized(mesh: Any, op_schema: Any, strategies: Any, **kwargs: Any) -> Any:
            compute = self._original or original  # the attribute: tests may record the calls
            try:
                if kwargs.get("is_valid_strategy_cb") is not None:
                    raise _UnkeyableError
                key = (
                    mesh,
                    op_schema.op,
                    _value_key(op_schema.args_schema),
                    _value_key(op_schema.kwargs_schema),
                    _value_key(strategies),
                    _value_key(kwargs),
                )
                hash(key)
            except (_UnkeyableError, TypeError):
                return compute(mesh, op_schema, strategies, **kwargs)
            result = self._results.get(key)
            if result is None:
                self.misses += 1
                result = self._results[key] = compute(mesh, op_schema, strategies, **kwargs)
            else:
                self.hits += 1
            return _copy_strategy(result) if isinstance(result, OpStrategy) else result

        setattr(dtensor_ops_utils, _ENTRY, memoized)

    def clear(self) -> None:
        """Forget every result (DTensor's caches were cleared: meshes may be new objects)."""
        self._results.clear()
