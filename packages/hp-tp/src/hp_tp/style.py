"""Tensor-parallel styles: how one module's parameters, inputs and outputs are laid out on a mesh.

Every style is built directly on torch's DTensor: parameters become ``nn.Parameter`` DTensors made
with ``distribute_tensor``, and forward hooks turn the module's inputs and outputs into DTensors of
the declared placements (``DTensor.from_local`` for local tensors, ``redistribute`` for DTensors).
The collectives a style issues are exactly those of the redistributions it declares.

Extending a style to a custom module: subclass it and override ``param_placements(module)`` (and
``desired_input_layout(module)`` where the input layout differs). ``param_placements`` returns,
for the given module, the placement of each of its parameters; the hooks stay the same.

See Also:
    :pt:`torch.distributed.tensor.parallel.style`: PyTorch's parallel styles.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hp_tp._dtensor import DeviceMesh, DTensor, Placement, Replicate, Shard, distribute_tensor
from hp_tp._layout import has_layout
from hp_tp.errors import TPInputTypeError, TPUsageError

__all__ = [
    "ColwiseParallel",
    "NoParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
]


# --------------------------------------------------------------------------------------------
# helpers shared by the styles
# --------------------------------------------------------------------------------------------


def _to_dtensor(value: Any, mesh: DeviceMesh, placement: Placement, what: str) -> DTensor:
    """``value`` as a DTensor: DTensors pass through, local tensors get ``placement``."""
    if isinstance(value, DTensor):
        return value
    if isinstance(value, torch.Tensor):
        return DTensor.from_local(value, mesh, (placement,), run_check=False)
    raise TypeError(f"{what} must be a torch.Tensor or DTensor, got {type(value).__name__}")


def _redistribute(
    tensor: DTensor, placement: Placement | None, *, async_op: bool = False
) -> DTensor:
    """``tensor`` redistributed to ``(placement,)`` when it is not already laid out so.

    ``Shard(-1)`` and ``Shard(ndim - 1)`` are the same layout (see ``has_layout``).
    """
    if placement is None or has_layout(tensor, (placement,)):
        return tensor
    return tensor.redistribute(placements=(placement,), async_op=async_op)


def _distribute_parameters(
    module: nn.Module,
    mesh: DeviceMesh,
    placements: Mapping[str, Placement],
    src_data_rank: int | None,
    style: str,
) -> None:
    """Replace each named parameter of ``module`` by a DTensor parameter of the given placement.

    Every parameter of ``module`` must get a placement and every placement must name a parameter
    (checked before anything changes), so a partial override of ``param_placements`` fails
    loudly instead of leaving plain tensors next to DTensors.
    """
    params = dict(module.named_parameters())
    kind = type(module).__name__
    unknown = sorted(set(placements) - set(params))
    missing = sorted(set(params) - set(placements))
    if unknown or missing:
        raise ValueError(
            f"{style} on {kind}: placements for parameters {unknown} that do not exist, and none "
            f"for {missing}; the module's parameters are {sorted(params)}"
        )
    for name, param in params.items():
        if isinstance(param, DTensor):
            raise ValueError(
                f"{style}: parameter {name!r} of {kind} is already a DTensor with placements "
                f"{tuple(param.placements)}; apply one style per module, once"
            )
    for name, placement in placements.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        param = params[name]
        sharded = distribute_tensor(param.data, mesh, (placement,), src_data_rank=src_data_rank)
        owner.register_parameter(leaf, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _replicate_all_parameters(
    module: nn.Module, mesh: DeviceMesh, src_data_rank: int | None, style: str
) -> None:
    """Make every parameter of ``module`` (recursively) a replicated DTensor parameter."""
    names = [name for name, _ in module.named_parameters()]
    _distribute_parameters(module, mesh, dict.fromkeys(names, Replicate()), src_data_rank, style)


def _check_1d(mesh: DeviceMesh, style: str) -> None:
    if mesh.ndim != 1:
        raise ValueError(
            f"{style} needs a 1-D device mesh, got a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.shape)}; slice the tensor-parallel axis first, e.g. mesh['tp']"
        )


def _as_layout_tuple(
    layouts: Placement | tuple[Placement | None, ...] | None, arg: str
) -> tuple[Placement | None, ...] | None:
    if layouts is None:
        return None
    if isinstance(layouts, Placement):
        return (layouts,)
    if isinstance(layouts, tuple | list) and all(
        p is None or isinstance(p, Placement) for p in layouts
    ):
        return tuple(layouts)
    raise TypeError(f"{arg} must be a Placement or a tuple of Placement/None, got {layouts!r}")


# --------------------------------------------------------------------------------------------
# the styles
# --------------------------------------------------------------------------------------------


class ParallelStyle(ABC):
    """Base of every tensor-parallel style: a recipe ``parallelize_module`` applies to a module.

    A style implements ``_apply(module, device_mesh)``: it converts the module's parameters to
    DTensors and registers the hooks that lay out its inputs and outputs, then returns the module.
    ``src_data_rank`` (set by :func:`hp_tp.parallelize_module` on the copy it applies) is the rank
    whose parameter values are scattered or broadcast to the others; ``None`` keeps each rank's
    local values.

    See Also:
        :pt:`torch.distributed.tensor.parallel.ParallelStyle`: PyTorch's style contract.
    """

    src_data_rank: int | None = 0

    @abstractmethod
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        """Parallelize ``module`` on the 1-D ``device_mesh`` in place and return it."""


class _LinearLikeStyle(ParallelStyle):
    """Shared body of the column- and row-wise styles: shard parameters, then lay out I/O."""

    input_layouts: tuple[Placement, ...]
    output_layouts: tuple[Placement, ...]
    use_local_output: bool

    @abstractmethod
    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        """Placement of each parameter of ``module`` under this style."""

    @abstractmethod
    def desired_input_layout(self, module: nn.Module) -> Placement:
        """Layout the module's input is redistributed to before the forward."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # Goes through PyTorch's override points (_partition_*_fn, _prepare_*_fn), so that a
        # subclass written for torch's ColwiseParallel/RowwiseParallel works on ours unchanged.
        _check_1d(device_mesh, type(self).__name__)
        # Other module types: their placements are asked first (an unsupported type fails there).
        placements = None
        if not isinstance(module, nn.Linear | nn.Embedding):
            placements = self.param_placements(module)
        desired = (self.desired_input_layout(module),)
        if isinstance(module, nn.Linear):
            self._partition_linear_fn("", module, device_mesh)
        elif isinstance(module, nn.Embedding):
            self._partition_embedding_fn("", module, device_mesh)
        else:
            assert placements is not None
            _distribute_parameters(
                module, device_mesh, placements, self.src_data_rank, type(self).__name__
            )
        input_layouts, output_layouts = self.input_layouts, self.output_layouts
        use_local_output = self.use_local_output
        prepare_input, prepare_output = self._prepare_input_fn, self._prepare_output_fn

        def pre_hook(mod: nn.Module, args: tuple[Any, ...]) -> Any:
            return prepare_input(input_layouts, desired, mod, args, device_mesh)

        def post_hook(mod: nn.Module, _args: tuple[Any, ...], out: Any) -> Any:
            return prepare_output(output_layouts, use_local_output, mod, out, device_mesh)

        module.register_forward_pre_hook(pre_hook)
        module.register_forward_hook(post_hook)
        return module

    def _partition_by_placements(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _distribute_parameters(
            module,
            device_mesh,
            self.param_placements(module),
            self.src_data_rank,
            type(self).__name__,
        )

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        """Distribute an ``nn.Linear``'s parameters (override point, as in PyTorch's styles).

        Args:
            name: the submodule's name relative to the styled module (``""``: the module itself).
            module: the ``nn.Linear``.
            device_mesh: the 1-D mesh.

        See Also:
            :pt:`torch.distributed.tensor.parallel.ColwiseParallel._partition_linear_fn`.
        """
        self._partition_by_placements(module, device_mesh)

    def _partition_embedding_fn(
        self, name: str, module: nn.Module, device_mesh: DeviceMesh
    ) -> None:
        """Distribute an ``nn.Embedding``'s parameters (override point, as in PyTorch's styles).

        Args:
            name: the submodule's name relative to the styled module (``""``: the module itself).
            module: the ``nn.Embedding``.
            device_mesh: the 1-D mesh.

        See Also:
            :pt:`torch.distributed.tensor.parallel.ColwiseParallel._partition_embedding_fn`.
        """
        self._partition_by_placements(module, device_mesh)

    @staticmethod
    def _prepare_input_fn(
        input_layouts: tuple[Placement, ...],
        desired_input_layouts: tuple[Placement, ...],
        mod: nn.Module,
        inputs: tuple[Any, ...],
        device_mesh: DeviceMesh,
    ) -> Any:
        """Lay out the first positional input (override point, as in PyTorch's styles).

        Returns:
            The input DTensor when the module got one argument (as PyTorch's), else the argument
            tuple with the first replaced.

        See Also:
            :pt:`torch.distributed.tensor.parallel.ColwiseParallel._prepare_input_fn`.
        """
        name = type(mod).__name__
        if not inputs:
            raise TypeError(f"{name} under tensor parallel expects a positional input tensor")
        x = _to_dtensor(inputs[0], device_mesh, input_layouts[0], f"the input of {name}")
        x = _redistribute(x, desired_input_layouts[0], async_op=True)
        return x if len(inputs) == 1 else (x, *inputs[1:])

    @staticmethod
    def _prepare_output_fn(
        output_layouts: tuple[Placement, ...],
        use_local_output: bool,
        mod: nn.Module,
        outputs: Any,
        device_mesh: DeviceMesh,
    ) -> Any:
        """Lay out the output (override point, as in PyTorch's styles).

        See Also:
            :pt:`torch.distributed.tensor.parallel.ColwiseParallel._prepare_output_fn`.
        """
        if not isinstance(outputs, DTensor):
            raise TypeError(
                f"the output of {type(mod).__name__} under tensor parallel should be a DTensor, "
                f"got {type(outputs).__name__}"
            )
        out = _redistribute(outputs, output_layouts[0], async_op=True)
        return out.to_local() if use_local_output else out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layouts}, "
            f"output_layouts={self.output_layouts}, use_local_output={self.use_local_output})"
        )


