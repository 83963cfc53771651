"""``loss_parallel``: vocabulary-parallel cross-entropy on class-sharded logits.

Inside ``with loss_parallel():`` a call to ``torch.nn.functional.cross_entropy`` (and therefore
``nn.CrossEntropyLoss``) whose input is a DTensor sharded on the class dimension is computed
without gathering the logits: each rank works on its slice of the vocabulary and three
all-reduces of per-token scalars (max, sum of exponentials, target log-probability) make the
result exact. The backward needs no communication. A DTensor input sharded otherwise is refused
with ``ValueError`` (as in PyTorch); calls on plain tensors run unchanged.

The interception is a ``TorchFunctionMode`` entered for the ``with`` block: a context-manager
flag, nothing global survives the block. Unlike PyTorch's version, the backward may run after the
block has exited (the gradient is an autograd function of its own).

See Also:
    :pt:`torch.distributed.tensor.parallel.loss_parallel`: PyTorch's loss-parallel context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hp_tp._dtensor import DeviceMesh, DTensor, Partial, Placement, Replicate, Shard
from hp_tp._layout import has_layout

__all__ = ["loss_parallel"]

_REDUCTIONS = ("none", "mean", "sum")


def _log_softmax_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Log-softmax over the last dim of ``x``, whose columns are split over ``group``."""
    if x.numel() > 0:
        x_max = torch.amax(x, dim=-1, keepdim=True)
        dist.all_reduce(x_max, op=dist.ReduceOp.MAX, group=group)
        shifted = x - x_max
    else:
        shifted = x
    sum_exp = torch.sum(torch.exp(shifted), dim=-1, keepdim=True)
    dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
    return shifted - torch.log(sum_exp)


class _Picked(NamedTuple):
    per_token: torch.Tensor  # -w[t] * log_probs[t] per row, 0 where ignored
    total_weight: torch.Tensor  # the denominator of the mean
    owned: torch.Tensor  # whether this rank holds the target column of each row
    gather_index: torch.Tensor  # local target column ([M, 1]; 0 where not owned)
    valid: torch.Tensor  # target != ignore_index
    w_target: torch.Tensor | None  # weight of each row's target


def _pick_targets(
    log_probs: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    ignore_index: int,
    class_start: int,
    group: dist.ProcessGroup,
    batch_groups: tuple[dist.ProcessGroup, ...] = (),
) -> _Picked:
    """The negative (weighted) log-probability of each row's target: one all-reduce."""
    valid = target != ignore_index
    safe_target = torch.where(valid, target, 0)
    local_index = safe_target - class_start
    owned = (local_index >= 0) & (local_index < log_probs.shape[-1])
    gather_index = torch.where(owned, local_index, 0).unsqueeze(-1)
    picked = torch.gather(log_probs, -1, gather_index).squeeze(-1)
    w_target = None
    if weight is not None:
        w_target = weight.to(log_probs.dtype)[safe_target]
        picked = picked * w_target
    picked = torch.where(owned, picked, 0.0)
    dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)
    per_token = torch.where(valid, -picked, 0.0)
    if w_target is not None:
        total_weight = torch.where(valid, w_target, 0.0).sum()
    else:
        total_weight = valid.sum().to(log_probs.dtype)
    for batch_group in batch_groups:  # the mean is over the global batch
        dist.all_reduce(total_weight, op=dist.ReduceOp.SUM, group=batch_group)
    return _Picked(per_token, total_weight, owned, gather_index, valid, w_target)


def _reduce(picked: _Picked, reduction: str) -> torch.Tensor:
    if reduction == "sum":
        return picked.per_token.sum()
    if reduction == "mean":
        return picked.per_token.sum() / picked.total_weight
    return picked.per_token


def _save_picked(ctx: Any, picked: _Picked, reduction: str, *extra: torch.Tensor) -> None:
    ctx.save_for_backward(
        picked.owned, picked.gather_index, picked.valid, picked.total_weight, *extra
    )
    ctx.w_target = picked.w_target
    ctx.reduction = reduction


