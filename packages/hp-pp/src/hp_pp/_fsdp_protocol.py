"""Driving an FSDP-wrapped stage module across micro-batches, recognised by its methods.

hp-pp depends on neither hp-fsdp nor ``torch.distributed.fsdp``: a module is an FSDP module
when it has the control methods both ``FSDPModule`` classes share. During a step, every
micro-batch's backward but the last one of the stage runs with gradient sync, resharding after
backward and the "last backward" flag off, so gradients accumulate unsharded and no
reduce-scatter runs per micro-batch; the last backward of the stage turns them on, so FSDP's own
hooks reduce the accumulated gradients once and reshard. Whether parameters stay unsharded
between micro-batch forwards is the module's ``reshard_after_forward`` (``False`` keeps them:
one all-gather per step instead of one per micro-batch).

See Also:
    :pt:`torch.distributed.pipelining.stage._PipelineStageBase.backward_maybe_with_nosync`
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

_CONTROL_METHODS = (
    "set_requires_gradient_sync",
    "set_is_last_backward",
    "set_reshard_after_backward",
    "unshard",
    "reshard",
)


@dataclass(frozen=True)
class FSDPControl:
    """The FSDP control surface of one stage module."""

    module: Any

    @staticmethod
    def of(module: nn.Module) -> FSDPControl | None:
        """The control of ``module`` when it is an FSDP module, else ``None``."""
        if all(callable(getattr(module, name, None)) for name in _CONTROL_METHODS):
            return FSDPControl(module)
        return None

    def set_last_backward(self, last: bool) -> None:
        """Before a backward: whether it is the stage's last one of the step."""
        self.module.set_is_last_backward(last)
        self.module.set_reshard_after_backward(last)
        self.module.set_requires_gradient_sync(last)

    def unshard(self) -> None:
        """All-gather the parameters (the ``UNSHARD`` action)."""
        self.module.unshard()

    def reshard(self) -> None:
        """Free the unsharded parameters (the ``RESHARD`` action)."""
        self.module.reshard()
