"""A drop-in replacement for PyTorch FSDP2 (`fully_shard`) with its own runtime.

See Also:
    :pt:`torch.distributed.fsdp.fully_shard`: PyTorch's FSDP2 API.
"""

from hp_dtensor import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from hp_fsdp.__about__ import __version__
from hp_fsdp.api import (
    FSDPModule,
    HSDPModule,
    UnshardHandle,
    disable_fsdp_module_new_init,
    fully_shard,
    get_cls_to_fsdp_cls,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from hp_fsdp.hsdp_utils import (
    apply_gradient_scaling_factor,
    get_hsdp_state,
    hsdp_sync_stream,
    infer_fully_shard_param_mode,
    is_dtensor_managed_param,
)
from hp_fsdp.integrations import install_from_env as _install_from_env
from hp_fsdp.integrations import restore_torch_fsdp, use_hp_fsdp
from hp_fsdp.mesh_info import (
    DataParallelMeshDims,
    DDPMeshInfo,
    FSDPMeshInfo,
    HSDPMeshInfo,
    ShardPlacementResult,
)
from hp_fsdp.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from hp_fsdp.replicate import ReplicateModule, replicate

__all__ = [
    "CPUOffloadPolicy",
    "DDPMeshInfo",
    "DataParallelMeshDims",
    "FSDPMeshInfo",
    "FSDPModule",
    "HSDPMeshInfo",
    "HSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ReplicateModule",
    "ShardPlacementResult",
    "StateDictOptions",
    "UnshardHandle",
    "__version__",
    "apply_gradient_scaling_factor",
    "disable_fsdp_module_new_init",
    "fully_shard",
    "get_cls_to_fsdp_cls",
    "get_hsdp_state",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "hsdp_sync_stream",
    "infer_fully_shard_param_mode",
    "is_dtensor_managed_param",
    "register_fsdp_forward_method",
    "replicate",
    "restore_torch_fsdp",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "share_comm_ctx",
    "use_hp_fsdp",
]

# HP_FSDP_BACKEND=hp: route Accelerate's / the Trainer's FSDP2 to hp-fsdp from this import on
# (last: the switch checks hp_fsdp's names)
_install_from_env()