class ColwiseParallel(_LinearLikeStyle):
    """Shard a module column-wise: ``nn.Linear`` by output features, ``nn.Embedding`` by dim.

    The input (a local tensor of layout ``input_layouts``, default replicated) is redistributed to
    ``Replicate()``; the output comes out sharded on the last dimension and is redistributed to
    ``output_layouts`` (default ``Shard(-1)``).

    Args:
        input_layouts: layout of a local input tensor; default ``Replicate()``.
        output_layouts: layout the output is redistributed to; default ``Shard(-1)``.
        use_local_output: return the local shard of the output instead of a DTensor.

    Raises:
        TypeError: when applied to a module type the style does not know (see
            :meth:`param_placements` to extend it).

    See Also:
        :pt:`torch.distributed.tensor.parallel.ColwiseParallel`: PyTorch's column-wise style.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        self.input_layouts: tuple[Placement, ...] = (input_layouts or Replicate(),)
        self.output_layouts: tuple[Placement, ...] = (output_layouts or Shard(-1),)
        self.desired_input_layouts: tuple[Placement, ...] = (Replicate(),)
        self.use_local_output = use_local_output

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        """Placement of each parameter of ``module`` under this style.

        Override in a subclass to support a custom module type.

        Args:
            module: the module the style is applied to.

        Returns:
            Parameter name (relative to ``module``) to placement on the 1-D mesh.

        Raises:
            TypeError: for a module type other than ``nn.Linear`` and ``nn.Embedding``.

        See Also:
            :pt:`torch.distributed.tensor.parallel.ColwiseParallel`: the same partitioning.
        """
        if isinstance(module, nn.Linear):
            return {name: Shard(0) for name, _ in module.named_parameters(recurse=False)}
        if isinstance(module, nn.Embedding):
            return {"weight": Shard(1)}
        raise TypeError(
            f"{type(self).__name__} supports nn.Linear and nn.Embedding, got "
            f"{type(module).__name__}; subclass it and override param_placements() for others"
        )

    def desired_input_layout(self, module: nn.Module) -> Placement:
        """Layout the module's input is redistributed to before the forward.

        Args:
            module: the module the style is applied to.

        Returns:
            ``Replicate()`` for column-wise sharding.

        See Also:
            :pt:`torch.distributed.tensor.parallel.ColwiseParallel`: the same input layout.
        """
        return self.desired_input_layouts[0]


class RowwiseParallel(_LinearLikeStyle):
    """Shard a module row-wise: ``nn.Linear`` on its input features, ``nn.Embedding`` on its rows.

    For ``nn.Linear`` the input (default layout ``Shard(-1)``) is redistributed to ``Shard(-1)``,
    the product is a partial sum, and the output is reduced to ``output_layouts`` (default
    ``Replicate()``: an all-reduce; ``Shard(d)``: a reduce-scatter). For ``nn.Embedding`` the
    vocabulary rows are sharded, the input ids are replicated, and each rank contributes the rows
    it owns.

    Args:
        input_layouts: layout of a local input tensor; default ``Shard(-1)``.
        output_layouts: layout the output is redistributed to; default ``Replicate()``.
        use_local_output: return the local shard of the output instead of a DTensor.

    Raises:
        TypeError: when applied to a module type the style does not know (see
            :meth:`param_placements` to extend it).

    See Also:
        :pt:`torch.distributed.tensor.parallel.RowwiseParallel`: PyTorch's row-wise style.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        self.input_layouts: tuple[Placement, ...] = (input_layouts or Shard(-1),)
        self.output_layouts: tuple[Placement, ...] = (output_layouts or Replicate(),)
        self.use_local_output = use_local_output

    def param_placements(self, module: nn.Module) -> dict[str, Placement]:
        """Placement of each parameter of ``module`` under this style.

        Override in a subclass (together with :meth:`desired_input_layout`) to support a custom
        module type.

        Args:
            module: the module the style is applied to.

        Returns:
            Parameter name (relative to ``module``) to placement on the 1-D mesh.

        Raises:
            TypeError: for a module type other than ``nn.Linear`` and ``nn.Embedding``.

        See Also:
            :pt:`torch.distributed.tensor.parallel.RowwiseParallel`: the same partitioning.
        """
        if isinstance(module, nn.Linear):
            placements: dict[str, Placement] = {"weight": Shard(1)}
            if module.bias is not None:
                placements["bias"] = Replicate()
            return placements
        if isinstance(module, nn.Embedding):
            return {"weight": Shard(0)}
        raise TypeError(
            f"{type(self).__name__} supports nn.Linear and nn.Embedding, got "
            f"{type(module).__name__}; subclass it and override param_placements() and "
            "desired_input_layout() for others"
        )

    def desired_input_layout(self, module: nn.Module) -> Placement:
        """Layout the module's input is redistributed to before the forward.

        Args:
            module: the module the style is applied to.

        Returns:
            ``Shard(-1)`` for ``nn.Linear``, ``Replicate()`` for ``nn.Embedding``.

        Raises:
            TypeError: for a module type other than ``nn.Linear`` and ``nn.Embedding``.

        See Also:
            :pt:`torch.distributed.tensor.parallel.RowwiseParallel`: the same input layouts.
        """
        if isinstance(module, nn.Linear):
            return Shard(-1)
        if isinstance(module, nn.Embedding):
            return Replicate()
        raise TypeError(
            f"{type(self).__name__} has no input layout for {type(module).__name__}; "
            "override desired_input_layout() in a subclass"
        )


