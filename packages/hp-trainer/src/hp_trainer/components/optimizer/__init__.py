"""Optimizers: the per-model-part container and Muon with owner ranks.

See Also:
    :titan:`torchtitan/components/optimizer.py`: TorchTitan's optimizers container.
"""

from hp_trainer.components.optimizer.containers import OptimizersContainer, build_optimizers
from hp_trainer.components.optimizer.muon import Muon, get_hyper_optimizer

__all__ = ["Muon", "OptimizersContainer", "build_optimizers", "get_hyper_optimizer"]
