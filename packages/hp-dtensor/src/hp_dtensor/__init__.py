"""DTensor substrate of hyper-parallel.

torch's DTensor, DeviceMesh and placements re-exported (the same objects), the device layer, the
mesh context, HyperParallel's ``Layout``, sharded initialization, the state-dict helpers,
``SkipDTensorDispatch`` and custom sharding rules. The distributed test harness lives in
``hp_dtensor.testing``.

See Also:
    :pt:`torch.distributed.tensor`: PyTorch's DTensor package.
"""

from typing import TYPE_CHECKING, Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.experimental import implicit_replication, local_map, register_sharding

from hp_dtensor import device
from hp_dtensor.__about__ import __version__
from hp_dtensor.dispatch import SkipDTensorDispatch, register_sharding_rule, sharding_rule
from hp_dtensor.init import (
    get_init_fn,
    init_empty_weights,
    init_on_device,
    init_parameters,
    register_init_fn,
)
from hp_dtensor.layout import Layout, distribute_with_layout, from_local_with_layout
from hp_dtensor.mesh import (
    flatten_axes,
    get_current_mesh,
    get_submesh,
    init_mesh,
    mesh_axis_size,
    use_mesh,
)
from hp_dtensor.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

__all__ = [
    "CommDebugMode",
    "DTensor",
    "DeviceMesh",
    "Layout",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "SkipDTensorDispatch",
    "StateDictOptions",
    "__version__",
    "device",
    "distribute_module",
    "distribute_tensor",
    "distribute_with_layout",
    "flatten_axes",
    "from_local_with_layout",
    "get_current_mesh",
    "get_init_fn",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "get_submesh",
    "implicit_replication",
    "init_device_mesh",
    "init_empty_weights",
    "init_mesh",
    "init_on_device",
    "init_parameters",
    "local_map",
    "mesh_axis_size",
    "register_init_fn",
    "register_sharding",
    "register_sharding_rule",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "sharding_rule",
    "use_mesh",
]


if TYPE_CHECKING:
    from torch.distributed.tensor.debug import CommDebugMode


def __getattr__(name: str) -> Any:
    # torch.distributed.tensor.debug imports torch._dynamo and torch._inductor (about 1.6 CPU
    # seconds): only a user of CommDebugMode pays for them, not every process importing the stack
    if name == "CommDebugMode":
        from torch.distributed.tensor.debug import CommDebugMode

        return CommDebugMode
    raise AttributeError(f"module 'hp_dtensor' has no attribute {name!r}")
