"""Muon for sharded parameters: Newton-Schulz on whole matrices, AdamW for the rest.

Muon orthogonalizes each 2-D update with a Newton-Schulz iteration, which needs the whole matrix.
For a DTensor parameter (sharded by hp-fsdp, hp-tp, or both) the momentum stays sharded like the
parameter; the step all-gathers the (Nesterov) update into the full matrix, runs Newton-Schulz on
it, and keeps only this rank's shard of the result (a local slice, no second collective). Plain
tensors take the same path without communication, so one process and N ranks run the same
arithmetic on the same full matrices.

Parameter groups with ``use_muon=False`` (1-D parameters, embeddings, output heads in the usual
recipe) are stepped with AdamW's update rule and AdamW's state layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.adamw import adamw

__all__ = ["Muon", "get_hyper_optimizer"]

_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def _orthogonalize(
    matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """Quintic Newton-Schulz iteration towards the nearest semi-orthogonal matrix (in bf16)."""
    a, b, c = coefficients
    wide = matrix.size(0) <= matrix.size(1)
    x = matrix.bfloat16() if wide else matrix.bfloat16().T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x if wide else x.T


def _lr_scale(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))  # "match_rms_adamw" (Moonlight)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` laid out like ``param`` (a local slice: no communication)."""
    if not isinstance(param, DTensor):
        return full
    mesh = param.device_mesh
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, param.placements)


class Muon(torch.optim.Optimizer):
    """Muon (momentum + Newton-Schulz orthogonalization) for plain and DTensor parameters.

    Same signature, defaults and update rule as ``torch.optim.Muon``; the extensions are per
    group: ``use_muon=False`` steps that group with AdamW (keys ``betas``, ``eps``,
    ``weight_decay``, ``lr``; defaults from the keyword-only ``adamw_betas``/``adamw_eps``).

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate.
        weight_decay: Decoupled weight decay.
        momentum: Momentum factor.
        nesterov: Use Nesterov momentum.
        ns_coefficients: Coefficients ``(a, b, c)`` of the quintic Newton-Schulz polynomial.
        eps: Floor of the norm the update is divided by before the iteration.
        ns_steps: Newton-Schulz iterations (< 100).
        adjust_lr_fn: ``None``/``"original"`` (``sqrt(max(1, rows/cols))``) or
            ``"match_rms_adamw"`` (``0.2 * sqrt(max(rows, cols))``).
        adamw_betas: Keyword-only: default ``betas`` of ``use_muon=False`` groups.
        adamw_eps: Keyword-only: default ``eps`` of ``use_muon=False`` groups.

    Raises:
        ValueError: A Muon group holds a parameter that is not 2-D (give it a group with
            ``use_muon=False``), or a hyper-parameter is out of range.

    See Also:
        :pt:`torch.optim.Muon`: PyTorch's single-process Muon; HyperParallel's Muon via
        ``get_hyper_optimizer``; TorchTitan's :titan:`DistMuon`.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = _NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Muon: lr must be >= 0, got {lr}")
        if momentum < 0:
            raise ValueError(f"Muon: momentum must be >= 0, got {momentum}")
        if weight_decay < 0:
            raise ValueError(f"Muon: weight_decay must be >= 0, got {weight_decay}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(
                f"Muon: adjust_lr_fn must be None, 'original' or 'match_rms_adamw', "
                f"got {adjust_lr_fn!r}"
            )
        if len(ns_coefficients) != 3:
            raise ValueError(f"Muon: ns_coefficients needs 3 values, got {ns_coefficients}")
        if not 0 <= ns_steps < 100:
            raise ValueError(f"Muon: ns_steps must be in [0, 100), got {ns_steps}")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "use_muon": True,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            if not group["use_muon"]:
                group.setdefault("betas", adamw_betas)
                group.setdefault("adamw_eps", adamw_eps)
                continue
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(
                        f"Muon: parameter of shape {tuple(p.shape)} is not 2-D; put it in a "
                        "group with use_muon=False (AdamW) or use get_hyper_optimizer()"
                    )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Take one optimization step.

        Args:
            closure: Re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, if any.

        See Also:
            :pt:`torch.optim.Muon.step`.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
            else:
                self._adamw_group(group)
        return loss

    def _muon_group(self, group: dict[str, Any]) -> None:
        lr, mu = float(group["lr"]), group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - mu)
            update = grad.lerp(buf, mu) if group["nesterov"] else buf
            ortho = _orthogonalize(
                _full(update), group["ns_coefficients"], group["ns_steps"], group["eps"]
            )
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(_like(ortho, p), alpha=-lr * _lr_scale(group["adjust_lr_fn"], p.shape))

    def _adamw_group(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=False,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["adamw_eps"],
            maximize=False,
        )


def _is_embedding_or_head(name: str, module: nn.Module) -> bool:
    if isinstance(module, nn.Embedding):
        return True
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("output", "lm_head", "head")


def get_hyper_optimizer(
    model: nn.Module,
    *,
    lr: float = 1e-3,
    weight_decay: float = 0.1,
    adamw_lr: float | None = None,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float | None = None,
    **muon_kwargs: Any,
) -> Muon:
    """Build Muon for a model the usual way: 2-D hidden matrices to Muon, the rest to AdamW.

    Embeddings and output heads (``nn.Embedding`` modules; modules named ``output``,
    ``lm_head`` or ``head``) and every non-2-D parameter go to one ``use_muon=False`` group.

    Args:
        model: The model (plain, FSDP- or TP-sharded).
        lr: Muon's learning rate.
        weight_decay: Muon's weight decay.
        adamw_lr: AdamW's learning rate (``lr`` by default).
        adamw_betas: AdamW's betas.
        adamw_eps: AdamW's epsilon.
        adamw_weight_decay: AdamW's weight decay (``weight_decay`` by default).
        **muon_kwargs: Other :class:`~hp_trainer.Muon` arguments (``momentum``, ``ns_steps``, ...).

    Returns:
        One optimizer over all trainable parameters.

    See Also:
        HyperParallel's ``get_hyper_optimizer``; :pt:`torch.optim.Muon` (its docstring's recipe).
    """
    hidden: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    seen: set[nn.Parameter] = set()  # tied weights are stepped once
    for mod_name, module in model.named_modules():
        special = _is_embedding_or_head(mod_name, module)
        for p in module.parameters(recurse=False):
            if p.requires_grad and p not in seen:
                seen.add(p)
                (rest if special or p.ndim != 2 else hidden).append(p)
    groups: list[dict[str, Any]] = [{"params": hidden}]
    if rest:
        groups.append(
            {
                "params": rest,
                "use_muon": False,
                "lr": lr if adamw_lr is None else adamw_lr,
                "weight_decay": weight_decay if adamw_weight_decay is None else adamw_weight_decay,
            }
        )
    return Muon(
        groups,
        lr=lr,
        weight_decay=weight_decay,
        adamw_betas=adamw_betas,
        adamw_eps=adamw_eps,
        **muon_kwargs,
    )
