"""Parallel styles for routed experts: EP, EP x TP, and TP when EP = 1.

Each style is a ``torch.distributed.tensor.parallel.ParallelStyle`` applied to a
:class:`~hp_cp_ep.GroupedExperts` module (usually ``moe.experts``) with ``parallelize_module``,
torch's or hp-tp's. It turns the expert weights into DTensor parameters and installs the
module's :class:`~hp_cp_ep.TokenDispatcher`:

=========================  ==========  ====================================  ==================
style                      mesh        ``w1``/``w3`` , ``w2`` placements     dispatch / combine
=========================  ==========  ====================================  ==================
``ExpertParallel``         ``[ep]``    ``Shard(0)``, ``Shard(0)``            all-to-all over ep
``ExpertTensorParallel``   ``[ep,tp]`` ``(Shard(0), Shard(1))``,             all-to-all over ep,
                                       ``(Shard(0), Shard(2))``              all-reduce over tp
``TensorParallel``         ``[tp]``    ``Shard(1)``, ``Shard(2)``            all-reduce over tp
=========================  ==========  ====================================  ==================

Under tensor parallelism the MoE input must be replicated over the TP ranks (as TorchTitan's
plans do with ``PrepareModuleInput``): every TP rank routes the same tokens and computes a slice
of each expert's hidden units.

See Also:
    :titan:`torchtitan.distributed.expert_parallel`: TorchTitan's :titan:`ExpertParallel`,
    ``ExpertTensorParallel`` and ``TensorParallel``.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from hp_cp_ep.ep.dedup import DedupTokenDispatcher
from hp_cp_ep.ep.dispatch import TokenDispatcher

__all__ = ["ExpertParallel", "ExpertTensorParallel", "TensorParallel"]


def _check_experts(module: nn.Module, style: str) -> int:
    """The module's number of experts; a clear error for a module the styles cannot handle."""
    num_experts = getattr(module, "num_experts", None)
    hidden_dims = getattr(module, "hidden_dim_of_weight", None)
    if (
        not isinstance(num_experts, int)
        or not isinstance(hidden_dims, dict)
        or not hasattr(module, "token_dispatcher")
    ):
        raise TypeError(
            f"{style} applies to GroupedExperts-like modules (num_experts, hidden_dim_of_weight, "
            f"token_dispatcher), got {type(module).__name__}"
        )
    for name, param in module.named_parameters(recurse=False):
        if isinstance(param, DTensor):
            raise ValueError(
                f"{style}: {type(module).__name__}.{name} is already a DTensor on "
                f"{param.device_mesh}; apply one expert style per module, once"
            )
        if param.ndim != 3 or param.shape[0] != num_experts:
            raise ValueError(
                f"{style}: {type(module).__name__}.{name} has shape {tuple(param.shape)}, "
                f"expected [num_experts={num_experts}, ...]"
            )
    return num_experts


def _check_divisible(what: str, value: int, degree: int, style: str) -> None:
    if value % degree != 0:
        raise ValueError(f"{style}: {what}={value} is not divisible by the degree {degree}")


def _distribute(
    module: nn.Module,
    mesh: DeviceMesh,
    placements_of: dict[str, tuple[Placement, ...]],
    src_data_rank: int | None,
) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(
            param.detach(), mesh, placements_of[name], src_data_rank=src_data_rank
        )
        module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))


def _install(module: nn.Module, dispatcher: TokenDispatcher) -> None:
    """Give the experts module its own dispatcher (per module: layers never share state)."""
    module.__dict__["token_dispatcher"] = dispatcher


