"""Functions hidden from TorchDynamo without importing it where nothing compiles.

``torch.compiler.disable(fn)`` imports ``torch._dynamo`` (and ``torch._inductor``, about 1.6
CPU seconds) when it decorates, so a package that decorates at import makes every process pay
for Dynamo, compiling or not. :func:`run_eagerly` decides per call: outside Dynamo it calls the
function (a disable would change nothing there); while Dynamo traces it, the call goes through
``torch.compiler.disable`` made there, a graph break after which the function and what it calls
run eagerly (how PyTorch's FSDP2 wraps its hooks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = ["run_eagerly"]

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def run_eagerly(fn: _Fn, *, reason: str) -> _Fn:
    """``fn``, run eagerly (recursively) when called under ``torch.compile``.

    Args:
        fn: The function to hide from TorchDynamo.
        reason: Why, shown in Dynamo's graph-break report.

    Returns:
        A wrapper with ``fn``'s name and docstring.
    """

    @functools.wraps(fn)
    def eager(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            disabled = torch.compiler.disable(fn, recursive=True, reason=reason)  # type: ignore[no-untyped-call]
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return cast(_Fn, eager)