def _row_grad_and_neg_one_hot(
    ctx: Any, grad_out: torch.Tensor, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row upstream gradient ``[M, 1]`` and the local ``-1``-at-target matrix."""
    owned, gather_index, valid, total_weight = ctx.saved_tensors[:4]
    g = grad_out.to(like.dtype)
    if ctx.reduction == "mean":
        g = g / total_weight
    if g.dim() == 0:
        g = g.expand(valid.shape)
    if ctx.w_target is not None:
        g = g * ctx.w_target
    g = torch.where(valid, g, 0.0).unsqueeze(-1)
    one_hot = torch.zeros_like(like)
    one_hot.scatter_(-1, gather_index, torch.where(owned, -1.0, 0.0).unsqueeze(-1).to(one_hot))
    return g, one_hot


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of local logit columns ``[N, V_local]`` against global class ids ``[N]``.

    Without label smoothing: the same arithmetic, in the same order, as PyTorch's loss-parallel
    handlers, so the results are bitwise equal. With label smoothing (which PyTorch's
    loss_parallel rejects): PyTorch's formula, ``(1 - eps) * nll + eps / C * smooth`` with
    ``smooth = -sum_c w_c log p_c``, at the cost of one more all-reduce. The backward is fused
    and needs no communication.
    """

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
        batch_groups: tuple[dist.ProcessGroup, ...],
        label_smoothing: float,
        n_classes: int,
    ) -> torch.Tensor:
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))
        log_probs = _log_softmax_last(x, group)
        picked = _pick_targets(
            log_probs, target, weight, ignore_index, class_start, group, batch_groups
        )
        _save_picked(ctx, picked, reduction, log_probs)
        ctx.input_dtype = logits.dtype
        ctx.label_smoothing = label_smoothing
        result = _reduce(picked, reduction)
        if label_smoothing > 0.0:
            n_local = log_probs.shape[-1]
            local_w = None
            if weight is not None:
                local_w = weight.to(log_probs.dtype)[class_start : class_start + n_local]
            weighted = log_probs if local_w is None else log_probs * local_w
            smooth = -weighted.sum(dim=-1)
            dist.all_reduce(smooth, op=dist.ReduceOp.SUM, group=group)
            smooth = torch.where(picked.valid, smooth, 0.0)
            smooth_red = _reduce(picked._replace(per_token=smooth), reduction)
            result = (1.0 - label_smoothing) * result + smooth_red * (label_smoothing / n_classes)
            ctx.local_w = local_w
            ctx.w_sum = float(n_classes) if weight is None else weight.to(log_probs.dtype).sum()
            ctx.n_classes = n_classes
        return result.to(logits.dtype)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        log_probs = ctx.saved_tensors[4]
        g, one_hot = _row_grad_and_neg_one_hot(ctx, grads[0], log_probs)
        probs = torch.exp(log_probs)
        eps = ctx.label_smoothing
        if eps == 0.0:
            grad_logits = (one_hot + probs) * g
        else:
            valid, total_weight = ctx.saved_tensors[2], ctx.saved_tensors[3]
            gs = grads[0].to(log_probs.dtype)
            if ctx.reduction == "mean":
                gs = gs / total_weight
            if gs.dim() == 0:
                gs = gs.expand(valid.shape)
            gs = torch.where(valid, gs, 0.0).unsqueeze(-1) * (eps / ctx.n_classes)
            w_local = 1.0 if ctx.local_w is None else ctx.local_w
            grad_logits = (1.0 - eps) * (one_hot + probs) * g + (probs * ctx.w_sum - w_local) * gs
        return (grad_logits.to(ctx.input_dtype),) + (None,) * 9


