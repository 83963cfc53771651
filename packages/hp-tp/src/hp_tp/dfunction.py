"""``DFunction``: an autograd function on local shards with declared input and output layouts.

See Also:
    :pt:`torch.distributed.tensor.experimental.local_map`: PyTorch's local-function wrapper.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from hp_tp._dtensor import DeviceMesh, DTensor, get_current_mesh
from hp_tp._layout import has_layout, to_placements

__all__ = ["DFunction"]


class DFunction(torch.autograd.Function):
    """An autograd function whose ``forward`` and ``backward`` see local shards only.

    Subclass it like ``torch.autograd.Function`` and declare, as class attributes, the layout of
    each positional input (``input_layouts``) and of each output (``output_layouts``); ``None``
    marks a non-tensor argument, or a tensor passed through untouched. A layout is a Placement
    (1-D mesh), one Placement per mesh dimension, or an ``hp_dtensor.Layout``.

    ``MyFn.apply(*args)`` redistributes every DTensor argument to its declared layout (a local
    tensor argument is taken as the local shard of it), calls ``forward(ctx, *local_args)``, and
    wraps each output as a DTensor of its declared layout (a ``None`` output layout returns the
    local tensor). ``backward(ctx, *local_grads)`` receives the local gradients of the outputs (in
    the output layouts) and returns the local gradients of the inputs, in ``input_grad_layouts``
    (default: the input layouts; declare ``Partial()`` where a local gradient is a partial sum);
    the redistributions around it are differentiable, so gradients reach each DTensor argument in
    its own layout. The mesh is that of the DTensor arguments (all must share it) or, when there
    is none, the current mesh. Output DTensors assume evenly divisible shards when computing
    their global shape.

    Example:
        .. code-block:: python

            class LocalMatmul(DFunction):
                input_layouts = (Shard(0), Replicate())
                output_layouts = (Shard(0),)
                input_grad_layouts = (Shard(0), Partial())  # w's local grad is a partial sum

                @staticmethod
                def forward(ctx, x, w):
                    ctx.save_for_backward(x, w)
                    return x @ w

                @staticmethod
                def backward(ctx, gy):
                    x, w = ctx.saved_tensors
                    return gy @ w.t(), x.t() @ gy

    Raises:
        ValueError: at ``apply`` time, for a wrong number of arguments or outputs, DTensor
            arguments on different meshes, or no mesh at all.

    See Also:
        :pt:`torch.distributed.tensor.experimental.local_map`: PyTorch's local-function wrapper;
        :pt:`torch.autograd.Function`: the base class.
    """

    input_layouts: ClassVar[tuple[Any, ...]] = ()
    output_layouts: ClassVar[tuple[Any, ...]] = ()
    input_grad_layouts: ClassVar[tuple[Any, ...] | None] = None

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        """Run the function on the local shards of ``args`` laid out as ``input_layouts``.

        Args:
            *args: one positional argument per entry of ``input_layouts``.
            **kwargs: not supported (``torch.autograd.Function`` takes positional arguments).

        Returns:
            The outputs of ``forward``, as DTensors of ``output_layouts`` (local where ``None``).

        Raises:
            TypeError: for keyword arguments, or a non-tensor argument with a layout.
            ValueError: for a wrong number of arguments or outputs, or no mesh.

        See Also:
            :pt:`torch.autograd.Function.apply`: the base method.
        """
        if kwargs:
            raise TypeError(f"{cls.__name__}.apply takes positional arguments only")
        if len(args) != len(cls.input_layouts):
            raise ValueError(
                f"{cls.__name__}.apply got {len(args)} arguments but input_layouts declares "
                f"{len(cls.input_layouts)}"
            )
        mesh = _mesh_of(args, cls.__name__)
        grad_specs = cls.input_grad_layouts or cls.input_layouts
        if len(grad_specs) != len(cls.input_layouts):
            raise ValueError(
                f"{cls.__name__}: input_grad_layouts has {len(grad_specs)} entries, "
                f"input_layouts {len(cls.input_layouts)}"
            )
        local_args: list[Any] = []
        for i, (arg, spec, grad_spec) in enumerate(
            zip(args, cls.input_layouts, grad_specs, strict=True)
        ):
            if spec is None:
                local_args.append(arg)
                continue
            placements = to_placements(spec, mesh, f"{cls.__name__}.input_layouts[{i}]")
            if isinstance(arg, DTensor):
                if not has_layout(arg, placements):
                    arg = arg.redistribute(mesh, placements)
                grad_placements = (
                    placements
                    if grad_spec is None
                    else to_placements(grad_spec, mesh, f"{cls.__name__}.input_grad_layouts[{i}]")
                )
                local_args.append(arg.to_local(grad_placements=grad_placements))
            elif isinstance(arg, torch.Tensor):
                local_args.append(arg)
            else:
                raise TypeError(
                    f"{cls.__name__}: argument {i} has layout {spec!r} but is a "
                    f"{type(arg).__name__}, not a tensor"
                )
        outs = super().apply(*local_args)  # type: ignore[no-untyped-call]
        single = not isinstance(outs, tuple)
        items: tuple[Any, ...] = (outs,) if single else outs
        if len(items) != len(cls.output_layouts):
            raise ValueError(
                f"{cls.__name__}.forward returned {len(items)} outputs but output_layouts "
                f"declares {len(cls.output_layouts)}"
            )
        wrapped: list[Any] = []
        for i, (out, spec) in enumerate(zip(items, cls.output_layouts, strict=True)):
            if spec is None or not isinstance(out, torch.Tensor):
                wrapped.append(out)
                continue
            placements = to_placements(spec, mesh, f"{cls.__name__}.output_layouts[{i}]")
            wrapped.append(DTensor.from_local(out, mesh, placements, run_check=False))
        return wrapped[0] if single else tuple(wrapped)


def _mesh_of(args: tuple[Any, ...], name: str) -> DeviceMesh:
    meshes = [a.device_mesh for a in args if isinstance(a, DTensor)]
    if meshes:
        first = meshes[0]
        if any(m != first for m in meshes[1:]):
            raise ValueError(f"{name}: DTensor arguments live on different device meshes")
        return first
    mesh = get_current_mesh(required=False)
    if mesh is None:
        raise ValueError(
            f"{name}: no DTensor argument and no current mesh; pass a DTensor or enter "
            "hp_dtensor.use_mesh(mesh)"
        )
    return mesh
