"""Profiler ranges (``FSDP::...``) that cost nothing while no profiler records.

``torch.profiler.record_function`` dispatches two ops (enter and exit) and builds its label
even when nothing listens; a training step of hp-fsdp opens about a dozen ranges per unit. The
engine asks here first: while the autograd profiler (``torch.profiler.profile``,
``emit_nvtx``, ...) is off, a shared no-op context is returned and the label is never built.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

from torch.profiler import record_function

from hp_fsdp._torch_compat import profiler_enabled

__all__ = ["NO_RANGE", "profile_range", "profiler_enabled"]

#: The shared no-op range.
NO_RANGE: AbstractContextManager[None] = contextlib.nullcontext()


def profile_range(label: str) -> AbstractContextManager[object]:
    """A ``record_function`` range named ``label`` while a profiler records, else a no-op.

    Args:
        label: the range name.

    Returns:
        A context manager.
    """
    if profiler_enabled():
        return record_function(label)
    return NO_RANGE
