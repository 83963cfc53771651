"""``loss_parallel``: vocabulary-parallel cross-entropy on class-sharded logits.

Inside ``with loss_parallel():`` a call to ``torch.nn.functional.cross_entropy`` (and therefore
``nn.CrossEntropyLoss``) whose input is a DTensor sharded on the class dimension is computed
without gathering the logits: each rank works on its slice of the vocabulary and three
all-reduces of per-token scalars (max, sum of exponentials, target log-probability) make the
result exact. The backward needs no communication. Calls on other inputs run unchanged.

The interception is a ``TorchFunctionMode`` entered for the ``with`` block: a context-manager
flag, nothing global survives the block. Unlike PyTorch's version, the backward may run after the
block has exited (the gradient is an autograd function of its own).

See Also:
    ``torch.distributed.tensor.parallel.loss_parallel``: PyTorch's loss-parallel context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hp_tp._dtensor import DeviceMesh, DTensor, Replicate, Shard

__all__ = ["loss_parallel"]

_REDUCTIONS = ("none", "mean", "sum")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of local logit columns ``[N, V_local]`` against global class ids ``[N]``."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        weight: torch.Tensor | None,
        ignore_index: int,
        reduction: str,
        class_start: int,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        x = logits
        compute_dtype = torch.promote_types(x.dtype, torch.float32)
        x = x.to(compute_dtype)
        n_local = x.shape[-1]
        if x.numel() > 0:
            x_max = torch.amax(x, dim=-1, keepdim=True)
            dist.all_reduce(x_max, op=dist.ReduceOp.MAX, group=group)
            shifted = x - x_max
        else:
            shifted = x
        sum_exp = torch.sum(torch.exp(shifted), dim=-1, keepdim=True)
        dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        log_probs = shifted - torch.log(sum_exp)

        valid = target != ignore_index
        safe_target = torch.where(valid, target, 0)
        local_index = safe_target - class_start
        owned = (local_index >= 0) & (local_index < n_local)
        gather_index = torch.where(owned, local_index, 0).unsqueeze(-1)
        picked = torch.gather(log_probs, -1, gather_index).squeeze(-1)
        if weight is not None:
            w_target = weight.to(compute_dtype)[safe_target]
            picked = picked * w_target
        picked = torch.where(owned, picked, 0.0)
        dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)
        per_token = torch.where(valid, -picked, 0.0)

        if weight is not None:
            total_weight = torch.where(valid, w_target, 0.0).sum()
        else:
            total_weight = valid.sum().to(compute_dtype)
        if reduction == "sum":
            result = per_token.sum()
        elif reduction == "mean":
            result = per_token.sum() / total_weight
        else:
            result = per_token

        ctx.save_for_backward(log_probs, owned, gather_index, valid, total_weight)
        ctx.w_target = w_target if weight is not None else None
        ctx.reduction = reduction
        ctx.input_dtype = logits.dtype
        return result.to(logits.dtype)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad_out,) = grads
        log_probs, owned, gather_index, valid, total_weight = ctx.saved_tensors
        g = grad_out.to(log_probs.dtype)
        if ctx.reduction == "mean":
            g = g / total_weight
        if g.dim() == 0:
            g = g.expand(valid.shape)
        if ctx.w_target is not None:
            g = g * ctx.w_target
        g = torch.where(valid, g, 0.0).unsqueeze(-1)
        one_hot = torch.zeros_like(log_probs)
        one_hot.scatter_(-1, gather_index, torch.where(owned, -1.0, 0.0).unsqueeze(-1).to(one_hot))
        grad_logits = (one_hot + torch.exp(log_probs)) * g
        return grad_logits.to(ctx.input_dtype), None, None, None, None, None, None


def _class_dim(ndim: int) -> int:
    return 0 if ndim == 1 else 1


def _sharded_class_mesh_dim(input: DTensor) -> int | None:
    """The mesh dim sharding the class dimension of ``input``, or None when none does."""
    cdim = _class_dim(input.ndim)
    dims = [
        i
        for i, p in enumerate(input.placements)
        if isinstance(p, Shard) and p.dim % input.ndim == cdim
    ]
    return dims[0] if len(dims) == 1 else None


def _local_target(target: Any, mesh: DeviceMesh) -> torch.Tensor:
    if isinstance(target, DTensor):
        if any(not isinstance(p, Replicate) for p in target.placements):
            target = target.redistribute(mesh, [Replicate()] * mesh.ndim)
        local: torch.Tensor = target.to_local()
        return local
    if isinstance(target, torch.Tensor):
        return target
    raise TypeError(f"cross_entropy target must be a tensor, got {type(target).__name__}")


def _vocab_parallel_cross_entropy(
    input: DTensor,
    target: Any,
    weight: Any = None,
    size_average: Any = None,
    ignore_index: int = -100,
    reduce: Any = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> DTensor:
    if size_average is not None or reduce is not None:
        raise ValueError(
            "loss_parallel does not support the deprecated size_average/reduce arguments; "
            "use reduction='none'|'mean'|'sum'"
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if label_smoothing != 0.0:
        raise ValueError(f"loss_parallel supports label_smoothing=0.0 only, got {label_smoothing}")
    mesh = input.device_mesh
    mesh_dim = _sharded_class_mesh_dim(input)
    assert mesh_dim is not None
    for i, p in enumerate(input.placements):
        if i != mesh_dim and not isinstance(p, Replicate):
            raise ValueError(
                "loss_parallel needs logits sharded on the class dimension on one mesh dim and "
                f"replicated on the others, got placements {tuple(input.placements)}"
            )
    local_target = _local_target(target, mesh)
    if local_target.is_floating_point():
        raise ValueError(
            "loss_parallel needs class-index targets (an integer tensor), got floating-point "
            "class probabilities"
        )
    cdim = _class_dim(input.ndim)
    n_classes = input.shape[cdim]
    expected = tuple(input.shape[:cdim]) + tuple(input.shape[cdim + 1 :])
    if tuple(local_target.shape) != expected:
        raise ValueError(
            f"cross_entropy target of shape {tuple(local_target.shape)} does not match input "
            f"of shape {tuple(input.shape)} (expected target shape {expected})"
        )
    local_weight: torch.Tensor | None = None
    if weight is not None:
        full_w = weight.full_tensor() if isinstance(weight, DTensor) else weight
        if not isinstance(full_w, torch.Tensor) or tuple(full_w.shape) != (n_classes,):
            raise ValueError(
                f"cross_entropy weight must be a tensor of shape ({n_classes},), got "
                f"{getattr(full_w, 'shape', full_w)!r}"
            )
        local_weight = full_w
    # The class offset of this rank's slice: torch's Shard puts the larger chunks first.
    group = mesh.get_group(mesh_dim)
    coord = mesh.get_local_rank(mesh_dim)
    n_shards = mesh.size(mesh_dim)
    chunk = -(-n_classes // n_shards)
    class_start = min(coord * chunk, n_classes)

    local = input.to_local()
    moved = local.movedim(cdim, -1)
    flat = moved.reshape(-1, moved.shape[-1])
    flat_target = local_target.reshape(-1)
    loss = _VocabParallelCrossEntropy.apply(  # type: ignore[no-untyped-call]
        flat, flat_target, local_weight, ignore_index, reduction, class_start, group
    )
    if reduction == "none":
        loss = loss.reshape(local_target.shape)
    return DTensor.from_local(loss, mesh, [Replicate()] * mesh.ndim, run_check=False)


class _LossParallelMode(TorchFunctionMode):
    """Routes class-sharded ``cross_entropy`` calls to the vocabulary-parallel implementation."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is F.cross_entropy:
            input = args[0] if args else kwargs.get("input")
            if isinstance(input, DTensor) and _sharded_class_mesh_dim(input) is not None:
                if not args:
                    kwargs.pop("input")
                return _vocab_parallel_cross_entropy(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Compute cross-entropy on class-sharded logits without gathering them.

    Within the block, ``F.cross_entropy(input, target, ...)`` / ``nn.CrossEntropyLoss`` with
    ``input`` a DTensor sharded on the class dimension (dimension 1, or 0 for a 1-D input; the
    usual case is ``[tokens, vocab]`` logits with ``Shard(1)`` / ``Shard(-1)``) on exactly one
    mesh dimension and replicated on the others returns the exact loss as a replicated DTensor.
    Supported: ``weight`` (replicated), ``ignore_index``, and ``reduction`` ``"mean"``, ``"sum"``
    and ``"none"``. The target holds class indices, as a local tensor (the same on every rank of
    the class-sharding dimension) or a DTensor. No rank ever holds more than its slice of the
    logits; the forward issues three all-reduces of ``[tokens]``-sized tensors and the backward
    none. The backward may run inside or after the block.

    Yields:
        None.

    Raises:
        ValueError: inside the block, for ``label_smoothing != 0``, class-probability targets, the
            deprecated ``size_average``/``reduce`` arguments, a target or weight of the wrong
            shape, or logits sharded on another mesh dim too.

    See Also:
        ``torch.distributed.tensor.parallel.loss_parallel``: PyTorch's loss-parallel context;
        ``torchtitan.components.loss``: TorchTitan's loss functions used with it.
    """
    with _LossParallelMode():
        yield
