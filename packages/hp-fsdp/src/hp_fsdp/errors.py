"""Exception types for misuse that PyTorch's FSDP2 reports with another built-in type.

hp-fsdp reports user errors as ``ValueError``/``TypeError``; where PyTorch's ``fully_shard``
raises ``AssertionError`` or ``NotImplementedError`` for the same misuse, the exception is an
instance of both, so ``except`` clauses written for either library catch it. Messages carry
PyTorch's key phrase.

See Also:
    :pt:`torch.distributed.fsdp._fully_shard`: PyTorch's checks these mirror.
"""

from __future__ import annotations

__all__ = ["FSDPDeepCopyError", "FSDPUnsupportedParamError", "FSDPUsageError"]


class FSDPUsageError(ValueError, AssertionError):
    """A wrong argument that PyTorch's FSDP2 rejects with an ``AssertionError``.

    See Also:
        :pt:`torch.distributed.fsdp.fully_shard`: asserts on re-application, 2-D meshes without
        dim names and out-of-range shard dims.
    """


class FSDPUnsupportedParamError(ValueError, NotImplementedError):
    """A parameter layout PyTorch's FSDP2 rejects with ``NotImplementedError``.

    See Also:
        :pt:`torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam`: its layout checks.
    """


class FSDPDeepCopyError(TypeError, AssertionError):
    """Deep-copying a ``fully_shard`` module (PyTorch raises ``AssertionError``).

    See Also:
        :pt:`torch.distributed.fsdp.fully_shard`: its modules refuse ``copy.deepcopy``.
    """
