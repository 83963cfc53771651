"""HyperParallel's declarative sharding: ``ShardingPlan`` and ``shard_module``.

A plan names the layout of each parameter (by FQN, wildcards allowed), of the inputs and outputs
of the root module or any submodule, and which modules hand back local tensors. Layouts are
placements (one per mesh dimension; a bare Placement on a 1-D mesh) or an ``hp_dtensor.Layout``.
Unlike ``parallelize_module``, ``shard_module`` accepts a mesh of any number of dimensions.

See Also:
    :pt:`torch.distributed.tensor.distribute_module`: PyTorch's lower-level module distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from hp_tp._dtensor import DeviceMesh, DTensor, Layout, Replicate, distribute_tensor
from hp_tp._layout import has_layout, is_layout_spec, to_placements

__all__ = ["ShardingPlan", "shard_module"]

_INPUT = "input"
_OUTPUT = "output"


@dataclass
class ShardingPlan:
    """What ``shard_module`` does to a module.

    Attributes:
        plan: parameter FQN (``fnmatch`` wildcards allowed, e.g. ``"layers.*.w1.weight"``) to its
            layout. An exact FQN wins over patterns; among patterns the first matching key, in
            insertion order, wins. Parameters no key matches become replicated DTensors.
        input_plan: ``"input"`` (the root module) or ``"<module fqn>.input"`` to the layouts of
            that module's positional inputs: one layout for the first input, or a tuple with one
            layout or ``None`` (left alone) per positional input. A local tensor input is taken as
            the local shard of its layout; a DTensor input is redistributed to it.
        output_plan: ``"output"`` or ``"<module fqn>.output"`` to the layouts of that module's
            outputs, in the same form; DTensor outputs are redistributed, local ones annotated.
        return_local_tensor: module FQNs (``""`` for the root) whose DTensor outputs are turned
            into local tensors (after ``output_plan``).

    See Also:
        :pt:`torch.distributed.tensor.parallel.parallelize_module`: PyTorch's style-based plans.
    """

    plan: dict[str, Any] = field(default_factory=dict)
    input_plan: dict[str, Any] = field(default_factory=dict)
    output_plan: dict[str, Any] = field(default_factory=dict)
    return_local_tensor: list[str] = field(default_factory=list)


def _split_io_key(key: str, suffix: str, what: str) -> str:
    if key == suffix:
        return ""
    if key.endswith("." + suffix):
        return key[: -len(suffix) - 1]
    raise ValueError(f"{what} key {key!r} must be {suffix!r} or '<module fqn>.{suffix}'")


def _per_item_layouts(spec: Any, mesh: DeviceMesh, what: str) -> tuple[tuple[Any, ...] | None, ...]:
    """Per positional item: its placements tuple, or None to leave it alone."""
    items: Sequence[Any] = (spec,) if is_layout_spec(spec) else spec
    if not isinstance(items, Sequence):
        raise TypeError(f"{what}: expected a layout or a tuple of layouts/None, got {spec!r}")
    return tuple(
        None if s is None else to_placements(s, mesh, f"{what}[{i}]") for i, s in enumerate(items)
    )


def _lay_out(value: Any, mesh: DeviceMesh, placements: tuple[Any, ...], what: str) -> Any:
    if isinstance(value, DTensor):
        if not has_layout(value, placements):
            value = value.redistribute(mesh, placements)
        return value
    if isinstance(value, torch.Tensor):
        return DTensor.from_local(value, mesh, placements, run_check=False)
    raise TypeError(f"{what} has a layout in the plan but is a {type(value).__name__}")


def _apply_layouts(
    items: tuple[Any, ...],
    layouts: tuple[tuple[Any, ...] | None, ...],
    mesh: DeviceMesh,
    what: str,
) -> tuple[Any, ...]:
    if len(layouts) > len(items):
        raise ValueError(f"{what}: the plan has {len(layouts)} layouts but got {len(items)} values")
    out = list(items)
    for i, placements in enumerate(layouts):
        if placements is not None:
            out[i] = _lay_out(items[i], mesh, placements, f"{what} {i}")
    return tuple(out)


def _to_local_outputs(out: Any) -> Any:
    if isinstance(out, DTensor):
        return out.to_local()
    if isinstance(out, tuple):
        return tuple(o.to_local() if isinstance(o, DTensor) else o for o in out)
    if isinstance(out, list):
        return [o.to_local() if isinstance(o, DTensor) else o for o in out]
    return out


def _module_or_error(root: nn.Module, fqn: str, what: str) -> nn.Module:
    try:
        return root.get_submodule(fqn)
    except AttributeError:
        raise ValueError(f"{what}: {fqn!r} is not a submodule of {type(root).__name__}") from None


def _io_hooks(
    module: nn.Module, plan: dict[str, Any], mesh: DeviceMesh, suffix: str, kind: str
) -> list[tuple[nn.Module, tuple[tuple[Any, ...] | None, ...], str]]:
    """Validate an ``input_plan``/``output_plan`` (``kind``) into (module, layouts, label)."""
    hooks: list[tuple[nn.Module, tuple[tuple[Any, ...] | None, ...], str]] = []
    for key, spec in plan.items():
        fqn = _split_io_key(key, suffix, f"{kind}_plan")
        target = _module_or_error(module, fqn, f"{kind}_plan[{key!r}]")
        layouts = _per_item_layouts(spec, mesh, f"{kind}_plan[{key!r}]")
        hooks.append((target, layouts, f"{kind} of {fqn or '<root>'}"))
    return hooks


def shard_module(
    module: nn.Module,
    device_mesh: DeviceMesh,
    sharding_plan: ShardingPlan,
    *,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Shard ``module``'s parameters and lay out its inputs and outputs as ``sharding_plan`` says.

    Every key of the plan is validated before the module is changed. Parameters become
    ``nn.Parameter`` DTensors made with ``distribute_tensor`` (values taken from
    ``src_data_rank``; ``None`` uses each rank's local values); a parameter shared by several
    modules is replaced everywhere. Input and output layouts are applied by forward hooks, whose
    redistributions are differentiable, so gradients come back in the parameters' layouts.

    Args:
        module: the module to shard, in place.
        device_mesh: the mesh (any number of dimensions).
        sharding_plan: the plan.
        src_data_rank: keyword-only extension: the rank whose parameter values are used.

    Returns:
        ``module``, sharded.

    Raises:
        ValueError: for a plan key that names no parameter or submodule, or a layout with the wrong
            number of placements for the mesh.
        TypeError: for a layout that is not a Placement, a sequence of them, or a Layout.

    See Also:
        :pt:`torch.distributed.tensor.distribute_module`: PyTorch's module distribution;
        :pt:`torch.distributed.tensor.parallel.parallelize_module`: PyTorch's TP plans.
    """
    if not isinstance(sharding_plan, ShardingPlan):
        raise TypeError(f"sharding_plan must be a ShardingPlan, got {type(sharding_plan).__name__}")
    params = dict(module.named_parameters())
    names = list(params)
    param_layouts: dict[str, tuple[Any, ...]] = {}
    # exact FQNs first, then patterns in insertion order: the first match wins
    keys = sorted(sharding_plan.plan, key=lambda k: k not in params)
    for key in keys:
        spec = sharding_plan.plan[key]
        placements = to_placements(spec, device_mesh, f"plan[{key!r}]")
        matched = [n for n in names if n == key or fnmatchcase(n, key)]
        if not matched:
            raise ValueError(
                f"plan key {key!r} matches no parameter of {type(module).__name__}; "
                f"parameters are {names}"
            )
        for n in matched:
            if isinstance(spec, Layout) and spec.ndim != params[n].ndim:
                raise ValueError(
                    f"plan[{key!r}]: the layout {spec!r} describes a {spec.ndim}-D tensor but "
                    f"parameter {n!r} has {params[n].ndim} dims"
                )
            param_layouts.setdefault(n, placements)
    input_hooks = _io_hooks(module, sharding_plan.input_plan, device_mesh, _INPUT, "input")
    output_hooks = _io_hooks(module, sharding_plan.output_plan, device_mesh, _OUTPUT, "output")
    local_targets = [
        _module_or_error(module, fqn, f"return_local_tensor[{fqn!r}]")
        for fqn in sharding_plan.return_local_tensor
    ]

    replicated = tuple(Replicate() for _ in range(device_mesh.ndim))
    new_params: dict[torch.Tensor, nn.Parameter] = {}  # tensors hash by identity
    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            raise ValueError(f"parameter {name!r} is already a DTensor; shard a module once")
        placements = param_layouts.get(name, replicated)
        dt = distribute_tensor(param.data, device_mesh, placements, src_data_rank=src_data_rank)
        new_params[param] = nn.Parameter(dt, requires_grad=param.requires_grad)
    for mod in module.modules():
        for leaf, p in list(mod._parameters.items()):
            if p is not None and p in new_params:
                mod._parameters[leaf] = new_params[p]

    for target, layouts, what in input_hooks:
        target.register_forward_pre_hook(_make_input_hook(layouts, device_mesh, what))
    for target, layouts, what in output_hooks:
        target.register_forward_hook(_make_output_hook(layouts, device_mesh, what))
    for target in local_targets:
        target.register_forward_hook(lambda _m, _a, out: _to_local_outputs(out))
    return module


def _make_input_hook(
    layouts: tuple[tuple[Any, ...] | None, ...], mesh: DeviceMesh, what: str
) -> Any:
    def hook(_mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return _apply_layouts(args, layouts, mesh, what)

    return hook


def _make_output_hook(
    layouts: tuple[tuple[Any, ...] | None, ...], mesh: DeviceMesh, what: str
) -> Any:
    def hook(_mod: nn.Module, _args: tuple[Any, ...], out: Any) -> Any:
        if isinstance(out, tuple):
            return _apply_layouts(out, layouts, mesh, what)
        (single,) = _apply_layouts((out,), layouts, mesh, what)
        return single

    return hook