class _DispatchingStyle(ParallelStyle):
    """A style that installs an all-to-all token dispatcher, with its two keyword options."""

    def __init__(self, *, dedup: bool = False, overlap_backward: bool = False) -> None:
        super().__init__()
        for name, value in (("dedup", dedup), ("overlap_backward", overlap_backward)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        self.dedup = dedup
        self.overlap_backward = overlap_backward


class ExpertParallel(_DispatchingStyle):
    """Shard the experts over a 1-D expert-parallel mesh and dispatch tokens by all-to-all.

    Expert ``e`` lives on rank ``e // (E / ep)``. Tokens are sent to their experts' ranks with
    ``all_to_all_single`` (split sizes exchanged first) and the outputs returned the same way;
    both are differentiable, and the dispatch overlaps with the shared experts inside
    :class:`~hp_cp_ep.MoE`. Each rank routes its own tokens (EP ranks are data-parallel ranks).

    Args:
        dedup: Keyword-only extension: install a :class:`~hp_cp_ep.DedupTokenDispatcher` (a
            token goes once to each rank holding some of its experts). With ``dedup`` the mesh
            may be 2-D ``[inter, intra]`` (a node axis: EP rank ``inter * intra_size + intra``,
            two-stage dispatch, once per node then once per rank inside it).
        overlap_backward: Keyword-only extension: the combine's backward all-to-all is issued
            before the shared experts' backward and waited for after it (see
            :class:`~hp_cp_ep.BackwardOverlap`); off, the backward all-to-alls block.

    Raises:
        ValueError: When the mesh is not 1-D (2-D with ``dedup``) or ``num_experts`` is not
            divisible by its size.
        TypeError: When the module is not ``GroupedExperts``-like.

    Example:
        .. code-block:: python

            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(moe.experts, ep_mesh, ExpertParallel())

    See Also:
        :titan:`torchtitan.distributed.expert_parallel.ExpertParallel`.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        style = type(self).__name__
        if device_mesh.ndim != 1 and not (self.dedup and device_mesh.ndim == 2):
            raise ValueError(
                f"{style} needs a 1-D expert-parallel mesh (or a 2-D [inter, intra] mesh with "
                f"dedup=True), got shape {tuple(device_mesh.shape)}"
            )
        num_experts = _check_experts(module, style)
        ep = device_mesh.size()
        _check_divisible("num_experts", num_experts, ep, style)
        names = [name for name, _ in module.named_parameters(recurse=False)]
        placement = tuple(Shard(0) for _ in range(device_mesh.ndim))  # nested: a-major, then b
        _distribute(module, device_mesh, {n: placement for n in names}, self.src_data_rank)
        dispatcher: TokenDispatcher
        if not self.dedup:
            dispatcher = TokenDispatcher(
                num_experts // ep,
                ep_group=device_mesh.get_group(),
                overlap_backward=self.overlap_backward,
            )
        elif device_mesh.ndim == 1:
            dispatcher = DedupTokenDispatcher(
                num_experts // ep,
                ep_group=device_mesh.get_group(),
                overlap_backward=self.overlap_backward,
            )
        else:
            groups = (device_mesh.get_group(0), device_mesh.get_group(1))
            dispatcher = DedupTokenDispatcher(
                num_experts // ep, node_groups=groups, overlap_backward=self.overlap_backward
            )
        _install(module, dispatcher)
        return module


class ExpertTensorParallel(_DispatchingStyle):
    """EP x TP on a 2-D ``[ep, tp]`` mesh: experts over ``ep``, their hidden units over ``tp``.

    Tokens are dispatched by all-to-all among the ranks of the same TP index; each TP rank
    computes its slice of every local expert's hidden units, and the partial outputs are summed
    over TP before the combine. The MoE input must be replicated over TP.

    Args:
        dedup: Keyword-only extension: install a :class:`~hp_cp_ep.DedupTokenDispatcher` with
            the TP group (a token goes once to each EP rank holding some of its experts, fans
            out to them there; the partial outputs are summed over TP once, on the combined
            tokens, after the combine). With ``dedup`` the mesh may be 3-D
            ``[inter, intra, tp]``: the node axis of ``ExpertParallel(dedup=True)`` (EP rank
            ``inter * intra_size + intra``, two-stage dispatch) with TP over the last dimension.
        overlap_backward: Keyword-only extension: as for :class:`ExpertParallel` (the
            combine's backward all-to-all overlaps the shared experts' backward).

    Raises:
        ValueError: When the mesh is not 2-D (3-D with ``dedup``), or ``num_experts`` (by ep)
            or the hidden size (by tp) does not divide.
        TypeError: When the module is not ``GroupedExperts``-like, or an option is not a bool.

    See Also:
        :titan:`torchtitan.distributed.expert_parallel.ExpertTensorParallel`.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        style = type(self).__name__
        ndim = device_mesh.ndim
        if ndim != 2 and not (self.dedup and ndim == 3):
            raise ValueError(
                f"{style} needs a 2-D [ep, tp] mesh (or a 3-D [inter, intra, tp] mesh with "
                f"dedup=True), got shape {tuple(device_mesh.shape)}"
            )
        num_experts = _check_experts(module, style)
        tp = device_mesh.size(ndim - 1)
        ep = device_mesh.size() // tp
        _check_divisible("num_experts", num_experts, ep, style)
        hidden_dims: dict[str, int] = module.hidden_dim_of_weight  # type: ignore[assignment]
        placements: dict[str, tuple[Placement, ...]] = {}
        experts_over_ep = tuple(Shard(0) for _ in range(ndim - 1))  # nested: inter, then intra
        for name, param in module.named_parameters(recurse=False):
            dim = hidden_dims[name]
            _check_divisible(f"{name}.shape[{dim}]", param.shape[dim], tp, style)
            placements[name] = (*experts_over_ep, Shard(dim))
        _distribute(module, device_mesh, placements, self.src_data_rank)
        tp_group = device_mesh.get_group(ndim - 1)
        dispatcher: TokenDispatcher
        if ndim == 3:
            groups = (device_mesh.get_group(0), device_mesh.get_group(1))
            dispatcher = DedupTokenDispatcher(
                num_experts // ep,
                tp_group=tp_group,
                node_groups=groups,
                overlap_backward=self.overlap_backward,
            )
        else:
            kind = DedupTokenDispatcher if self.dedup else TokenDispatcher
            dispatcher = kind(
                num_experts // ep,
                ep_group=device_mesh.get_group(0),
                tp_group=tp_group,
                overlap_backward=self.overlap_backward,
            )
        _install(module, dispatcher)
        return module


class TensorParallel(ParallelStyle):
    """Tensor parallelism for routed experts when EP = 1: hidden units over a 1-D ``tp`` mesh.

    Every rank holds all experts, a ``1/tp`` slice of each one's hidden units, and routes the
    same (replicated) tokens; the partial outputs are summed over TP.

    Raises:
        ValueError: When the mesh is not 1-D or the hidden size does not divide by its size.
        TypeError: When the module is not ``GroupedExperts``-like.

    See Also:
        :titan:`torchtitan.distributed.expert_parallel.TensorParallel`.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        style = type(self).__name__
        if device_mesh.ndim != 1:
            raise ValueError(
                f"{style} needs a 1-D tensor-parallel mesh, got shape {tuple(device_mesh.shape)}"
            )
        num_experts = _check_experts(module, style)
        tp = device_mesh.size()
        hidden_dims: dict[str, int] = module.hidden_dim_of_weight  # type: ignore[assignment]
        placements: dict[str, tuple[Placement, ...]] = {}
        for name, param in module.named_parameters(recurse=False):
            dim = hidden_dims[name]
            _check_divisible(f"{name}.shape[{dim}]", param.shape[dim], tp, style)
            placements[name] = (Shard(dim),)
        _distribute(module, device_mesh, placements, self.src_data_rank)
        _install(module, TokenDispatcher(num_experts, tp_group=device_mesh.get_group()))
        return module
