"""Fused communication-path ops (torch.library custom ops with CPU reference, CUDA/Triton and Ascend NPU kernels) and the Comm interfaces.

See Also:
    ``torch.library``
"""

from hp_kernels.__about__ import __version__

__all__ = ["__version__"]
