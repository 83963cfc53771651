"""Sharded initialization: build on the meta device, then materialize only the local shards.

Three pieces:

- :func:`init_empty_weights` / :func:`init_on_device` build a module with its parameters (and
  optionally buffers) on the meta device or another device, without running initializers for real.
- :func:`init_parameters` materializes meta parameters and buffers, plain or DTensor on any mesh
  and placements (uneven shards included), so that each rank keeps only its local shard and the
  *global* values equal those of a single CPU process (see its docstring for the exact contract).
- :func:`register_init_fn` registers the initializer of a module class that has no (or a
  different) ``reset_parameters``. Buffers computed in ``__init__`` (RoPE tables and the like)
  are recomputed through the *buffer protocol*: the module defines ``reset_buffers(self)``, which
  recomputes (in place, or by reassigning) every buffer it owns directly.

See Also:
    :pt:`torch.nn.Module.to_empty`: PyTorch's materialization (unties tied parameters, no values).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from hp_dtensor._torch_compat import StridedShard as _StridedShard
from hp_dtensor._torch_compat import TorchDispatchMode, local_tensor, split_tensor, tree_flatten
from hp_dtensor.device import DEVICE_TYPE_CPU, DEVICE_TYPE_META, get_device

__all__ = [
    "BUFFER_INIT_METHOD",
    "get_init_fn",
    "init_empty_weights",
    "init_on_device",
    "init_parameters",
    "register_init_fn",
]

BUFFER_INIT_METHOD = "reset_buffers"
"""Name of the buffer protocol method: ``module.reset_buffers()`` recomputes its own buffers."""

InitFn = Callable[[nn.Module], None]
T = TypeVar("T", bound=nn.Module)

# Registry keyed by class (allowed global state: not keyed by id(), no pending communication).
# Each entry: (initializer, runs after the module's children).
_INIT_FNS: dict[type[nn.Module], tuple[InitFn, bool]] = {}


def register_init_fn(
    module_type: type[nn.Module], fn: InitFn | None = None, *, after_children: bool = False
) -> Any:
    """Register the initializer of a module class for :func:`init_parameters`.

    ``fn(module)`` must initialize, in place, every parameter and buffer that ``module`` owns
    directly. It takes precedence over ``reset_parameters``. Can be used as a decorator:
    ``@register_init_fn(MyNorm)``. The most specific class in the MRO wins.

    Args:
        module_type: an ``nn.Module`` subclass.
        fn: the initializer; omitted when used as a decorator.
        after_children: run it after the module's children were initialized (for constructors
            that build their children first and then initialize their own tensors, such as
            ``nn.MultiheadAttention``); it may then also write its children's tensors, which are
            materialized by then (keyword-only extension).

    Returns:
        ``fn`` (or a decorator that registers and returns its argument).

    Raises:
        TypeError: when ``module_type`` is not an ``nn.Module`` subclass or ``fn`` not callable.

    See Also:
        :pt:`torch.nn.Linear.reset_parameters`: the initializer PyTorch layers define.
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type must be an nn.Module subclass, got {module_type!r}")

    def register(function: InitFn) -> InitFn:
        if not callable(function):
            raise TypeError(f"the initializer must be callable, got {function!r}")
        _INIT_FNS[module_type] = (function, after_children)
        return function

    return register if fn is None else register(fn)


def _lookup(module: nn.Module) -> tuple[InitFn | None, bool]:
    for cls in type(module).__mro__:
        entry = _INIT_FNS.get(cls)
        if entry is not None:
            return entry
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        return (lambda m: m.reset_parameters()), False
    return None, False


def get_init_fn(module: nn.Module) -> InitFn | None:
    """Return the initializer :func:`init_parameters` would run for ``module``'s own tensors.

    Args:
        module: the module.

    Returns:
        The registered function (by MRO), else a call of ``module.reset_parameters``, else None.

    See Also:
        :pt:`torch.nn.Linear.reset_parameters`: the initializer PyTorch layers define.
    """
    return _lookup(module)[0]