class SequenceParallel(ParallelStyle):
    """Run a module with replicated parameters on input sharded along the sequence dimension.

    Meant for element-wise or per-token modules (``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.Dropout``
    and the like). Parameters are broadcast from ``src_data_rank`` and kept replicated; their
    gradients are summed over the mesh by DTensor. A local input is taken as the local sequence
    shard; a DTensor input is redistributed to ``Shard(sequence_dim)``. The output stays sharded
    on the sequence dimension.

    Args:
        sequence_dim: the sequence dimension of the input.
        use_local_output: return the local shard of the output instead of a DTensor.

    See Also:
        :pt:`torch.distributed.tensor.parallel.SequenceParallel`: PyTorch's sequence-parallel style.
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        super().__init__()
        self.sequence_sharding: tuple[Placement, ...] = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_1d(device_mesh, type(self).__name__)
        _replicate_all_parameters(module, device_mesh, self.src_data_rank, type(self).__name__)
        sharding = self.sequence_sharding[0]
        use_local_output = self.use_local_output
        name = type(module).__name__

        def pre_hook(_mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            if not args:
                raise TypeError(f"{name} under SequenceParallel expects a positional input")
            x = _to_dtensor(args[0], device_mesh, sharding, f"the input of {name}")
            return (_redistribute(x, sharding, async_op=True), *args[1:])

        def post_hook(_mod: nn.Module, _args: tuple[Any, ...], out: Any) -> Any:
            if use_local_output and isinstance(out, DTensor):
                return out.to_local()
            return out

        module.register_forward_pre_hook(pre_hook)
        module.register_forward_hook(post_hook)
        return module

    def __repr__(self) -> str:
        dim = self.sequence_sharding[0].dim  # type: ignore[attr-defined]
        local = self.use_local_output
        return f"{type(self).__name__}(sequence_dim={dim}, use_local_output={local})"


class NoParallel(ParallelStyle):
    """Keep a module replicated inside a tensor-parallel model, with correct gradients.

    Parameters become replicated DTensors (broadcast from ``src_data_rank``). Every tensor
    positional input is made a DTensor (a local tensor is taken as laid out by ``input_layout``)
    and redistributed to ``Replicate()``, so each rank computes the full result; the output is
    redistributed to ``output_layout``. Because the backward of that redistribution is the matching
    collective, gradients flowing to a sharded producer are correct, and the parameters' gradients
    are the full (replicated) gradients. Typical use: a small router or gate inside a sharded block.

    Args:
        input_layout: layout of local input tensors; default ``Replicate()``.
        output_layout: layout the output is redistributed to; default ``Replicate()``.
        use_local_output: return the local output instead of a DTensor.

    See Also:
        :titan:`torchtitan.distributed.tensor_parallel.NoParallel`: TorchTitan's replicated style.
    """

    def __init__(
        self,
        *,
        input_layout: Placement | None = None,
        output_layout: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        self.input_layout: Placement = input_layout or Replicate()
        self.output_layout: Placement = output_layout or Replicate()
        self.desired_input_layout: Placement = Replicate()
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_1d(device_mesh, type(self).__name__)
        _replicate_all_parameters(module, device_mesh, self.src_data_rank, type(self).__name__)
        input_layout, desired = self.input_layout, self.desired_input_layout
        output_layout, use_local_output = self.output_layout, self.use_local_output

        def pre_hook(_mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            out: list[Any] = []
            for a in args:
                if isinstance(a, torch.Tensor):
                    dt = _to_dtensor(a, device_mesh, input_layout, "input")
                    out.append(_redistribute(dt, desired))
                else:
                    out.append(a)
            return tuple(out)

        def post_hook(_mod: nn.Module, _args: tuple[Any, ...], out: Any) -> Any:
            if isinstance(out, DTensor):
                out = _redistribute(out, output_layout)
                return out.to_local() if use_local_output else out
            return out

        module.register_forward_pre_hook(pre_hook)
        module.register_forward_hook(post_hook)
        return module

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layout={self.input_layout}, "
            f"output_layout={self.output_layout}, use_local_output={self.use_local_output})"
        )


class PrepareModuleInput(ParallelStyle):
    """Lay out a module's positional and keyword inputs before its forward.

    Each input with a layout in ``input_layouts`` (``None`` skips an input) is made a DTensor of
    that layout (a DTensor input is taken as is) and redistributed to the matching entry of
    ``desired_input_layouts``. Keyword inputs are handled the same way by name.

    Args:
        input_layouts: a Placement, or one Placement/None per positional input.
        desired_input_layouts: the layouts to redistribute to; same length as ``input_layouts``.
        input_kwarg_layouts: layouts of keyword inputs, by name.
        desired_input_kwarg_layouts: desired layouts of keyword inputs, by name.
        use_local_output: hand the module local tensors instead of DTensors.

    Raises:
        ValueError: ``hp_tp.errors.TPUsageError``, also an ``AssertionError`` (PyTorch's type),
            when the layout tuples or keyword-layout dicts disagree in length, when
            ``input_layouts`` is given without ``desired_input_layouts``, or when
            ``desired_input_kwarg_layouts`` names a keyword input ``input_kwarg_layouts`` does
            not; a plain ``ValueError`` at forward time, when the number of positional inputs
            differs from ``input_layouts``.
        TypeError: ``hp_tp.errors.TPInputTypeError``, also an ``AssertionError``, at forward
            time, when an input with a layout is not a tensor.

    See Also:
        :pt:`torch.distributed.tensor.parallel.PrepareModuleInput`: PyTorch's input preparation.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_output: bool = False,
    ) -> None:
        self.input_layouts = _as_layout_tuple(input_layouts, "input_layouts")
        self.desired_input_layouts = _as_layout_tuple(
            desired_input_layouts, "desired_input_layouts"
        )
        self.use_local_output = use_local_output
        if self.input_layouts is not None:
            if self.desired_input_layouts is None:
                raise TPUsageError(
                    "desired_input_layouts is required when input_layouts is given (desired "
                    "module inputs should not be None)"
                )
            if len(self.input_layouts) != len(self.desired_input_layouts):
                raise TPUsageError(
                    f"input_layouts has {len(self.input_layouts)} entries but "
                    f"desired_input_layouts has {len(self.desired_input_layouts)}; they must match "
                    "(input_layouts and desired_input_layouts should have same length)"
                )
        self.with_kwargs = input_kwarg_layouts is not None
        self.input_kwarg_layouts: dict[str, Placement] = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts: dict[str, Placement] = dict(
            desired_input_kwarg_layouts or {}
        )
        if self.with_kwargs and len(self.input_kwarg_layouts) != len(
            self.desired_input_kwarg_layouts
        ):
            raise TPUsageError(
                f"input_kwarg_layouts has {len(self.input_kwarg_layouts)} entries but "
                f"desired_input_kwarg_layouts has {len(self.desired_input_kwarg_layouts)}; they "
                "must match (input_kwarg_layouts and desired_input_kwarg_layouts should have "
                "same length)"
            )
        if set(self.desired_input_kwarg_layouts) - set(self.input_kwarg_layouts):
            raise TPUsageError(
                "desired_input_kwarg_layouts names keyword inputs "
                f"{sorted(set(self.desired_input_kwarg_layouts) - set(self.input_kwarg_layouts))} "
                "that input_kwarg_layouts does not"
            )

    def _prepare(
        self,
        value: Any,
        mesh: DeviceMesh,
        layout: Placement | None,
        desired: Placement | None,
        what: str,
    ) -> Any:
        if layout is None:
            return value
        if not isinstance(value, torch.Tensor):
            raise TPInputTypeError(
                f"{type(self).__name__}: {what} has layout {layout} but is a "
                f"{type(value).__name__}, not a torch.Tensor or DTensor (expecting input to be a "
                "torch.Tensor); give it the layout None to leave it alone"
            )
        dt = _to_dtensor(value, mesh, layout, what)
        dt = _redistribute(dt, desired)
        return dt.to_local() if self.use_local_output else dt

    def _prepare_args(self, args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        if self.input_layouts is None:
            return args
        assert self.desired_input_layouts is not None
        if len(args) != len(self.input_layouts):
            raise ValueError(
                f"the module got {len(args)} positional inputs but input_layouts has "
                f"{len(self.input_layouts)} entries; use None for inputs to leave alone"
            )
        return tuple(
            self._prepare(a, mesh, layout, desired, f"positional input {i}")
            for i, (a, layout, desired) in enumerate(
                zip(args, self.input_layouts, self.desired_input_layouts, strict=True)
            )
        )

    def _prepare_kwargs(self, kwargs: dict[str, Any], mesh: DeviceMesh) -> dict[str, Any]:
        return {
            key: self._prepare(
                value,
                mesh,
                self.input_kwarg_layouts.get(key),
                self.desired_input_kwarg_layouts.get(key),
                f"keyword input {key!r}",
            )
            for key, value in kwargs.items()
        }

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_1d(device_mesh, type(self).__name__)

        def pre_hook(
            _mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            return self._prepare_args(args, device_mesh), self._prepare_kwargs(kwargs, device_mesh)

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layouts}, "
            f"desired_input_layouts={self.desired_input_layouts}, "
            f"input_kwarg_layouts={self.input_kwarg_layouts}, "
            f"desired_input_kwarg_layouts={self.desired_input_kwarg_layouts}, "
            f"use_local_output={self.use_local_output})"
        )


