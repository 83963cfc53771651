"""``ShardingConfig``: how a model's modules are sharded, declared as data next to the modules.

A family declares, per FQN pattern, the parallel style each matching module gets
(:class:`ShardingRule`); :func:`hp_trainer.distributed.sharding.apply_sharding` turns the table
into one :func:`hp_tp.parallelize_module` call. A pattern is a dotted FQN where ``*`` stands for
one name (``layers.*.attention.wq``); a module the model does not have (a pipeline stage without
the LM head, a decoder without QK-norm) simply matches nothing. A style that depends on the job
(the LM head's output under loss parallel) is built from the applier's options.

See Also:
    :titan:`torchtitan.protocols.module`: TorchTitan's module protocol; HyperParallel's
    ``dmodule`` sharding plans.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ShardingConfig", "ShardingRule"]

StyleFactory = Callable[[Mapping[str, Any]], Any]
"""Builds a fresh parallel style for one module from the applier's options."""


@dataclass(frozen=True)
class ShardingRule:
    """One row of a sharding table: modules matching ``pattern`` get ``style(options)``.

    Args:
        pattern: Dotted FQN relative to the model; ``*`` matches one name.
        style: ``fn(options) -> ParallelStyle``, called once per matching module.

    Raises:
        ValueError: An empty pattern or an empty name in it.
    """

    pattern: str
    style: StyleFactory

    def __post_init__(self) -> None:
        if not self.pattern or any(not part for part in self.pattern.split(".")):
            raise ValueError(f"a sharding pattern is a dotted FQN, got {self.pattern!r}")

    def matches(self, fqn: str) -> bool:
        """Whether the module named ``fqn`` matches this rule's pattern."""
        return _compiled(self.pattern).fullmatch(fqn) is not None


@dataclass(frozen=True)
class ShardingConfig:
    """A model's tensor / sequence parallel table, in application order.

    Args:
        tp: The rules applied over the tensor-parallel mesh, in order.
        description: What the table shards (for error messages and docs).

    See Also:
        :func:`hp_trainer.apply_sharding`: the generic applier.
    """

    tp: tuple[ShardingRule, ...] = field(default_factory=tuple)
    description: str = ""

    def plan(self, fqns: list[str], options: Mapping[str, Any]) -> dict[str, Any]:
        """The ``{fqn: style}`` plan of the modules named ``fqns`` (rule order, then FQN order).

        Args:
            fqns: The model's module names, in ``named_modules`` order.
            options: Passed to every style factory.

        Returns:
            The plan.
        """
        out: dict[str, Any] = {}
        for rule in self.tp:
            for fqn in fqns:
                if fqn not in out and rule.matches(fqn):
                    out[fqn] = rule.style(options)
        return out


@functools.cache
def _compiled(pattern: str) -> re.Pattern[str]:
    parts = ("[^.]+" if part == "*" else re.escape(part) for part in pattern.split("."))
    return re.compile(r"\.".join(parts))
