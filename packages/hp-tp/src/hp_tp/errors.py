"""Exception types for misuse that PyTorch's tensor-parallel API reports with ``AssertionError``.

hp-tp reports user errors as ``ValueError``/``TypeError``. Where PyTorch's styles raise
``AssertionError`` for the same misuse (``PrepareModuleInput`` / ``PrepareModuleOutput`` given
layout tuples of different lengths, a missing ``desired_input_layouts``, a non-tensor input where a
layout is declared), the exception is an instance of both, so ``except`` clauses and
``assertRaises`` written for either library catch it.

See Also:
    :pt:`torch.distributed.tensor.parallel.PrepareModuleInput`: PyTorch's checks these mirror.
"""

from __future__ import annotations

__all__ = ["TPInputTypeError", "TPUsageError"]


class TPUsageError(ValueError, AssertionError):
    """A style argument PyTorch's tensor-parallel API rejects with an ``AssertionError``.

    Raised by :class:`hp_tp.PrepareModuleInput` and :class:`hp_tp.PrepareModuleOutput` when the
    layout tuples (or keyword-layout dicts) disagree in length, or when ``input_layouts`` is given
    without ``desired_input_layouts``.

    See Also:
        :pt:`torch.distributed.tensor.parallel.PrepareModuleInput`: asserts the same arities.
    """


class TPInputTypeError(TypeError, AssertionError):
    """A module input that is not a tensor where a style declares a layout for it.

    See Also:
        :pt:`torch.distributed.tensor.parallel.PrepareModuleInput`: asserts its inputs are tensors.
    """