class PrepareModuleOutput(ParallelStyle):
    """Lay out a module's outputs after its forward.

    Each output with a layout in ``output_layouts`` (``None`` skips an output) is made a DTensor of
    that layout (a DTensor output is taken as is) and redistributed to the matching entry of
    ``desired_output_layouts``.

    Args:
        output_layouts: a Placement, or one Placement/None per output.
        desired_output_layouts: the layouts to redistribute to; same length as ``output_layouts``.
        use_local_output: return local tensors instead of DTensors.

    Raises:
        ValueError: ``hp_tp.errors.TPUsageError``, also an ``AssertionError`` (PyTorch's type),
            when the layout tuples disagree in length; a plain ``ValueError`` at forward time,
            when the number of outputs differs from ``output_layouts``.

    See Also:
        :pt:`torch.distributed.tensor.parallel.PrepareModuleOutput`: PyTorch's output preparation.
    """

    def __init__(
        self,
        *,
        output_layouts: Placement | tuple[Placement | None, ...],
        desired_output_layouts: Placement | tuple[Placement, ...],
        use_local_output: bool = True,
    ) -> None:
        layouts = _as_layout_tuple(output_layouts, "output_layouts")
        desired = _as_layout_tuple(desired_output_layouts, "desired_output_layouts")
        if layouts is None or desired is None:
            raise ValueError("output_layouts and desired_output_layouts are required")
        if len(layouts) != len(desired):
            raise TPUsageError(
                f"output_layouts has {len(layouts)} entries but desired_output_layouts has "
                f"{len(desired)}; they must match (output_layouts and desired_output_layouts "
                "should have same length)"
            )
        self.output_layouts: tuple[Placement | None, ...] = layouts
        self.desired_output_layouts: tuple[Placement | None, ...] = desired
        self.use_local_output = use_local_output

    def _prepare_outputs(self, outputs: Any, mesh: DeviceMesh) -> Any:
        items = outputs if isinstance(outputs, tuple) else (outputs,)
        if len(items) != len(self.output_layouts):
            raise ValueError(
                f"the module returned {len(items)} outputs but output_layouts has "
                f"{len(self.output_layouts)} entries; use None for outputs to leave alone"
            )
        prepared: list[Any] = []
        for i, (out, layout, desired) in enumerate(
            zip(items, self.output_layouts, self.desired_output_layouts, strict=True)
        ):
            if layout is None:
                prepared.append(out)
                continue
            dt = _to_dtensor(out, mesh, layout, f"output {i}")
            dt = _redistribute(dt, desired)
            prepared.append(dt.to_local() if self.use_local_output else dt)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_1d(device_mesh, type(self).__name__)

        def post_hook(_mod: nn.Module, _args: tuple[Any, ...], outputs: Any) -> Any:
            return self._prepare_outputs(outputs, device_mesh)

        module.register_forward_hook(post_hook)
        return module

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(output_layouts={self.output_layouts}, "
            f"desired_output_layouts={self.desired_output_layouts}, "
            f"use_local_output={self.use_local_output})"
        )


class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module.

    Args:
        input_layouts: a Placement, or one Placement/None per positional input.
        desired_input_layouts: the layouts inputs are redistributed to.
        input_kwarg_layouts: layouts of keyword inputs, by name.
        desired_input_kwarg_layouts: desired layouts of keyword inputs, by name.
        use_local_input: hand the module local tensors instead of DTensors.
        output_layouts: a Placement, or one Placement/None per output.
        desired_output_layouts: the layouts outputs are redistributed to.
        use_local_output: return local tensors instead of DTensors.

    Raises:
        ValueError: as :class:`PrepareModuleInput` and :class:`PrepareModuleOutput` do.

    See Also:
        :pt:`torch.distributed.tensor.parallel.PrepareModuleInputOutput`: PyTorch's combined style.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_input: bool = False,
        output_layouts: Placement | tuple[Placement | None, ...],
        desired_output_layouts: Placement | tuple[Placement, ...],
        use_local_output: bool = True,
    ) -> None:
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input,
        )
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts,
            desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output,
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.prepare_module_input._apply(module, device_mesh)
        self.prepare_module_output._apply(module, device_mesh)
        return module

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input={self.prepare_module_input!r}, "
            f"output={self.prepare_module_output!r})"
        )
