"""``parallelize_module``: apply tensor-parallel styles to a module by fully qualified name.

See Also:
    :pt:`torch.distributed.tensor.parallel.parallelize_module`: PyTorch's entry point.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any, Protocol, TypeAlias

from torch import nn

from hp_tp._dtensor import DeviceMesh, get_current_mesh
from hp_tp.style import ParallelStyle

__all__ = ["parallelize_module"]


class _StyleProtocol(Protocol):
    """PyTorch's style protocol: what a foreign style (torch's, torchao's, TorchTitan's) has."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module: ...


#: A plan: one style for the module, or FQN patterns to styles or to nested plans.
PlanType: TypeAlias = "ParallelStyle | _StyleProtocol | Mapping[str, ParallelStyle | PlanType]"


def _match_children(module: nn.Module, token: str) -> list[tuple[str, nn.Module]]:
    return [(name, child) for name, child in module.named_children() if fnmatchcase(name, token)]


def _resolve(
    module: nn.Module, key: str, prefix: str
) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module, str]]]:
    """Submodules a (possibly wildcarded) dotted key names, and where it stopped matching.

    The second list holds, for each branch of the key that matched nothing, the path and module
    reached so far and the token none of its children matched (as PyTorch, which resolves a key
    branch by branch and warns for each branch that ends early).
    """
    if key == "":
        return [(prefix, module)], []
    frontier: list[tuple[str, nn.Module]] = [(prefix, module)]
    misses: list[tuple[str, nn.Module, str]] = []
    for token in key.split("."):
        nxt: list[tuple[str, nn.Module]] = []
        for path, mod in frontier:
            matched = _match_children(mod, token)
            if not matched:
                misses.append((path, mod, token))
            for name, child in matched:
                nxt.append((f"{path}.{name}" if path else name, child))
        frontier = nxt
        if not frontier:
            break
    return frontier, misses


def _is_style(plan: object) -> bool:
    """Whether ``plan`` is a style: ours, torch's, or any object with a callable ``_apply``.

    PyTorch's ``ParallelStyle`` protocol is ``_apply(module, device_mesh) -> module``; styles
    written for torch's ``parallelize_module`` (torch's own, TorchTitan's, hp-cp-ep's expert
    styles) therefore work here unchanged.
    """
    # nn.Module has an unrelated ``_apply(fn)``: a module passed as a plan is a user error.
    return isinstance(plan, ParallelStyle) or (
        not isinstance(plan, Mapping | nn.Module) and callable(getattr(plan, "_apply", None))
    )


