"""State-dict helpers for models whose parameters are DTensors (hp's engines or torch's).

One home for ``get/set_model_state_dict``, ``get/set_optimizer_state_dict`` and
``get/set_state_dict`` (hp-fsdp and hp-dcp re-export them). They take torch's
``StateDictOptions`` (re-exported here, the same class) and return the same values as torch's
helpers, which they build on, with one difference: the ``set_*`` functions never mutate what the
caller passes in. torch's versions replace the values of the caller's dict (for example with
``broadcast_from_rank0``, full tensors become DTensors), and an optimizer loaded from a dict
shares its state tensors with that dict, so later steps would change the caller's tensors; here
the caller's containers are copied and the optimizer's tensors are cloned.

See Also:
    :pt:`torch.distributed.checkpoint.state_dict`: PyTorch's helpers with the same signatures.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed.checkpoint.state_dict as _torch_sd
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from hp_dtensor._torch_compat import IncompatibleKeys as _IncompatibleKeys

__all__ = [
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]

StateDict = dict[str, Any]
Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer]


def _copy_containers(obj: Any, *, clone_tensors: bool = False) -> Any:
    """Copy dicts, lists and tuples recursively; keep (or clone) the tensors they hold."""
    if isinstance(obj, dict):
        new = copy.copy(obj)  # keeps the type (OrderedDict) and attributes such as _metadata
        for key, value in obj.items():
            new[key] = _copy_containers(value, clone_tensors=clone_tensors)
        return new
    if isinstance(obj, list):
        return [_copy_containers(v, clone_tensors=clone_tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_copy_containers(v, clone_tensors=clone_tensors) for v in obj)
    if clone_tensors and isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    return obj


def _check_options(options: StateDictOptions | None) -> None:
    if options is not None and not isinstance(options, StateDictOptions):
        raise TypeError(f"options must be a StateDictOptions, got {type(options).__name__}")


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")


def get_model_state_dict(
    model: nn.Module,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> StateDict:
    """Return the model state dict: DTensors (sharded) or full tensors (``full_state_dict``).

    With ``full_state_dict=True`` every DTensor is gathered to a full tensor; with
    ``cpu_offload=True`` too, only rank 0 gets the values (other ranks get an empty dict), as in
    torch. ``ignore_frozen_params`` drops parameters that do not require grad.

    Args:
        model: the model.
        submodules: deprecated in torch; restricts the keys to these submodules.
        options: the options.

    Returns:
        The state dict (keys are the unwrapped FQNs).

    Raises:
        TypeError: for a model that is not a module or options of the wrong type.

    See Also:
        :pt:`torch.distributed.checkpoint.state_dict.get_model_state_dict`: PyTorch's version.
    """
    _check_model(model)
    _check_options(options)
    return _torch_sd.get_model_state_dict(model, submodules=submodules, options=options)


def set_model_state_dict(
    model: nn.Module,
    model_state_dict: StateDict,
    *,
    options: StateDictOptions | None = None,
) -> _IncompatibleKeys:
    """Load a model state dict (sharded or full) without mutating ``model_state_dict``.

    Full tensors are sharded to each parameter's placements; with ``broadcast_from_rank0=True``
    (and ``full_state_dict=True``) only rank 0's values are read and broadcast.

    Args:
        model: the model.
        model_state_dict: the state dict (left unchanged).
        options: the options (``strict`` reports missing/unexpected keys as torch does).

    Returns:
        The missing and unexpected keys.

    Raises:
        TypeError: for a model that is not a module, a state dict that is not a dict, or
            options of the wrong type.

    See Also:
        :pt:`torch.distributed.checkpoint.state_dict.set_model_state_dict`: PyTorch's version,
        which replaces the values of the dict it is given.
    """
    _check_model(model)
    _check_options(options)
    if not isinstance(model_state_dict, dict):
        raise TypeError(f"model_state_dict must be a dict, got {type(model_state_dict).__name__}")
    return _torch_sd.set_model_state_dict(
        model, _copy_containers(model_state_dict), options=options
    )


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> StateDict:
    """Return the optimizers' state dict keyed by parameter FQNs (sharded or full).

    Args:
        model: the model the optimizers update.
        optimizers: one optimizer or several.
        submodules: deprecated in torch; restricts the keys to these submodules.
        options: the options.

    Returns:
        The optimizer state dict (``state`` and ``param_groups``, or flattened with
        ``flatten_optimizer_state_dict``).

    Raises:
        TypeError: for a model that is not a module or options of the wrong type.

    See Also:
        :pt:`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`: PyTorch's version.
    """
    _check_model(model)
    _check_options(options)
    return _torch_sd.get_optimizer_state_dict(
        model, optimizers, submodules=submodules, options=options
    )


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    optim_state_dict: StateDict,
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Load an optimizer state dict without mutating it, now or at later optimizer steps.

    Args:
        model: the model the optimizers update.
        optimizers: one optimizer or several.
        optim_state_dict: the state dict (left unchanged; its tensors are cloned so that later
            optimizer steps do not write into them).
        options: the options.

    Raises:
        TypeError: for a model that is not a module, a state dict that is not a dict, or
            options of the wrong type.

    See Also:
        :pt:`torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`: PyTorch's version.
    """
    _check_model(model)
    _check_options(options)
    if not isinstance(optim_state_dict, dict):
        raise TypeError(f"optim_state_dict must be a dict, got {type(optim_state_dict).__name__}")
    _torch_sd.set_optimizer_state_dict(
        model,
        optimizers,
        _copy_containers(optim_state_dict, clone_tensors=True),
        options=options,
    )


def get_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> tuple[StateDict, StateDict]:
    """Return the model and optimizer state dicts together.

    Args:
        model: the model.
        optimizers: one optimizer or several.
        submodules: deprecated in torch; restricts the keys to these submodules.
        options: the options.

    Returns:
        ``(model_state_dict, optimizer_state_dict)``.

    Raises:
        TypeError: for a model that is not a module or options of the wrong type.

    See Also:
        :pt:`torch.distributed.checkpoint.state_dict.get_state_dict`: PyTorch's version.
    """
    _check_model(model)
    _check_options(options)
    return _torch_sd.get_state_dict(model, optimizers, submodules=submodules, options=options)


def set_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    model_state_dict: StateDict,
    optim_state_dict: StateDict,
    options: StateDictOptions | None = None,
) -> _IncompatibleKeys:
    """Load model and optimizer state dicts together, mutating neither.

    Args:
        model: the model.
        optimizers: one optimizer or several.
        model_state_dict: the model state dict (left unchanged).
        optim_state_dict: the optimizer state dict (left unchanged).
        options: the options.

    Returns:
        The model's missing and unexpected keys.

    Raises:
        TypeError: for arguments of the wrong type.

    See Also:
        :pt:`torch.distributed.checkpoint.state_dict.set_state_dict`: PyTorch's version.
    """
    _check_model(model)
    _check_options(options)
    for name, value in (
        ("model_state_dict", model_state_dict),
        ("optim_state_dict", optim_state_dict),
    ):
        if not isinstance(value, dict):
            raise TypeError(f"{name} must be a dict, got {type(value).__name__}")
    return _torch_sd.set_state_dict(
        model,
        optimizers,
        model_state_dict=_copy_containers(model_state_dict),
        optim_state_dict=_copy_containers(optim_state_dict, clone_tensors=True),
        options=options,
    )
