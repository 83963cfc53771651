"""Tensor parallelism: parallel styles, parallelize_module, loss_parallel, shard_module and DFunction.

See Also:
    ``torch.distributed.tensor.parallel``
"""

from hp_tp.__about__ import __version__

__all__ = ["__version__"]
