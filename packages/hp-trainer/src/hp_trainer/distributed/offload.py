"""Hyper-offload of the optimizer: its state lives in host memory and its step runs there.

:func:`offload_optimizers` turns an ``OptimizersContainer`` into one whose
optimizers hold host copies of the parameters (fp32 master weights, pinned where the device layer
has pinned memory): the moments an optimizer creates are therefore host tensors, and the device
keeps only the parameters it computes with. Each step, per parameter group in turn: the
device gradients (local shards of sharded parameters) are copied into persistent host gradient
buffers and dropped on the device; the host optimizer steps that group on a dedicated host
thread (the device-side thread only waits for it); the updated host parameters are copied back
into the device parameters in place. Gradient clipping, learning-rate schedulers and
``zero_grad`` work unchanged (the schedulers see the same optimizers and parameter groups).

Same numbers: the host step is the same optimizer on the same values, so a run with offload
matches one without bit for bit (tested). The cost is the copies (4 bytes per parameter each
way) and the host step; the saving is the optimizer state on the device (8 bytes per parameter
for AdamW) and the step's temporaries.

On a CPU "device" the host is the same memory: the copies and the host thread run as on an
accelerator, and the saving shows as tensor-level device memory (the tensors the device thread
allocates), which is what ``hp_trainer.planner`` predicts.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from hp_dtensor import DTensor
from hp_dtensor import device as hp_device
from hp_trainer.components.optimizer.containers import OptimizersContainer

__all__ = ["OffloadedOptimizersContainer", "offload_optimizers"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _thread_ids() -> int:
    import threading

    return threading.get_native_id()


class OffloadedOptimizersContainer(OptimizersContainer):
    """An ``OptimizersContainer`` whose optimizers run in host memory.

    Built by :func:`offload_optimizers`; see the module docstring for the step.

    Attributes:
        copied_bytes: Bytes copied between device and host by the last step (both ways).

    See Also:
        :pt:`torch.distributed.fsdp.CPUOffloadPolicy`: FSDP2's offload keeps parameters and
        gradients on the host and runs the optimizer there as well, but only under FSDP.
    """

    def __init__(self, container: OptimizersContainer) -> None:
        self.model_parts = container.model_parts
        self.optimizers = container.optimizers
        self._pin = hp_device.pin_memory_available()
        self._pairs: list[list[tuple[nn.Parameter, torch.Tensor]]] = []
        for opt in self.optimizers:
            if opt.state:
                raise ValueError(
                    "offload_optimizers needs optimizers that have not stepped yet (their state "
                    "would stay on the device)"
                )
            for group in opt.param_groups:
                pairs = []
                hosts = []
                for p in group["params"]:
                    local = _local(p.detach())
                    host = torch.empty(local.shape, dtype=local.dtype, device="cpu",
                                       pin_memory=self._pin)  # fmt: skip
                    host.copy_(local)
                    hp = nn.Parameter(host, requires_grad=p.requires_grad)
                    hp.grad = torch.zeros(local.shape, dtype=local.dtype, device="cpu",
                                          pin_memory=self._pin)  # fmt: skip
                    pairs.append((p, hp))
                    hosts.append(hp)
                group["params"] = hosts
                self._pairs.append(pairs)  # type: ignore[arg-type]
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hp-offload")
        self.copied_bytes = 0
        self.host_thread_ids: tuple[int, ...] = ()
        """Native ids of the host thread (tensor-level measurements leave its memory out)."""

    @property
    def host_bytes(self) -> int:
        """Host bytes held by master parameters, gradient buffers and the optimizer state (once
        created)."""
        seen: set[int] = set()
        total = 0
        for opt in self.optimizers:
            tensors: list[torch.Tensor] = []
            for group in opt.param_groups:
                for p in group["params"]:
                    tensors.append(p)
                    if p.grad is not None:
                        tensors.append(p.grad)
            for state in opt.state.values():
                tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
            for t in tensors:
                key = t.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
        return total

    def _groups(self) -> Iterator[tuple[torch.optim.Optimizer, int, list[Any]]]:
        i = 0
        for opt in self.optimizers:
            for g, _ in enumerate(opt.param_groups):
                yield opt, g, self._pairs[i]
                i += 1

    @staticmethod
    def _step_group(opt: torch.optim.Optimizer, index: int) -> None:
        """Step one parameter group of ``opt`` (the others are hidden for the call)."""
        groups = opt.param_groups
        if len(groups) == 1:
            opt.step()
            return
        opt.param_groups = [groups[index]]
        try:
            opt.step()
        finally:
            opt.param_groups = groups

    @torch.no_grad()
    def step(self) -> None:
        """Copy the gradients to the host, step there group by group, copy the parameters back.

        See Also:
            :pt:`torch.optim.Optimizer.step`.
        """
        copied = 0
        for opt, index, pairs in self._groups():
            for dev, host in pairs:
                grad = dev.grad
                if grad is None:
                    host.grad = None
                    continue
                if host.grad is None:
                    host.grad = torch.empty(host.shape, dtype=host.dtype, device="cpu",
                                            pin_memory=self._pin)  # fmt: skip
                host.grad.copy_(_local(grad))
                copied += host.grad.numel() * host.grad.element_size()
                dev.grad = None  # the device gradient is freed before the host step
            self._executor.submit(self._step_group, opt, index).result()
            if not self.host_thread_ids:
                self.host_thread_ids = (self._executor.submit(_thread_ids).result(),)
            for dev, host in pairs:
                _local(dev.detach()).copy_(host.detach(), non_blocking=self._pin)
                copied += host.numel() * host.element_size()
        self.copied_bytes = copied

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the device gradients (the host buffers are overwritten by the next step).

        Args:
            set_to_none: Free the device gradients instead of zeroing them.

        See Also:
            :pt:`torch.optim.Optimizer.zero_grad`.
        """
        for pairs in self._pairs:
            for dev, _ in pairs:
                if dev.grad is None:
                    continue
                if set_to_none:
                    dev.grad = None
                else:
                    dev.grad.zero_()

    def close(self) -> None:
        """Stop the host thread."""
        self._executor.shutdown(wait=True)


def offload_optimizers(
    container: OptimizersContainer, *, job_config: Any = None
) -> OffloadedOptimizersContainer:
    """Move ``container``'s optimizers to host memory (``--offload.optimizer true``).

    Args:
        container: Optimizers built on the device parameters, not stepped yet. ``Muon`` is
            refused (its step communicates between ranks on device tensors).
        job_config: The job, when called by the trainer: checkpointing is refused with
            offload in this release (the checkpoint maps optimizer state to the model's
            parameters by identity, and the offloaded optimizers hold host copies).

    Returns:
        The offloaded container (the same optimizer objects, now holding host parameters).

    Raises:
        ValueError: A Muon optimizer, optimizers that already hold state, or a job with
            ``checkpoint.enable``.

    See Also:
        :pt:`torch.distributed.fsdp.CPUOffloadPolicy`: FSDP2's parameter + optimizer offload.
    """
    if job_config is not None and job_config.checkpoint.enable:
        raise ValueError(
            "offload.optimizer = true with checkpoint.enable = true is not supported yet (the "
            "checkpoint maps optimizer state to the device parameters): set one of them false"
        )
    for opt in container.optimizers:
        if not isinstance(opt, (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)):
            raise ValueError(
                f"offload.optimizer supports AdamW, Adam and SGD; got {type(opt).__name__} "
                "(Muon's step exchanges matrices between ranks on the device)"
            )
    return OffloadedOptimizersContainer(container)
