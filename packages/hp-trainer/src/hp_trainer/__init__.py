"""TorchTitan-style training orchestration and the `hp-train` command.

See Also:
    ``torchtitan.train.Trainer``
"""

from hp_trainer.__about__ import __version__

__all__ = ["__version__"]
