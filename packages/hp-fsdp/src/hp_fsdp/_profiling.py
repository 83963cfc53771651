"""Profiler ranges (``FSDP::...``) that cost nothing while no profiler records.

``torch.profiler.record_function`` dispatches two ops (enter and exit) and builds its label
even when nothing listens; a training step of hp-fsdp opens about a dozen ranges per unit. The
engine asks here first: while the autograd profiler (``torch.profiler.profile``,
``emit_nvtx``, ...) is off, a shared no-op context is returned and the label is never built.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import cast

from torch.profiler import record_function

from hp_fsdp._torch_compat import profiler_enabled

__all__ = ["NO_OP", "NO_RANGE", "profile_range", "profiler_enabled"]


class _NoOpContext:
    """A context manager that does nothing, without a Python call on entry or exit.

    ``contextlib.nullcontext`` runs two Python methods per ``with``; the engine enters a no-op
    range or stream context several times per unit and step. Here ``__enter__`` and
    ``__exit__`` are a bound method of a C type (``"".format``): the ``with`` statement calls it
    without binding (no Python frame); on exit it receives the exception triple and returns
    ``""``, which is false, so exceptions propagate. Stateless: one shared instance serves every
    thread and nesting.
    """

    __slots__ = ()
    __enter__ = "".format
    __exit__ = "".format


#: The shared no-op context (no profiler range, no stream switch).
NO_OP: AbstractContextManager[object] = cast(AbstractContextManager[object], _NoOpContext())
#: The shared no-op range.
NO_RANGE: AbstractContextManager[object] = NO_OP


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
