"""Every private PyTorch name hp-dtensor uses, resolved once at import.

A PyTorch upgrade that renames or removes one of them fails here, at import, with an error that
names the missing name and the installed torch version, instead of somewhere deep in a call (or
silently). ``scripts/tests/test_torch_compat.py`` lists these names and checks that no other
module of the stack reaches into PyTorch's private API.

:func:`require` and :func:`require_module` are the checker the other packages' compat modules
use too.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

__all__ = [
    "PRIVATE_NAMES",
    "TESTED_TORCH_VERSIONS",
    "DTensorSpec",
    "FakeStore",
    "IncompatibleKeys",
    "OpOverload",
    "OpSpec",
    "OpStrategy",
    "StridedShard",
    "TorchDispatchMode",
    "c10d_world",
    "clear_native_sharding_propagator_cache",
    "clear_sharding_prop_cache",
    "compute_local_shape_and_global_offset",
    "detect_fake_mode",
    "dtensor_ops_utils",
    "dtensor_sharding_propagator",
    "flatten_mesh",
    "local_tensor",
    "mesh_broadcast",
    "mesh_resources",
    "missing_torch_name",
    "redistribute_transform_infos",
    "require",
    "require_module",
    "split_tensor",
    "tree_flatten",
    "tree_map",
]

TESTED_TORCH_VERSIONS = ("2.13.0",)


def missing_torch_name(package: str, qualname: str) -> ImportError:
    """The error raised when this torch lacks a private name ``package`` relies on."""
    return ImportError(
        f"{package} needs the PyTorch internal `{qualname}`, which the installed torch "
        f"{torch.__version__} does not provide (tested with torch "
        f"{', '.join(TESTED_TORCH_VERSIONS)}); see {package}'s _torch_compat.py"
    )


def require_module(package: str, qualname: str) -> ModuleType:
    """Import the (private) module ``qualname`` or raise :func:`missing_torch_name`'s error."""
    try:
        return importlib.import_module(qualname)
    except ImportError as exc:
        raise missing_torch_name(package, qualname) from exc


def require(package: str, qualname: str) -> Any:
    """Resolve ``module.attr[.attr...]`` (the longest importable prefix is the module; the
    whole name may be a module too)."""
    parts = qualname.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attr in parts[split:]:
                value = getattr(value, attr)
        except AttributeError as exc:
            raise missing_torch_name(package, qualname) from exc
        return value
    raise missing_torch_name(package, qualname)


_PACKAGE = "hp-dtensor"

try:
    from torch._ops import OpOverload
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy
    from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
    from torch.nn.modules.module import _IncompatibleKeys as IncompatibleKeys
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_map
except ImportError as _exc:  # pragma: no cover - only on an unsupported torch
    raise missing_torch_name(_PACKAGE, _exc.name or str(_exc)) from _exc

mesh_broadcast = require(_PACKAGE, "torch.distributed.tensor._collective_utils.mesh_broadcast")
compute_local_shape_and_global_offset = require(
    _PACKAGE, "torch.distributed.tensor._utils.compute_local_shape_and_global_offset"
)
mesh_resources = require(_PACKAGE, "torch.distributed.device_mesh._mesh_resources")
if not hasattr(mesh_resources, "mesh_stack"):  # pragma: no cover - only on an unsupported torch
    raise missing_torch_name(_PACKAGE, "torch.distributed.device_mesh._mesh_resources.mesh_stack")
dtensor_sharding_propagator = require(
    _PACKAGE, "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator"
)
clear_native_sharding_propagator_cache = require(
    _PACKAGE, "torch._C._clear_DTensor_sharding_propagator_cache"
)
dtensor_ops_utils = require_module(_PACKAGE, "torch.distributed.tensor._ops.utils")
if not hasattr(dtensor_ops_utils, "expand_to_full_mesh_op_strategy"):  # pragma: no cover
    raise missing_torch_name(
        _PACKAGE, "torch.distributed.tensor._ops.utils.expand_to_full_mesh_op_strategy"
    )
_META_ENTRY = "_propagate_tensor_meta_non_cached"  # the memo of hp_dtensor.testing wraps it
if not hasattr(dtensor_sharding_propagator, _META_ENTRY):  # pragma: no cover - other torch
    raise missing_torch_name(
        _PACKAGE,
        f"torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator.{_META_ENTRY}",
    )
