"""FSDP/HSDP wrapping of a decoder: unit boundaries, weight tying, MoE expert sharding, prefetch."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from hp_dtensor import device as hp_device
from hp_trainer._parallel_api import (
    CPUOffloadPolicy,
    FSDPMeshInfo,
    FSDPModule,
    HSDPMeshInfo,
    MixedPrecisionPolicy,
    ShardPlacementResult,
    fully_shard,
)

__all__ = [
    "apply_fsdp_to_decoder",
    "disable_fsdp_gradient_division",
    "enable_fsdp_symm_mem",
    "get_fsdp_reshard_after_forward_policy",
]

ReshardPolicy = Literal["default", "always", "never"]


def get_fsdp_reshard_after_forward_policy(
    reshard_after_forward_policy: str, pp_enabled: bool
) -> bool:
    """Translate the config's reshard policy into ``fully_shard``'s ``reshard_after_forward``.

    ``"always"`` frees gathered parameters after forward (re-gathered in backward), ``"never"``
    keeps them, ``"default"`` reshards unless pipeline parallelism is on (under PP every
    micro-batch would gather again, which is expensive and not overlapped).

    Args:
        reshard_after_forward_policy: ``"default"``, ``"always"`` or ``"never"``.
        pp_enabled: Whether pipeline parallelism is on.

    Returns:
        The boolean for ``fully_shard(reshard_after_forward=...)``.

    Raises:
        ValueError: For another policy name.

    See Also:
        :titan:`torchtitan.distributed.fsdp.get_fsdp_reshard_after_forward_policy`.
    """
    if reshard_after_forward_policy == "always":
        return True
    if reshard_after_forward_policy == "never":
        return False
    if reshard_after_forward_policy == "default":
        return not pp_enabled
    raise ValueError(
        f"invalid reshard_after_forward policy {reshard_after_forward_policy!r}: expected "
        "'default', 'always' or 'never'"
    )


def _num_experts(experts: nn.Module) -> int:
    value = getattr(experts, "num_experts", None)
    if isinstance(value, int):
        return value
    first = next(experts.parameters(), None)
    if first is None:
        raise ValueError("the MoE experts module has no parameters")
    return int(first.shape[0])


def _shard_dim1_for(params: set[nn.Parameter]) -> Callable[[nn.Parameter], Shard | None]:
    def placement(param: nn.Parameter) -> Shard | None:
        return Shard(1) if param in params else None

    return placement


def _expert_mesh_info(edp_mesh: DeviceMesh, edp_mesh_dims: Any | None) -> FSDPMeshInfo:
    """The mesh info of the expert parameters: FSDP over ``edp_mesh`` (HSDP when 2-D)."""
    if edp_mesh_dims is not None:  # a full SPMD mesh: hp-fsdp picks the dims by their names
        return FSDPMeshInfo(
            edp_mesh, shard_mesh_dim=0, dp_mesh_dims=edp_mesh_dims, spmd_mesh=edp_mesh
        )
    if edp_mesh.ndim == 2:
        return HSDPMeshInfo(edp_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    return FSDPMeshInfo(edp_mesh, shard_mesh_dim=0)


def _experts_on_mesh(
    params: set[nn.Parameter], placement: Shard, mesh_info: FSDPMeshInfo
) -> Callable[[nn.Parameter], ShardPlacementResult | None]:
    def placement_fn(param: nn.Parameter) -> ShardPlacementResult | None:
        return ShardPlacementResult(placement, mesh_info) if param in params else None

    return placement_fn


def apply_fsdp_to_decoder(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    pp_enabled: bool,
    cpu_offload: bool = False,
    reshard_after_forward_policy: str = "default",
    ep_degree: int = 1,
    edp_mesh: DeviceMesh | None = None,
    dp_mesh_dims: Any | None = None,
    edp_mesh_dims: Any | None = None,
    enable_symm_mem: bool = False,
) -> nn.Module:
    """Apply FSDP (1-D mesh) or HSDP (2-D ``(replicate, shard)`` mesh) to a decoder.

    Units, innermost first: with weight tying, ``[tok_embeddings, norm, lm_head]`` form one unit
    (the shared matrix is gathered once; resharded only under ``"always"``); otherwise
    ``tok_embeddings`` is a unit and ``[norm, lm_head]`` another that is not resharded after
    forward unless ``"always"`` (backward needs it first). Every block of ``model.layers`` is a
    unit, then the root. Mixed precision uses ``cast_forward_inputs=False``.

    MoE blocks (``block.moe_enabled`` with experts at ``block.moe.experts``): the experts stay
    in the block's unit. Without expert parallelism they are sharded on dim 1 when the FSDP
    degree exceeds the number of experts (no padding), else dim 0. With ``ep_degree > 1`` they
    get a per-parameter mesh: ``shard_placement_fn`` returns a ``ShardPlacementResult`` on
    ``edp_mesh`` (HSDP when it is 2-D; by name with ``edp_mesh_dims``), sharded on dim 1 when
    ``efsdp * ep`` exceeds the number of experts, so the block unit holds two parameter groups;
    explicit forward/backward prefetch chains are then installed because EP's host syncs defeat
    implicit prefetching.

    Args:
        model: The decoder (``tok_embeddings``, ``layers``, ``norm``, ``lm_head``; any may be
            None on a pipeline stage).
        dp_mesh: Data-parallel mesh (1-D FSDP or 2-D HSDP).
        param_dtype: Compute dtype of parameters.
        reduce_dtype: Gradient-reduction dtype.
        pp_enabled: Whether pipeline parallelism is on (affects the ``"default"`` policy).
        cpu_offload: Offload parameters and gradients to the host.
        reshard_after_forward_policy: ``"default"``, ``"always"`` or ``"never"``.
        ep_degree: Expert-parallel degree.
        edp_mesh: Expert data-parallel mesh (needed when ``ep_degree > 1``).
        dp_mesh_dims: Forwarded to ``fully_shard`` for multi-axis meshes (when not None).
        edp_mesh_dims: The data-parallel dims of ``edp_mesh`` when it is a full SPMD mesh
            (when not None).
        enable_symm_mem: Call :func:`enable_fsdp_symm_mem` afterwards.

    Returns:
        The model (sharded in place).

    Raises:
        ValueError: If ``ep_degree > 1`` without ``edp_mesh``, or for a bad policy.

    See Also:
        :titan:`torchtitan.distributed.fsdp.apply_fsdp_to_decoder`: TorchTitan's wrapper.
    """
    mp_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    fsdp_config: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": mp_policy}
    if cpu_offload:
        fsdp_config["offload_policy"] = CPUOffloadPolicy()
    if dp_mesh_dims is not None:
        fsdp_config["dp_mesh_dims"] = dp_mesh_dims
    reshard = get_fsdp_reshard_after_forward_policy(reshard_after_forward_policy, pp_enabled)
    if ep_degree > 1 and edp_mesh is None:
        raise ValueError(f"ep_degree={ep_degree} needs the expert data-parallel mesh edp_mesh")

    tok = getattr(model, "tok_embeddings", None)
    norm = getattr(model, "norm", None)
    head = getattr(model, "lm_head", None)
    always = reshard_after_forward_policy == "always"
    if getattr(model, "enable_weight_tying", False) and tok is not None and head is not None:
        group = [m for m in (tok, norm, head) if m is not None]
        fully_shard(group, **fsdp_config, reshard_after_forward=always)
    else:
        if tok is not None:
            fully_shard(tok, **fsdp_config, reshard_after_forward=reshard)
        tail = [m for m in (norm, head) if m is not None]
        if tail:
            fully_shard(tail, **fsdp_config, reshard_after_forward=always)

    layers = getattr(model, "layers", None)
    blocks: list[nn.Module] = list(layers.values()) if layers is not None else []
    expert_mesh_info: FSDPMeshInfo | None = None  # one object for all blocks: one group each
    for block in blocks:
        block_config = dict(fsdp_config)
        if getattr(block, "moe_enabled", False):
            experts = block.get_submodule("moe.experts")
            num_experts = _num_experts(experts)
            expert_params = set(experts.parameters())
            if ep_degree > 1:
                assert edp_mesh is not None
                if expert_mesh_info is None:
                    expert_mesh_info = _expert_mesh_info(edp_mesh, edp_mesh_dims)
                dim = 1 if edp_mesh.size() * ep_degree > num_experts else 0
                block_config["shard_placement_fn"] = _experts_on_mesh(
                    expert_params, Shard(dim), expert_mesh_info
                )
            elif dp_mesh.size() > num_experts:
                block_config["shard_placement_fn"] = _shard_dim1_for(expert_params)
        fully_shard(block, **block_config, reshard_after_forward=reshard)

    fully_shard(model, **fsdp_config)

    if ep_degree > 1 and blocks:
        _set_ep_prefetch_chains(model, blocks, tok, norm, head)
    if enable_symm_mem:
        enable_fsdp_symm_mem(model)
    return model


def _set_ep_prefetch_chains(
    model: nn.Module,
    blocks: list[nn.Module],
    tok: nn.Module | None,
    norm: nn.Module | None,
    head: nn.Module | None,
) -> None:
    tail = norm if norm is not None else head
    tied = getattr(model, "enable_weight_tying", False)
    # forward: embeddings -> block 0 -> ... -> last block -> [norm, lm_head]
    if tok is not None:
        tok.set_modules_to_forward_prefetch([blocks[0]])  # type: ignore[operator]
    for cur, nxt in itertools.pairwise(blocks):
        cur.set_modules_to_forward_prefetch([nxt])  # type: ignore[operator]
    if tail is not None and not tied:
        blocks[-1].set_modules_to_forward_prefetch([tail])  # type: ignore[operator]
    # backward: [norm, lm_head] -> last block -> ... -> block 0 -> embeddings
    if tail is not None:
        tail.set_modules_to_backward_prefetch([blocks[-1]])  # type: ignore[operator]
    for cur, prev in zip(blocks[::-1], blocks[-2::-1], strict=False):
        cur.set_modules_to_backward_prefetch([prev])  # type: ignore[operator]
    if tok is not None and not tied:
        blocks[0].set_modules_to_backward_prefetch([tok])  # type: ignore[operator]


def disable_fsdp_gradient_division(model: nn.Module) -> None:
    """Make FSDP sum gradients over data-parallel ranks instead of averaging them.

    The trainer divides the loss by the global number of tokens, so the reduced gradient must be
    a plain sum (divide factor 1.0).

    Args:
        model: A model containing FSDP units.

    See Also:
        :titan:`torchtitan.distributed.fsdp.disable_fsdp_gradient_division`.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            unit: Any = module
            unit.set_gradient_divide_factor(1.0)
            # With a factor of 1.0 a plain SUM is the same reduction; asking for it keeps
            # backends without PREMUL_SUM (gloo) working with engines that would use it.
            force_sum = getattr(module, "set_force_sum_reduction_for_comms", None)
            if force_sum is not None:
                force_sum(True)


def enable_fsdp_symm_mem(model: nn.Module) -> None:
    """Run FSDP's collectives through symmetric memory with sum reductions.

    A capability: it needs symmetric memory, available on CUDA devices only.

    Args:
        model: A model containing FSDP units.

    Raises:
        RuntimeError: On a device without symmetric memory (e.g. CPU), or when the FSDP engine
            lacks the symmetric-memory switches.

    See Also:
        :titan:`torchtitan.distributed.fsdp.enable_fsdp_symm_mem`.
    """
    kind = hp_device.get_device_type()
    if kind != hp_device.DEVICE_TYPE_CUDA:
        raise RuntimeError(
            "FSDP symmetric memory needs an NVIDIA GPU with SM >= 9.0; this process runs on "
            f"{kind!r}"
        )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            force_sum = getattr(module, "set_force_sum_reduction_for_comms", None)
            symm = getattr(module, "set_symm_mem_for_comm", None)
            if force_sum is None or symm is None:
                raise RuntimeError("this FSDP engine does not provide symmetric-memory comms")
            force_sum(True)
            symm()
