"""The positional part of an attention mask, as the context-parallel engine plans with it.

The engine takes a mask *description*: any object with the fields ``causal``, ``documents``,
``sliding_window``, ``chunk_size`` and ``prefix_length`` (hp-trainer's
``hp_trainer.models.common.attention.MaskSpec`` is one; the rules combine, a key is seen when
every rule allows it). :func:`mask_rule` reads and checks one and keeps the positional rules
(:class:`MaskRule`); the documents come from the batch's document ids.

A rule answers two questions:

* elementwise, on the device (:meth:`MaskRule.visible`): does the query at global position ``q``
  see the key at ``k``; used to build the boolean mask of a block that needs one, next to the
  kernel call;
* for a whole rectangle of positions, on the host with integer arithmetic only
  (:meth:`MaskRule.classify`): are all pairs visible, none, exactly the causal triangle of a
  diagonal block, or some. The plan is made from these answers, so blocks the mask hides are
  never computed (nor, for the ring's trailing steps, sent) and no host synchronisation is spent
  deciding so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: :meth:`MaskRule.classify` answers.
NONE, FULL, DIAGONAL, PARTIAL = 0, 1, 2, 3

_FIELDS = ("causal", "documents", "sliding_window", "chunk_size", "prefix_length")

# (window, sequence length) pairs already reported as full attention: said once per process
_WIDE_WINDOWS: set[tuple[int, int]] = set()


@dataclass(frozen=True)
class MaskRule:
    """Positional rules of a mask over global positions (hashable: it keys the plan cache)."""

    causal: bool = True
    sliding_window: int | None = None
    chunk_size: int | None = None
    prefix_length: int | None = None

    @property
    def plain(self) -> bool:
        """No rule beyond causal / not causal (the engine's original block plan applies)."""
        return (
            self.sliding_window is None and self.chunk_size is None and self.prefix_length is None
        )

    def visible(self, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
        """Boolean: the query at ``q_pos`` sees the key at ``kv_pos`` (broadcast shapes)."""
        seen = torch.ones_like(q_pos >= kv_pos)
        if self.causal:
            past = kv_pos <= q_pos
            if self.prefix_length is not None:
                past = past | (kv_pos < self.prefix_length)
            seen = seen & past
        if self.sliding_window is not None:
            seen = seen & (q_pos - kv_pos < self.sliding_window)
        if self.chunk_size is not None:
            seen = seen & (q_pos // self.chunk_size == kv_pos // self.chunk_size)
        return seen

    def classify(self, q0: int, q1: int, k0: int, k1: int) -> int:
        """Queries ``[q0, q1]`` against keys ``[k0, k1]`` (inclusive global positions).

        Returns:
            ``NONE`` (no pair visible), ``FULL`` (every pair), ``DIAGONAL`` (the same positions
            on both sides and exactly the pairs ``k <= q``: the kernel's own causal mask) or
            ``PARTIAL`` (a mask is needed).
        """
        c = self.chunk_size
        if c is None:
            pieces = [(q0, q1, k0, k1)]
            crossing = False
        else:  # only pairs inside one chunk can be seen: cut the rectangle at chunk edges
            lo, hi = max(q0 // c, k0 // c), min(q1 // c, k1 // c)
            if lo > hi:
                return NONE
            pieces = [
                (max(q0, i * c), min(q1, i * c + c - 1), max(k0, i * c), min(k1, i * c + c - 1))
                for i in range(lo, hi + 1)
            ]
            crossing = not (q0 // c == q1 // c == k0 // c == k1 // c)
        if not any(self._any(*p) for p in pieces):
            return NONE
        if not crossing and self._full(*pieces[0]):
            return FULL
        if not crossing and (q0, q1) == (k0, k1) and self._causal_triangle(q0, q1):
            return DIAGONAL
        return PARTIAL

    def _any(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        window = self.sliding_window
        if not self.causal:
            return window is None or q0 - k1 < window
        # k <= q and q - k < window: some q in [q0, q1] with k0 <= q <= k1 + window - 1
        reach = q1 if window is None else min(q1, k1 + window - 1)
        if max(q0, k0) <= reach:
            return True
        if self.prefix_length is not None:  # a prefix key ahead of the query
            last = min(k1, self.prefix_length - 1)
            return k0 <= last and (window is None or q0 - last < window)
        return False

    def _full(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        if self.sliding_window is not None and q1 - k0 >= self.sliding_window:
            return False
        if self.causal:
            return k1 <= q0 or (self.prefix_length is not None and k1 < self.prefix_length)
        return True

    def _causal_triangle(self, q0: int, q1: int) -> bool:
        if not self.causal:
            return False
        if self.sliding_window is not None and q1 - q0 >= self.sliding_window:
            return False
        return self.prefix_length is None or self.prefix_length <= q0 + 1


def mask_rule(mask: Any, seq_len: int, *, is_causal: bool = False) -> tuple[MaskRule, bool]:
    """Read and check a mask description; returns its positional rule and ``documents``.

    Args:
        mask: An object with the fields ``causal``, ``documents``, ``sliding_window``,
            ``chunk_size``, ``prefix_length`` (hp-trainer's ``MaskSpec``), or None: the plain
            mask of ``is_causal``.
        seq_len: The global sequence length (a window at least this long is full attention).
        is_causal: SDPA's flag, when ``mask`` is None; with a mask it must not contradict it.

    Raises:
        TypeError: ``mask`` lacks a field.
        ValueError: A size that is not a positive int, a window or prefix without ``causal``,
            or ``is_causal=True`` with a non-causal mask.
    """
    if mask is None:
        return MaskRule(causal=is_causal), False
    missing = [f for f in _FIELDS if not hasattr(mask, f)]
    if missing:
        raise TypeError(
            f"mask must describe {', '.join(_FIELDS)} (hp-trainer's MaskSpec does); "
            f"{type(mask).__name__} lacks {', '.join(missing)}"
        )
    values = {f: getattr(mask, f) for f in _FIELDS}
    for name in ("sliding_window", "chunk_size", "prefix_length"):
        value = values[name]
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"mask.{name} must be a positive int or None, got {value!r}")
    causal = bool(values["causal"])
    if not causal and (values["sliding_window"] is not None or values["prefix_length"] is not None):
        raise ValueError(
            "context-parallel attention applies a sliding window or a prefix to causal masks "
            f"only; got causal=False, sliding_window={values['sliding_window']}, "
            f"prefix_length={values['prefix_length']}"
        )
    if is_causal and not causal:
        raise ValueError("is_causal=True contradicts a mask with causal=False")
    window = values["sliding_window"]
    if window is not None and window >= seq_len:
        if (window, seq_len) not in _WIDE_WINDOWS:
            _WIDE_WINDOWS.add((window, seq_len))
            logger.warning(
                "sliding_window %d >= sequence length %d: every causal pair is inside the "
                "window, attending as full causal attention",
                window,
                seq_len,
            )
        window = None
    chunk = values["chunk_size"]
    if chunk is not None and chunk >= seq_len:
        chunk = None  # one chunk holds the whole sequence
    prefix = values["prefix_length"]
    rule = MaskRule(causal=causal, sliding_window=window, chunk_size=chunk, prefix_length=prefix)
    return rule, bool(values["documents"])
