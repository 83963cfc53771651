"""Mesh context: the current mesh, ``init_mesh`` with the detected device, sub-meshes, flattening.

The current mesh is a context-manager flag: :func:`use_mesh` pushes a mesh for the duration of a
``with`` block (it also enters torch's own ``with mesh:`` context, so torch's DTensor factories
see it), and :func:`get_current_mesh` returns the innermost one. Nothing is remembered outside a
``with`` block.

See Also:
    :pt:`torch.distributed.device_mesh`: PyTorch's DeviceMesh and ``init_device_mesh``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from typing import Literal, overload

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hp_dtensor._torch_compat import flatten_mesh, mesh_resources
from hp_dtensor.device import get_device_type

__all__ = [
    "flatten_axes",
    "get_current_mesh",
    "get_submesh",
    "init_mesh",
    "mesh_axis_size",
    "use_mesh",
]

_MESH_STACK: contextvars.ContextVar[tuple[DeviceMesh, ...]] = contextvars.ContextVar(
    "hp_dtensor_mesh_stack", default=()
)


def _torch_current_mesh() -> DeviceMesh | None:
    """The innermost mesh entered with torch's ``with mesh:``, if any."""
    stack = mesh_resources.mesh_stack
    if not stack:
        return None
    top = stack[-1]
    return top if isinstance(top, DeviceMesh) else None


@overload
def get_current_mesh(*, required: Literal[True] = ...) -> DeviceMesh: ...
@overload
def get_current_mesh(*, required: bool) -> DeviceMesh | None: ...
def get_current_mesh(*, required: bool = True) -> DeviceMesh | None:
    """Return the innermost mesh made current by :func:`use_mesh` (or torch's ``with mesh:``).

    Args:
        required: when True (the default) a missing mesh is an error; when False it gives None.

    Returns:
        The current mesh, or None when ``required`` is False and no mesh is current.

    Raises:
        RuntimeError: when no mesh is current and ``required`` is True.

    See Also:
        :pt:`torch.distributed.device_mesh.DeviceMesh.__enter__`: torch's mesh context.
    """
    stack = _MESH_STACK.get()
    if stack:
        return stack[-1]
    mesh = _torch_current_mesh()
    if mesh is None and required:
        raise RuntimeError(
            "no device mesh is current: enter one with `with hp_dtensor.use_mesh(mesh):`"
        )
    return mesh


