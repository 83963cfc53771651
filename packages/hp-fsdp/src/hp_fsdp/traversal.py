"""Finding and replacing the tensors inside a module's inputs and outputs.

Forward inputs and outputs may be tensors or any nesting of dataclasses, named tuples, dicts
(ordered or not), lists, tuples and sets. ``torch.utils._pytree`` does not look inside
dataclasses, so a unit whose forward returned one got no pre-backward hook; this walker visits
the same containers PyTorch's FSDP2 visits, in the same order.

See Also:
    :pt:`torch.distributed.utils._apply_to_tensors`: PyTorch's traversal.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["collect_tensors", "map_tensors"]


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """Return ``value`` with every tensor inside it replaced by ``fn(tensor)``.

    Containers are rebuilt (dataclasses through ``dataclasses.replace``); other objects are
    returned as they are.

    Args:
        fn: applied to every tensor.
        value: a tensor or a nesting of supported containers.

    Returns:
        The rebuilt structure.

    See Also:
        :pt:`torch.distributed.utils._apply_to_tensors`: PyTorch's traversal.
    """
    if isinstance(value, torch.Tensor):
        return fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: map_tensors(fn, getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.init
        }
        return dataclasses.replace(value, **changes)
    if isinstance(value, OrderedDict):
        rebuilt = value.__class__()
        for key, item in value.items():
            rebuilt[key] = map_tensors(fn, item)
        return rebuilt
    if isinstance(value, dict):
        return {key: map_tensors(fn, item) for key, item in value.items()}
    if _is_namedtuple(value):
        return type(value)(*(map_tensors(fn, item) for item in value))
    if isinstance(value, list | tuple | set):
        return type(value)(map_tensors(fn, item) for item in value)
    return value


def collect_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors inside ``value``, in :func:`map_tensors` order (nothing is rebuilt).

    Args:
        value: a tensor or a nesting of supported containers.

    Returns:
        The tensors found.
    """
    found: list[torch.Tensor] = []
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            children = [getattr(item, f.name) for f in dataclasses.fields(item) if f.init]
            pending.extend(reversed(children))
        elif isinstance(item, dict):
            pending.extend(reversed(list(item.values())))
        elif isinstance(item, list | tuple | set):
            pending.extend(reversed(list(item)))
    return found