def _collect(
    module: nn.Module,
    plan: Any,
    prefix: str,
    out: list[tuple[str, nn.Module, Any]],
    errors: list[tuple[str, str, str, list[str]]],
) -> None:
    if _is_style(plan):
        out.append((prefix, module, plan))
        return
    if not isinstance(plan, Mapping):
        raise TypeError(
            "parallelize_plan must be a ParallelStyle (hp_tp's, torch's, or any object with "
            "_apply(module, device_mesh)) or a dict of module FQN (wildcards allowed) to "
            f"ParallelStyle or nested plan; got {type(plan).__name__} at {prefix or '<root>'!r}"
        )
    for key, value in plan.items():
        if not isinstance(key, str):
            raise TypeError(f"plan keys must be module FQN strings, got {key!r}")
        targets, misses = _resolve(module, key, prefix)
        where = f"{prefix}.{key}" if prefix else key
        for path, reached, token in misses:
            children = [name for name, _ in reached.named_children()]
            errors.append((where, token, path or "<root>", children))
        for path, target in targets:
            _collect(target, value, path, out, errors)


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: ParallelStyle | _StyleProtocol | dict[str, Any] | None = None,
    *,
    src_data_rank: int | None = 0,
    strict: bool = False,
) -> nn.Module:
    """Apply tensor parallelism to ``module`` following ``parallelize_plan``.

    The plan is either one :class:`~hp_tp.ParallelStyle` for ``module`` itself, or a dict whose
    keys are module FQNs relative to ``module`` (``fnmatch`` wildcards per dotted token, e.g.
    ``"layers.*.attention.wq"``; ``""`` is ``module`` itself) and whose values are styles or,
    as an extension, nested plans of the same form relative to the matched submodule. A key (or
    a branch of a wildcarded key) that matches no submodule is skipped with a ``UserWarning``, as
    in PyTorch; with ``strict=True`` it is an error instead. Every key is resolved before
    anything is changed, so a plan refused under ``strict=True`` leaves the module untouched.
    Each style is applied to a copy carrying ``src_data_rank``, so the caller's style objects
    are not modified and one style object may serve many modules.

    Args:
        module: the module to parallelize, in place.
        device_mesh: a 1-D mesh; default: the current mesh (``hp_dtensor.use_mesh`` or torch's
            ``with mesh:``). Foreign styles (see below) get the mesh as given, of any
            dimension, as in PyTorch (e.g. an expert-tensor-parallel style on ``[ep, tp]``).
        parallelize_plan: a style or a dict of FQN patterns to styles / nested plans. A style
            is an ``hp_tp`` style or any object implementing PyTorch's ``ParallelStyle``
            protocol (an instance of ``torch.distributed.tensor.parallel.ParallelStyle``, or
            any object with a callable ``_apply(module, device_mesh)``); both kinds mix in one
            plan. ``None`` warns and returns the module unchanged (as PyTorch does).
        src_data_rank: rank whose parameter values are scattered/broadcast; ``None`` uses each
            rank's local values.
        strict: keyword-only extension: raise ``ValueError`` for a plan key that matches no
            submodule instead of warning and skipping it (PyTorch's behaviour, the default).

    Returns:
        ``module``, parallelized.

    Raises:
        ValueError: when no mesh is given or current, the mesh is not 1-D while the plan holds
            an ``hp_tp`` style, or (``strict=True``) a plan key matches no submodule.
        TypeError: when the plan or one of its values is not a style, or a style does not
            support a module type.

    See Also:
        :pt:`torch.distributed.tensor.parallel.parallelize_module`: PyTorch's entry point.
    """
    mesh = device_mesh if device_mesh is not None else get_current_mesh(required=False)
    if mesh is None:
        raise ValueError(
            "parallelize_module needs a device_mesh: pass one or make one current with "
            "hp_dtensor.use_mesh(mesh)"
        )
    if parallelize_plan is None:
        warnings.warn(
            "parallelize_module got no parallelize_plan, so it leaves the module unchanged",
            stacklevel=2,
        )
        return module
    targets: list[tuple[str, nn.Module, Any]] = []
    errors: list[tuple[str, str, str, list[str]]] = []
    _collect(module, parallelize_plan, "", targets, errors)
    if errors and strict:
        raise ValueError(
            "parallelize_plan has keys that match no submodule: "
            + "; ".join(
                f"{key!r}: no submodule matches {token!r} (children of {path}: {children})"
                for key, token, path, children in errors
            )
        )
    for key, token, path, children in errors:
        # PyTorch's phrases ("could not be resolved", "no submodule matching token", "skipping
        # this plan entry"), so filters and regexes written for its warning match this one.
        warnings.warn(
            f"Parallelize plan key {key!r} could not be resolved: no submodule matching token "
            f"{token!r} among the children {children} of {path}; skipping this plan entry "
            "(pass strict=True to parallelize_module to make this an error)",
            UserWarning,
            stacklevel=2,
        )
    # hp_tp's styles are 1-D; foreign styles define their own mesh contract (as in PyTorch).
    if mesh.ndim != 1 and any(isinstance(style, ParallelStyle) for _, _, style in targets):
        raise ValueError(
            f"parallelize_module needs a 1-D device mesh, got a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.shape)}; pass the tensor-parallel sub-mesh, e.g. mesh['tp']"
        )
    for _path, target, style in targets:
        applied = copy.copy(style)
        applied.src_data_rank = src_data_rank
        applied._apply(target, mesh)
    return module