DTensorSpec: Any = require(_PACKAGE, "torch.distributed.tensor._dtensor_spec.DTensorSpec")
detect_fake_mode: Any = require(_PACKAGE, "torch._guards.detect_fake_mode")
redistribute_transform_infos = require(
    _PACKAGE, "torch.distributed.tensor._redistribute._gen_transform_infos"
)
_python_sharding_prop_cache = require(
    _PACKAGE,
    "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding",
)
if not hasattr(_python_sharding_prop_cache, "cache_clear"):  # pragma: no cover - other torch
    raise missing_torch_name(
        _PACKAGE,
        "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator."
        "propagate_op_sharding.cache_clear",
    )


def clear_sharding_prop_cache() -> None:
    """Both of DTensor's sharding-propagation caches: the Python one and the native fast path's.

    What ``torch.distributed.tensor.debug._clear_sharding_prop_cache`` does, without importing
    that module (it imports torch._dynamo and torch._inductor).
    """
    _python_sharding_prop_cache.cache_clear()
    clear_native_sharding_propagator_cache()


c10d_world = require(_PACKAGE, "torch.distributed.distributed_c10d._world")
FakeStore = require(_PACKAGE, "torch.testing._internal.distributed.fake_pg.FakeStore")

# Private methods and attributes reached on instances: checked here once, used through the
# functions below (a static check cannot see ``obj._name`` on an instance).
for _qualname in (
    "torch.distributed.device_mesh.DeviceMesh._flatten",
    "torch.distributed.tensor.placement_types.Shard._split_tensor",
    "torch.distributed.tensor.placement_types._StridedShard._split_tensor",
    "torch._C._dispatch_keys",
    "torch._C._dispatch_keyset_full_after",
    "torch._C.DispatchKey",
):
    require(_PACKAGE, _qualname)
if "_local_tensor" not in getattr(DTensor, "__slots__", ()):
    raise missing_torch_name(_PACKAGE, "torch.distributed.tensor.DTensor._local_tensor")


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh._flatten(name)``: torch's 1-D mesh over all of ``mesh``'s axes, named ``name``."""
    return mesh._flatten(name)


def split_tensor(
    placement: Shard | StridedShard, tensor: torch.Tensor, num_chunks: int
) -> tuple[list[torch.Tensor], list[int]]:
    """``placement._split_tensor``: contiguous, unpadded pieces (``_StridedShard``'s own split)."""
    return placement._split_tensor(tensor, num_chunks, with_padding=False, contiguous=True)


def local_tensor(dtensor: DTensor) -> torch.Tensor:
    """``dtensor._local_tensor``: the local shard itself (no autograd edge, unlike ``to_local``)."""
    return dtensor._local_tensor


PRIVATE_NAMES = (
    "torch._ops.OpOverload",
    "torch.distributed.tensor._op_schema.OpSpec",
    "torch.distributed.tensor._op_schema.OpStrategy",
    "torch.distributed.tensor._ops.utils",
    "torch.distributed.tensor._ops.utils.expand_to_full_mesh_op_strategy",
    "torch.distributed.tensor.placement_types._StridedShard",
    "torch.nn.modules.module._IncompatibleKeys",
    "torch.utils._python_dispatch.TorchDispatchMode",
    "torch.utils._pytree.tree_flatten",
    "torch.utils._pytree.tree_map",
    "torch.distributed.tensor._collective_utils.mesh_broadcast",
    "torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
    "torch.distributed.device_mesh._mesh_resources",
    "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator",
    "torch._C._clear_DTensor_sharding_propagator_cache",
    "torch.distributed.tensor._redistribute._gen_transform_infos",
    "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding",
    "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator."
    "_propagate_tensor_meta_non_cached",
    "torch.distributed.tensor._dtensor_spec.DTensorSpec",
    "torch._guards.detect_fake_mode",
    "torch.distributed.distributed_c10d._world",
    "torch.testing._internal.distributed.fake_pg.FakeStore",
    "torch.distributed.device_mesh.DeviceMesh._flatten",
    "torch.distributed.tensor.placement_types.Shard._split_tensor",
    "torch.distributed.tensor.placement_types._StridedShard._split_tensor",
    "torch._C._dispatch_keys",
    "torch._C._dispatch_keyset_full_after",
    "torch._C.DispatchKey",
)