@contextlib.contextmanager
def use_mesh(mesh: DeviceMesh) -> Iterator[DeviceMesh]:
    """Make ``mesh`` the current mesh inside a ``with`` block (nests; restored on exit).

    Args:
        mesh: the mesh.

    Yields:
        The mesh.

    Raises:
        TypeError: when ``mesh`` is not a DeviceMesh.

    See Also:
        :pt:`torch.distributed.device_mesh.DeviceMesh`: ``with mesh:`` is torch's equivalent.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"use_mesh expects a DeviceMesh, got {type(mesh).__name__}")
    token = _MESH_STACK.set((*_MESH_STACK.get(), mesh))
    try:
        with mesh:
            yield mesh
    finally:
        _MESH_STACK.reset(token)


def init_mesh(
    mesh_shape: Sequence[int] | int,
    mesh_dim_names: Sequence[str] | None = None,
    *,
    device_type: str | None = None,
    backend_override: dict[int | str, str] | None = None,
) -> DeviceMesh:
    """Create a device mesh over the default group on the detected device type.

    This is ``init_device_mesh`` with the device type defaulting to
    :func:`hp_dtensor.device.get_device_type` (torch's ``init_device_mesh`` is re-exported
    unchanged).

    Args:
        mesh_shape: the mesh sizes (their product must equal the world size).
        mesh_dim_names: one unique name per mesh axis.
        device_type: overrides the detected device type.
        backend_override: per-axis backend overrides, as in torch.

    Returns:
        The mesh.

    Raises:
        ValueError: for a shape that does not match the world size, or bad names.

    See Also:
        :pt:`torch.distributed.device_mesh.init_device_mesh`: PyTorch's mesh constructor.
    """
    import torch.distributed as dist

    shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(int(s) for s in mesh_shape)
    if not shape or any(s <= 0 for s in shape):
        raise ValueError(f"mesh_shape must be positive sizes, got {mesh_shape!r}")
    if dist.is_initialized() and math.prod(shape) != dist.get_world_size():
        raise ValueError(
            f"mesh_shape {shape} has {math.prod(shape)} ranks but the world size is "
            f"{dist.get_world_size()}"
        )
    names: tuple[str, ...] | None = None
    if mesh_dim_names is not None:
        names = tuple(mesh_dim_names)
        if len(names) != len(shape):
            raise ValueError(
                f"mesh_dim_names {names} must have one name per axis of mesh_shape {shape}"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"mesh_dim_names must be unique, got {names}")
    return init_device_mesh(
        device_type if device_type is not None else get_device_type(),
        shape,
        mesh_dim_names=names,
        backend_override=dict(backend_override) if backend_override else None,
    )


def _names_of(names: str | Sequence[str]) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names)


def _check_names(mesh: DeviceMesh, names: tuple[str, ...]) -> None:
    have = mesh.mesh_dim_names
    if have is None:
        raise ValueError("the mesh has no mesh_dim_names; axes cannot be taken by name")
    if not names:
        raise ValueError("give at least one mesh axis name")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh axis names must not repeat, got {names}")
    unknown = [name for name in names if name not in have]
    if unknown and not _flattened_known(mesh, unknown):
        raise ValueError(f"unknown mesh axis name(s) {unknown}; the mesh has {tuple(have)}")


def _flattened_known(mesh: DeviceMesh, names: list[str]) -> bool:
    """True when every name is a flattened axis registered on the root mesh."""
    try:
        for name in names:
            mesh[name]
    except (KeyError, RuntimeError, ValueError):
        return False
    return True


def get_submesh(mesh: DeviceMesh, names: str | Sequence[str]) -> DeviceMesh:
    """Take the sub-mesh of one or more axes by name (in the order given).

    Args:
        mesh: the mesh.
        names: one axis name or a sequence of names.

    Returns:
        The sub-mesh containing this rank.

    Raises:
        ValueError: for an unknown or repeated name or a mesh without names.

    See Also:
        :pt:`torch.distributed.device_mesh.DeviceMesh.__getitem__`: torch's slicing.
    """
    axes = _names_of(names)
    _check_names(mesh, axes)
    return mesh[axes[0]] if len(axes) == 1 else mesh[axes]


def flatten_axes(
    mesh: DeviceMesh, names: str | Sequence[str], flat_name: str | None = None
) -> DeviceMesh:
    """Flatten several mesh axes into one 1-D mesh (registered on the root as ``flat_name``).

    Args:
        mesh: the mesh.
        names: the axes to flatten, in mesh order.
        flat_name: the name of the flattened axis; default ``"_".join(names)``.

    Returns:
        A 1-D mesh whose only axis is ``flat_name``.

    Raises:
        ValueError: for unknown or repeated names.

    See Also:
        :pt:`torch.distributed.device_mesh.DeviceMesh._flatten`: torch's (private) flattening.
    """
    axes = _names_of(names)
    _check_names(mesh, axes)
    sub = mesh[axes[0]] if len(axes) == 1 else mesh[axes]
    return flatten_mesh(sub, flat_name if flat_name is not None else "_".join(axes))


def mesh_axis_size(mesh: DeviceMesh, name: str) -> int:
    """Return the size of a named mesh axis.

    Args:
        mesh: the mesh.
        name: the axis name.

    Returns:
        The number of ranks along the axis.

    Raises:
        ValueError: for an unknown name.

    See Also:
        :pt:`torch.distributed.device_mesh.DeviceMesh.size`: torch's per-dim size.
    """
    _check_names(mesh, (name,))
    return int(mesh[name].size())