class _VocabParallelLogSoftmax(torch.autograd.Function):
    """Log-softmax over the last dim of local columns; the backward all-reduces one row sum."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = _log_softmax_last(x, group)
        ctx.save_for_backward(out)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (out,) = ctx.saved_tensors
        g = grads[0]
        row_sum = g.sum(dim=-1, keepdim=True)
        dist.all_reduce(row_sum, op=dist.ReduceOp.SUM, group=ctx.group)
        return g - torch.exp(out) * row_sum, None


class _VocabParallelNLL(torch.autograd.Function):
    """Negative log-likelihood of local log-probability columns; no communication backward."""

    @staticmethod
    def forward(
        ctx: Any,
        log_probs: torch.Tensor,
        target: torch.Tensor,
        weight: torch.Tensor | None,
        ignore_index: int,
        reduction: str,
        class_start: int,
        group: dist.ProcessGroup,
        batch_groups: tuple[dist.ProcessGroup, ...],
    ) -> torch.Tensor:
        picked = _pick_targets(
            log_probs, target, weight, ignore_index, class_start, group, batch_groups
        )
        _save_picked(ctx, picked, reduction)
        ctx.shape = log_probs.shape
        ctx.dtype = log_probs.dtype
        return _reduce(picked, reduction)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        like = torch.empty(ctx.shape, dtype=ctx.dtype, device=grads[0].device)
        g, one_hot = _row_grad_and_neg_one_hot(ctx, grads[0], like)
        return one_hot * g, None, None, None, None, None, None, None


def _class_dim(ndim: int) -> int:
    return 0 if ndim == 1 else 1


def _sharded_mesh_dim(input: DTensor, dim: int) -> int | None:
    """The mesh dim sharding tensor dim ``dim`` of ``input``, or None when none does."""
    dims = [
        i
        for i, p in enumerate(input.placements)
        if isinstance(p, Shard) and p.dim % input.ndim == dim % input.ndim
    ]
    return dims[0] if len(dims) == 1 else None


def _sharded_class_mesh_dim(input: DTensor) -> int | None:
    """The mesh dim sharding the class dimension of ``input``, or None when none does."""
    return _sharded_mesh_dim(input, _class_dim(input.ndim))


class _ClassSharded(NamedTuple):
    mesh: DeviceMesh
    group: dist.ProcessGroup  # the mesh dim sharding the classes
    class_start: int
    flat: torch.Tensor  # local input, classes last, rows flattened: [M, V_local]
    flat_target: torch.Tensor  # [M]
    target_shape: torch.Size  # local
    target_global_shape: torch.Size
    target_placements: tuple[Placement, ...]  # of the target and of a reduction="none" loss
    batch_groups: tuple[dist.ProcessGroup, ...]  # mesh dims sharding the rows (not the classes)
    weight: torch.Tensor | None


def _class_sharded(
    fn: str,
    input: DTensor,
    target: Any,
    weight: Any,
    size_average: Any,
    reduce: Any,
    reduction: str,
) -> _ClassSharded:
    """Validate the arguments of a class-sharded loss and take the local pieces."""
    if size_average is not None or reduce is not None:
        raise ValueError(
            f"loss_parallel {fn} does not support the deprecated size_average/reduce arguments; "
            "use reduction='none'|'mean'|'sum'"
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    mesh = input.device_mesh
    mesh_dim = _sharded_class_mesh_dim(input)
    assert mesh_dim is not None
    cdim = _class_dim(input.ndim)
    target_placements: list[Placement] = []
    batch_dims: list[int] = []
    for i, p in enumerate(input.placements):
        if i == mesh_dim or isinstance(p, Replicate):
            target_placements.append(Replicate())
        elif isinstance(p, Shard) and type(p) is Shard:
            d = p.dim % input.ndim
            target_placements.append(Shard(d if d < cdim else d - 1))
            batch_dims.append(i)
        else:
            raise ValueError(
                f"loss_parallel {fn} needs its input sharded on the class dimension on exactly "
                "one mesh dim and sharded on other tensor dims or replicated on the other mesh "
                f"dims, got placements {tuple(input.placements)}"
            )
    expected = torch.Size(tuple(input.shape[:cdim]) + tuple(input.shape[cdim + 1 :]))
    if isinstance(target, DTensor):
        if tuple(target.shape) != tuple(expected):
            raise ValueError(
                f"{fn} target of shape {tuple(target.shape)} does not match input of shape "
                f"{tuple(input.shape)} (expected target shape {tuple(expected)})"
            )
        if not has_layout(target, target_placements):
            target = target.redistribute(mesh, target_placements)
        local_target: torch.Tensor = target.to_local()
    elif isinstance(target, torch.Tensor):
        if batch_dims:
            raise ValueError(
                f"loss_parallel {fn}: the input is sharded on a batch dimension too "
                f"(placements {tuple(input.placements)}), so pass the target as a DTensor with "
                f"placements {tuple(target_placements)}"
            )
        local_target = target
    else:
        raise TypeError(f"the {fn} target must be a tensor, got {type(target).__name__}")
    if local_target.is_floating_point():
        raise ValueError(
            f"loss_parallel {fn} needs class-index targets (an integer tensor), got "
            "floating-point class probabilities"
        )
    local = input.to_local()
    local_expected = tuple(local.shape[:cdim]) + tuple(local.shape[cdim + 1 :])
    if tuple(local_target.shape) != local_expected:
        raise ValueError(
            f"{fn} target of shape {tuple(local_target.shape)} does not match input of shape "
            f"{tuple(input.shape)} (expected target shape {tuple(expected)})"
        )
    n_classes = input.shape[cdim]
    local_weight: torch.Tensor | None = None
    if weight is not None:
        full_w = weight.full_tensor() if isinstance(weight, DTensor) else weight
        if not isinstance(full_w, torch.Tensor) or tuple(full_w.shape) != (n_classes,):
            raise ValueError(
                f"{fn} weight must be a tensor of shape ({n_classes},), got "
                f"{getattr(full_w, 'shape', full_w)!r}"
            )
        local_weight = full_w
    moved = local.movedim(cdim, -1)
    return _ClassSharded(
        mesh=mesh,
        group=mesh.get_group(mesh_dim),
        class_start=_shard_start(n_classes, mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)),
        flat=moved.reshape(-1, moved.shape[-1]),
        flat_target=local_target.reshape(-1),
        target_shape=local_target.shape,
        target_global_shape=expected,
        target_placements=tuple(target_placements),
        batch_groups=tuple(mesh.get_group(i) for i in batch_dims),
        weight=local_weight,
    )


def _shard_start(n: int, n_shards: int, coord: int) -> int:
    """Offset of shard ``coord`` of a dim of size ``n`` (torch's ``Shard``: ceil-sized chunks)."""
    chunk = -(-n // n_shards)
    return min(coord * chunk, n)


def _loss_dtensor(loss: torch.Tensor, info: _ClassSharded, reduction: str) -> DTensor:
    """The loss as a DTensor: per-token losses laid out like the target; a scalar replicated,
    or a partial sum over the mesh dims that shard the rows."""
    if reduction == "none":
        shape = tuple(info.target_global_shape)
        stride = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            stride[i] = stride[i + 1] * max(shape[i + 1], 1)
        return DTensor.from_local(
            loss.reshape(info.target_shape),
            info.mesh,
            info.target_placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=tuple(stride),
        )
    placements = [Partial() if isinstance(p, Shard) else p for p in info.target_placements]
    return DTensor.from_local(loss, info.mesh, placements, run_check=False)


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
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    info = _class_sharded("cross_entropy", input, target, weight, size_average, reduce, reduction)
    loss = _VocabParallelCrossEntropy.apply(  # type: ignore[no-untyped-call]
        info.flat,
        info.flat_target,
        info.weight,
        ignore_index,
        reduction,
        info.class_start,
        info.group,
        info.batch_groups,
        float(label_smoothing),
        input.shape[_class_dim(input.ndim)],
    )
    return _loss_dtensor(loss, info, reduction)


def _vocab_parallel_nll_loss(
    input: DTensor,
    target: Any,
    weight: Any = None,
    size_average: Any = None,
    ignore_index: int = -100,
    reduce: Any = None,
    reduction: str = "mean",
) -> DTensor:
    info = _class_sharded("nll_loss", input, target, weight, size_average, reduce, reduction)
    loss = _VocabParallelNLL.apply(  # type: ignore[no-untyped-call]
        info.flat,
        info.flat_target,
        info.weight,
        ignore_index,
        reduction,
        info.class_start,
        info.group,
        info.batch_groups,
    )
    return _loss_dtensor(loss, info, reduction)


def _vocab_parallel_log_softmax(
    input: DTensor, dim: int | None = None, _stacklevel: int = 3, dtype: torch.dtype | None = None
) -> DTensor:
    assert dim is not None
    mesh_dim = _sharded_mesh_dim(input, dim)
    assert mesh_dim is not None
    for i, p in enumerate(input.placements):
        if i != mesh_dim and not isinstance(p, Replicate):
            raise ValueError(
                "loss_parallel log_softmax needs its input sharded on `dim` on one mesh dim and "
                f"replicated on the others, got placements {tuple(input.placements)}"
            )
    local = input.to_local()
    if dtype is not None:
        local = local.to(dtype)
    moved = local.movedim(dim, -1)
    out = _VocabParallelLogSoftmax.apply(  # type: ignore[no-untyped-call]
        moved, input.device_mesh.get_group(mesh_dim)
    )
    shape = tuple(input.shape)
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * max(shape[i + 1], 1)
    return DTensor.from_local(
        out.movedim(-1, dim).contiguous(),
        input.device_mesh,
        input.placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=tuple(stride),
    )


class _LossParallelMode(TorchFunctionMode):
    """Routes class-sharded loss calls to the vocabulary-parallel implementations."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        handler = _HANDLERS.get(func)
        if handler is not None:
            input = args[0] if args else kwargs.get("input")
            if isinstance(input, DTensor):
                args = _check_sharded(func, input, args, kwargs)
                if not args:
                    kwargs.pop("input")
                return handler(*args, **kwargs)
        return func(*args, **kwargs)


def _implicit_softmax_dim(ndim: int) -> int:
    """The dim ``F.log_softmax`` picks when given none (PyTorch's legacy rule)."""
    return 0 if ndim in (0, 1, 3) else 1


def _check_sharded(
    func: Any, input: DTensor, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    """Refuse a DTensor ``input`` not sharded on the dim loss_parallel splits; the call's args.

    PyTorch's loss_parallel raises ``ValueError`` for such a call (instead of computing it some
    other way), and so does this one: inside the block, a loss on logits that are replicated or
    sharded on another dimension is a layout mistake, not a request to gather them.
    ``F.log_softmax`` without ``dim`` gets the dim PyTorch picks for it, made explicit.
    """
    name = getattr(func, "__name__", str(func))
    if func is F.log_softmax:
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if dim is None:
            dim = _implicit_softmax_dim(input.ndim)
            if len(args) > 1:
                args = (args[0], dim, *args[2:])
            else:
                kwargs["dim"] = dim
        what = f"dimension {dim % max(input.ndim, 1)} (the softmax dim)"
    else:
        dim = _class_dim(input.ndim)
        what = f"dimension {dim} (the class dimension)"
    count = sum(
        1
        for p in input.placements
        if isinstance(p, Shard) and p.dim % max(input.ndim, 1) == dim % max(input.ndim, 1)
    )
    if count != 1:
        raise ValueError(
            f"loss_parallel() requires exactly one mesh dim to shard tensor {what} of the "
            f"{name} input, got placements {tuple(input.placements)} where {count} mesh dims "
            f"shard it; give the logits Shard({dim}) on the tensor-parallel mesh dim (e.g. "
            "ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) on the output "
            "projection), or compute this loss outside the loss_parallel() block"
        )
    return tuple(args)


_HANDLERS: dict[Any, Callable[..., DTensor]] = {
    F.cross_entropy: _vocab_parallel_cross_entropy,
    F.nll_loss: _vocab_parallel_nll_loss,
    F.log_softmax: _vocab_parallel_log_softmax,
}


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Compute cross-entropy on class-sharded logits without gathering them.

    Within the block, ``F.cross_entropy(input, target, ...)`` / ``nn.CrossEntropyLoss`` with
    ``input`` a DTensor sharded on the class dimension (dimension 1, or 0 for a 1-D input; the
    usual case is ``[tokens, vocab]`` logits with ``Shard(1)`` / ``Shard(-1)``) on exactly one
    mesh dimension returns the exact loss; a DTensor input sharded otherwise is refused with
    ``ValueError``, as in PyTorch. Supported: ``weight`` (replicated), ``ignore_index``,
    ``reduction`` ``"mean"``, ``"sum"`` and ``"none"``, and ``label_smoothing`` (which PyTorch's
    version rejects; it costs one more all-reduce). No rank ever holds more than its slice of the
    logits; the forward issues three all-reduces of ``[tokens]``-sized tensors and the backward
    none. The backward may run inside or after the block.

    The other mesh dimensions may replicate the logits or shard another tensor dimension (a batch
    or sequence dimension, e.g. data or context parallelism). The target holds class indices: a
    local tensor (the same on every rank) when the other mesh dimensions replicate, otherwise a
    DTensor laid out like the logits without the class dimension. The loss comes back as a
    DTensor: with ``"none"`` laid out like the target; with ``"sum"`` and ``"mean"`` replicated,
    or a ``Partial`` sum over the mesh dimensions that shard the batch. ``"mean"`` divides by the
    global (weighted) count of tokens on any mesh (PyTorch's version rejects it on N-D meshes).

    The two halves of cross-entropy work too: ``F.log_softmax(x, dim)`` on a DTensor sharded on
    ``dim`` (and replicated elsewhere) returns the log-probabilities sharded alike (its backward
    all-reduces one row sum), and ``F.nll_loss`` on class-sharded log-probabilities returns the
    loss as above. Calls on plain (non-DTensor) inputs run unchanged.

    Yields:
        None.

    Raises:
        ValueError: inside the block, for a DTensor input that is not sharded on the class
            dimension on exactly one mesh dim (replicated logits, logits sharded on another
            dimension: PyTorch's type and phrase "loss_parallel() requires exactly one mesh dim
            to shard tensor dimension"), for ``label_smoothing`` outside [0, 1], class-probability
            targets, the deprecated ``size_average``/``reduce`` arguments, a target or weight of
            the wrong shape, a local target where the logits are also sharded on a batch
            dimension, or logits with a ``Partial`` placement.

    See Also:
        :pt:`torch.distributed.tensor.parallel.loss_parallel`: PyTorch's loss-parallel context;
        :titan:`torchtitan.components.loss`: TorchTitan's loss functions used with it.
    """
    with _LossParallelMode():
        yield
