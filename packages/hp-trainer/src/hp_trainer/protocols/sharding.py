"""``ShardingConfig``: how a model's modules are sharded, declared as data next to the modules.

A family declares, per FQN pattern, what each matching module (or buffer) gets, in three
sections applied by the one generic applier
(:func:`hp_trainer.apply_sharding`):

* ``tp``: tensor / sequence parallel styles over the TP mesh;
* ``ep``: the routed experts' styles over the expert mesh (expert parallel, expert x tensor
  parallel, or tensor parallel alone, as the layout says: the factory reads
  ``options["expert_layout"]``), with the table's ``dispatcher`` options passed through;
* ``cp``: the placement, over the context-parallel mesh, of each buffer indexed by position
  (``Shard(d)``: sharded along the sequence like the inputs, every step).

A pattern is a dotted FQN where ``*`` stands for one name (``layers.*.attention.wq``); a module
the model does not have (a pipeline stage without the LM head, a decoder without QK-norm) simply
matches nothing. A style that depends on the job (the LM head's output under loss parallel) is
built from the applier's options.

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

__all__ = ["EXPERT_LAYOUTS", "SHARDING_SECTIONS", "ShardingConfig", "ShardingRule"]

StyleFactory = Callable[[Mapping[str, Any]], Any]
"""Builds a fresh parallel style (or placement) for one module from the applier's options."""

SHARDING_SECTIONS = ("tp", "ep", "cp")
"""The sections of a :class:`ShardingConfig`, in the order the applier applies them."""

EXPERT_LAYOUTS = ("ep", "ep_tp", "tp")
"""Values of the ``expert_layout`` option an ``ep`` rule's factory receives: experts over the
1-D EP mesh, over the 2-D ``[ep, tp]`` mesh, or every expert on each rank with its hidden units
over the 1-D TP mesh."""


@dataclass(frozen=True)
class ShardingRule:
    """One row of a sharding table: modules matching ``pattern`` get ``style(options)``.

    Args:
        pattern: Dotted FQN relative to the model; ``*`` matches one name.
        style: ``fn(options) -> ParallelStyle`` (a ``Placement`` in the ``cp`` section), called
            once per matching module or buffer.

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
    """A model's sharding table: TP, EP and CP sections, each in application order.

    Args:
        tp: The rules applied over the tensor-parallel mesh, in order.
        description: What the table shards (for error messages and docs).
        ep: Keyword-only; the routed experts' rules, applied over the expert mesh;
            their factories receive ``expert_layout`` (one of ``EXPERT_LAYOUTS``) and
            ``dispatcher`` among the options.
        cp: Keyword-only; the buffers indexed by position (RoPE tables) and their
            placement over the context-parallel mesh (``Shard(seq_dim)``).
        dispatcher: Keyword-only; keyword arguments of the expert styles' token
            dispatcher (``ExpertParallel(**dispatcher)``), the family's defaults; the applier's
            ``dispatcher`` option overrides them key by key.

    See Also:
        :func:`hp_trainer.apply_sharding`: the generic applier.
    """

    tp: tuple[ShardingRule, ...] = field(default_factory=tuple)
    description: str = ""
    ep: tuple[ShardingRule, ...] = field(default_factory=tuple, kw_only=True)
    cp: tuple[ShardingRule, ...] = field(default_factory=tuple, kw_only=True)
    dispatcher: Mapping[str, Any] = field(default_factory=dict, kw_only=True)

    def plan(
        self, fqns: list[str], options: Mapping[str, Any], section: str = "tp"
    ) -> dict[str, Any]:
        """The ``{fqn: style}`` plan of one section for the names ``fqns`` (rule, then FQN order).

        Args:
            fqns: The model's module names, in ``named_modules`` order (buffer names, in
                ``named_buffers`` order, for ``cp``).
            options: Passed to every style factory.
            section: ``"tp"`` (default), ``"ep"`` or ``"cp"``.

        Returns:
            The plan.

        Raises:
            ValueError: An unknown section.
        """
        if section not in SHARDING_SECTIONS:
            raise ValueError(f"section must be one of {SHARDING_SECTIONS}; got {section!r}")
        out: dict[str, Any] = {}
        for rule in getattr(self, section):
            for fqn in fqns:
                if fqn not in out and rule.matches(fqn):
                    out[fqn] = rule.style(options)
        return out


@functools.cache
def _compiled(pattern: str) -> re.Pattern[str]:
    parts = ("[^.]+" if part == "*" else re.escape(part) for part in pattern.split("."))
    return re.compile(r"\.".join(parts))
