"""Every private PyTorch name hp-pp uses, resolved once at import.

A PyTorch upgrade that renames or removes one of them fails here, at import, with an error that
names the missing name and the installed torch version (the checker is hp-dtensor's).
``scripts/tests/test_torch_compat.py`` checks these names and that no other module of hp-pp
spells a private PyTorch name.
"""

from __future__ import annotations

from hp_dtensor._torch_compat import missing_torch_name

try:
    # torch's error for a shape/dtype mismatch between pipeline stages (defined in a private
    # module, re-exported by ``torch.distributed.pipelining.stage``).
    from torch.distributed.pipelining._utils import (  # interop: torch's exception type
        PipeliningMetadataError as TorchPipeliningMetadataError,
    )
except ImportError as _exc:  # pragma: no cover - only on an unsupported torch
    raise missing_torch_name("hp-pp", _exc.name or str(_exc)) from _exc

__all__ = ["PRIVATE_NAMES", "TorchPipeliningMetadataError"]

PRIVATE_NAMES = ("torch.distributed.pipelining._utils.PipeliningMetadataError",)