def _init_multihead_attention(module: nn.Module) -> None:
    # torch builds out_proj first, then runs _reset_parameters (which also zeroes out_proj.bias)
    module._reset_parameters()  # type: ignore[operator]


register_init_fn(nn.MultiheadAttention, _init_multihead_attention, after_children=True)


@contextlib.contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool = False) -> Iterator[None]:
    """Create the parameters (and with ``include_buffers`` the buffers) of new modules on a device.

    Parameters registered inside the block are moved to ``device`` as they are registered (their
    constructor-time initialization runs on the moved tensor, so on ``"meta"`` it costs nothing).
    With ``include_buffers=True`` every tensor created inside the block lands on ``device``.

    Args:
        device: the device.
        include_buffers: also put buffers (and all other new tensors) on ``device``.

    Yields:
        Nothing.

    See Also:
        ``accelerate.init_on_device``: the Hugging Face API this mirrors;
        :pt:`torch.device` used as a context manager.
    """
    target = torch.device(device)
    if include_buffers:
        with target:
            yield
        return
    original = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None and param.device != target:
            kwargs = dict(param.__dict__)
            new = param.to(target)
            moved = type(param)(new, requires_grad=param.requires_grad)
            moved.__dict__.update(kwargs)
            self._parameters[name] = moved

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Build modules with their parameters on the meta device (no memory, no initialization).

    Follow with :func:`init_parameters` (after ``torch.manual_seed``) to materialize them.

    Args:
        include_buffers: also put buffers on the meta device (then they must be recomputable: see
            the buffer protocol in :func:`init_parameters`).

    Yields:
        Nothing.

    See Also:
        ``accelerate.init_empty_weights``: the Hugging Face API this mirrors.
    """
    with init_on_device(DEVICE_TYPE_META, include_buffers=include_buffers):
        yield


class _ForbidMetaMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Fail when an initializer touches a tensor that is still on the meta device."""

    def __init__(self, module_name: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.module_name = module_name

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        leaves, _ = tree_flatten((args, kwargs or {}))
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.is_meta:
                raise ValueError(
                    f"the initializer of module {self.module_name!r} used a tensor on the meta "
                    f"device (op {func}); an initializer may only touch the parameters and "
                    "buffers its module owns directly (register one with register_init_fn)"
                )
        return func(*args, **(kwargs or {}))


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_meta(tensor: torch.Tensor) -> bool:
    if isinstance(tensor, DTensor):
        return bool(local_tensor(tensor).is_meta)
    return bool(tensor.is_meta)


def _materialize(full: torch.Tensor, like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Build the tensor that replaces meta ``like``: its local shard of ``full``, on its device."""
    if isinstance(like, DTensor):
        mesh = like.device_mesh
        for placement in like.placements:
            if placement.is_partial():
                raise ValueError(
                    f"cannot initialize a DTensor with a Partial placement ({like.placements})"
                )
        target = torch.device(mesh.device_type)
        if target.type != DEVICE_TYPE_CPU:
            target = get_device()
        local = _local_shard(full, mesh, like.placements).to(target)
        return DTensor.from_local(
            local, mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
        )
    return full.to(device)


def _local_shard(
    full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]
) -> torch.Tensor:
    """This rank's shard of ``full``, cut on the host without communication.

    The same split as ``distribute_tensor(full, mesh, placements, src_data_rank=None)``, which
    would first move the full tensor to the mesh's device.
    """
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not part of the mesh
        return full.new_empty(0)
    local = full
    for axis, placement in enumerate(placements):
        if isinstance(placement, Shard | _StridedShard):
            pieces, _ = split_tensor(placement, local, mesh.size(axis))
            local = pieces[coordinate[axis]]
    return local.clone(memory_format=torch.contiguous_format)


def _tracks_elements(dtype: torch.dtype) -> bool:
    """Whether scratch of ``dtype`` is NaN-filled, so unwritten elements can be found."""
    return (dtype.is_floating_point and dtype.itemsize >= 2) or dtype.is_complex


def _scratch(tensor: torch.Tensor) -> torch.Tensor:
    """A full-size CPU tensor to run an initializer into.

    Floating scratch starts as NaN: after the initializer, a NaN left means an element it did not
    write, whatever path the write took (in place, through ``.data``, or by assigning ``.data``).
    """
    shape, dtype = tuple(tensor.shape), tensor.dtype
    if _tracks_elements(dtype):
        return torch.full(shape, math.nan, dtype=dtype, device=DEVICE_TYPE_CPU)
    return torch.zeros(shape, dtype=dtype, device=DEVICE_TYPE_CPU)


def _unwritten(value: torch.Tensor, scratch: torch.Tensor, version: int, address: int) -> int:
    """How many elements of ``value`` (a slot's content after the initializer) were not written.

    A tensor assigned to the slot counts as written. For floating scratch the NaN sentinel is
    counted; for other dtypes (no free sentinel value) any change of version, storage or content
    counts as a complete write.
    """
    if value is not scratch:
        return 0
    if _tracks_elements(value.dtype):
        return int(torch.isnan(value).sum())
    changed = value._version != version or value.data_ptr() != address or bool(value.any())
    return 0 if changed else value.numel()


def _as_parameter(value: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    """A parameter holding ``value`` with ``like``'s ``requires_grad`` and Python attributes."""
    cls = type(like)
    if issubclass(cls, nn.Parameter) and cls is not nn.Parameter and not isinstance(value, DTensor):
        param = cls(value, requires_grad=like.requires_grad)
    else:
        param = nn.Parameter(value, requires_grad=like.requires_grad)
    _keep_attributes(param, like)
    return param


def _keep_attributes(new: torch.Tensor, old: torch.Tensor) -> None:
    """Copy user attributes of ``old`` (tags set by engines) that ``new`` lacks.

    ``torch.utils.swap_tensors`` exchanges the ``__dict__`` of the two objects, so without this
    attributes set on a meta parameter would be lost.
    """
    for key, value in vars(old).items():
        if key not in vars(new):
            setattr(new, key, value)


def init_parameters(
    module: T,
    *,
    device: torch.device | str | None = None,
    reinitialize: bool = False,
) -> T:
    """Materialize meta parameters and buffers with single-process values, keeping local shards.

    **Contract.** After ``torch.manual_seed(s); init_parameters(m)``, the global value of every
    parameter and buffer of ``m`` equals the one obtained by ``torch.manual_seed(s)`` followed by
    each module's initializer replayed in registration pre-order (``m.named_modules()``; a module
    whose initializer was registered with ``after_children=True`` runs after its children) in one
    CPU process. A module's initializer is the function registered with
    :func:`register_init_fn` for its class, else its ``reset_parameters()``; it is followed by its
    ``reset_buffers()`` when the module defines one (the buffer protocol). For modules built from
    standard layers in registration order this equals building the module for real after
    ``torch.manual_seed(s)``, and the CPU generator is left in the same state.

    **Method.** For each module, the initializer runs on full-size CPU scratch tensors in place of
    the module's own parameters and buffers, on the global CPU generator. Each meta tensor is then
    replaced by its value: a plain tensor moves to ``device``; a DTensor keeps only this rank's
    local shard (any mesh, any Shard/_StridedShard/Replicate placements, uneven shards
    included), without communication, and the full tensor is freed. On accelerators the values
    are generated on the CPU and copied, so every device gets the same numbers. Parameter objects
    keep their identity (``torch.utils.swap_tensors``), so tied parameters stay tied: the first
    holder in registration order owns the value; the other holders' initializers still run into
    scratch so that their random draws are consumed. Tensors already materialized keep their
    values (their initializer still runs into scratch to consume the same draws).

    **Limits.** Constructors that create layers in an order different from their registration
    order, randomness outside the CPU generator (``numpy``, ``random``), initializers that read or
    write tensors of *other* modules (a clear ``ValueError`` is raised when such a tensor is still
    on the meta device), and one module's full tensors must fit in host memory at once (very
    large embeddings), DTensors with a ``Partial`` placement (rejected).

    Args:
        module: the module (modified in place).
        device: the device of plain (non-DTensor) tensors; default
            :func:`hp_dtensor.device.get_device`. A DTensor goes to its mesh's device.
        reinitialize: also overwrite tensors that are already materialized (for example after
            ``module.to_empty(device=...)``); by default they keep their values.

    Returns:
        ``module``.

    **Writes.** An initializer may write in place, through ``.data`` (``w.data.normal_()``,
    HuggingFace style), assign ``w.data = ...`` or assign a new tensor. Floating scratch starts as
    NaN, so an element an initializer left unwritten is found, whichever path it took; for other
    dtypes only "not written at all" is detected (no free sentinel value).

    Raises:
        ValueError: when a meta parameter or buffer has no initializer that writes it (naming
            it), when an initializer wrote a floating tensor only partly (naming it and the
            count of unset elements), when an initializer touches another module's meta tensor,
            or when ``module`` holds no meta tensor at all and ``reinitialize`` is False.

    See Also:
        :pt:`torch.nn.Module.to_empty`: PyTorch's materialization (no values, unties tied
        parameters); :pt:`torch.distributed.fsdp.fully_shard` docs on meta-device init.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"init_parameters expects an nn.Module, got {type(module).__name__}")
    target = torch.device(device) if device is not None else get_device()
    if not reinitialize and not any(_is_meta(t) for t in (*module.parameters(), *module.buffers())):
        raise ValueError(
            "init_parameters found no parameter or buffer on the meta device; build the module "
            "under hp_dtensor.init_empty_weights() first, or pass reinitialize=True to overwrite "
            "materialized tensors"
        )
    pending = _is_meta if not reinitialize else _always
    # Within this call only: the objects already materialized (first holder owns the value).
    done: dict[int, torch.Tensor] = {}
    keep_alive: list[torch.Tensor] = []
    visited: set[nn.Module] = set()
    with torch.no_grad():
        _visit(module, "", target, done, keep_alive, visited, pending)
    return module


def _always(tensor: torch.Tensor) -> bool:
    return True


def _visit(
    module: nn.Module,
    prefix: str,
    device: torch.device,
    done: dict[int, torch.Tensor],
    keep_alive: list[torch.Tensor],
    visited: set[nn.Module],
    pending: Callable[[torch.Tensor], bool],
) -> None:
    """Registration pre-order (``named_modules``), or post-order for ``after_children`` fns."""
    if module in visited:
        return
    visited.add(module)
    init_fn, after_children = _lookup(module)
    if not after_children:
        _init_one(module, prefix, init_fn, device, done, keep_alive, pending)
    for name, child in module._modules.items():
        if child is not None:
            _visit(child, _qualified(prefix, name), device, done, keep_alive, visited, pending)
    if after_children:
        _init_one(module, prefix, init_fn, device, done, keep_alive, pending)


def _init_one(
    module: nn.Module,
    prefix: str,
    init_fn: InitFn | None,
    device: torch.device,
    done: dict[int, torch.Tensor],
    keep_alive: list[torch.Tensor],
    pending: Callable[[torch.Tensor], bool],
) -> None:
    own: list[tuple[str, str, torch.Tensor]] = [
        ("param", name, p) for name, p in module._parameters.items() if p is not None
    ]
    own += [("buffer", name, b) for name, b in module._buffers.items() if b is not None]
    if not own:
        return
    reset_buffers = getattr(module, BUFFER_INIT_METHOD, None)
    has_buffer_init = callable(reset_buffers)
    needs = [(kind, name, t) for kind, name, t in own if pending(t) and id(t) not in done]
    if init_fn is None and not has_buffer_init:
        if needs:
            kind, name, _ = needs[0]
            raise ValueError(
                f"{kind} {_qualified(prefix, name)!r} of {type(module).__name__} needs a value "
                "but has no initializer: define reset_parameters(), register one with "
                f"hp_dtensor.register_init_fn, or (for buffers) define {BUFFER_INIT_METHOD}()"
            )
        return
    # Swap in full-size CPU scratch tensors, run the initializer(s), read back, restore.
    originals = {(kind, name): t for kind, name, t in own}
    scratch: dict[tuple[str, str], torch.Tensor] = {}
    for kind, name, t in own:
        s = _scratch(t)
        if kind == "param":
            assert isinstance(t, nn.Parameter)
            s = nn.Parameter(s, requires_grad=t.requires_grad)
            module._parameters[name] = s
        else:
            module._buffers[name] = s
        scratch[(kind, name)] = s
    # .data writes bypass the version counter: remember storage addresses too.
    versions = {key: (s._version, s.data_ptr()) for key, s in scratch.items()}
    try:
        with _ForbidMetaMode(prefix or type(module).__name__):
            if init_fn is not None:
                init_fn(module)
            if has_buffer_init:
                assert reset_buffers is not None
                reset_buffers()
        results: dict[tuple[str, str], torch.Tensor] = {}
        for kind, name, _ in own:
            slots: dict[str, Any] = module._parameters if kind == "param" else module._buffers
            value = slots[name]
            results[(kind, name)] = value
            original = originals[(kind, name)]
            if not pending(original) or id(original) in done:
                continue
            missing = _unwritten(value, scratch[(kind, name)], *versions[(kind, name)])
            if missing == value.numel():
                raise ValueError(
                    f"{kind} {_qualified(prefix, name)!r} of {type(module).__name__} needs a "
                    "value but its module's initializer did not write it; register an "
                    f"initializer with hp_dtensor.register_init_fn (or {BUFFER_INIT_METHOD}() "
                    "for buffers)"
                )
            if missing:
                raise ValueError(
                    f"{kind} {_qualified(prefix, name)!r} of {type(module).__name__} was only "
                    f"partly written by its module's initializer: {missing} of {value.numel()} "
                    "elements were left unset (they would hold garbage); the initializer must "
                    "write every element"
                )
    finally:
        for (kind, name), original in originals.items():
            if kind == "param":
                module._parameters[name] = original  # type: ignore[assignment]
            else:
                module._buffers[name] = original
    for kind, name, original in own:
        key = id(original)
        if key in done:  # a tied tensor: its first holder owns the value
            if done[key] is not original:  # it was replaced, not swapped: re-point this holder
                setattr(module, name, done[key])
            continue
        if not pending(original):
            continue  # already materialized: keep its values
        full = results[(kind, name)].detach()
        if full.dtype != original.dtype or tuple(full.shape) != tuple(original.shape):
            raise ValueError(
                f"the initializer of {_qualified(prefix, name)!r} produced shape "
                f"{tuple(full.shape)} / {full.dtype}, expected {tuple(original.shape)} / "
                f"{original.dtype}"
            )
        value = _materialize(full, original, device)
        del full
        if kind == "param":
            assert isinstance(original, nn.Parameter)
            value = _as_parameter(value, original)
        elif type(original) is not type(value):
            raise ValueError(
                f"cannot materialize a buffer of type {type(original).__name__} from "
                f"{type(value).__name__}"
            )
        else:
            _keep_attributes(value, original)
        if _swap(original, value):
            done[key] = original
        else:  # weakly referenced: replace it in its slot (module __setattr__ hooks see it)
            setattr(module, name, value)
            done[key] = value
        keep_alive.append(original)


def _swap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Give ``a`` the contents of ``b`` while keeping the Python object ``a``.

    Returns:
        False when ``a`` has weak references (``nn.LSTM`` keeps some to its parameters), which
        ``torch.utils.swap_tensors`` refuses; the caller then replaces the tensor in its slot.
    """
    if weakref.getweakrefcount(a) > 0:
        return False
    torch.utils.swap_tensors(a, b)  # type: ignore[no-untyped-call]
    return True
