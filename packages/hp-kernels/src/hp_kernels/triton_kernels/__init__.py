"""Triton kernels for the CUDA dispatch key of the ``hp_kernels`` ops.

Registered at import of :mod:`hp_kernels` when ``triton`` is installed (``pip install
hp-kernels[triton]``); ``triton`` itself is imported only when a kernel first runs, so the
package imports without it. Every launcher (``hp_kernels.triton_kernels.<module>.<op name>``)
has its op's signature and is exactly what the CUDA registration calls; under
``TRITON_INTERPRET=1`` the same launchers run on CPU tensors, which is how CI verifies them
against the reference kernels without a GPU.

Modules: ``hp_kernels.triton_kernels.fsdp`` (all-gather copy-in/out, reduce-scatter copy-in,
post-reduce), ``.moe`` (token permute/unpermute), ``.attention`` (log-sum-exp merge),
``.mega_moe`` (the fused MoE experts, forward and backward).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from hp_kernels._dispatch_keys import CUDA_DEVICE_TYPE
from hp_kernels._library import ShippedKernels

__all__: list[str] = []

#: The module holding each op's launcher (imported on the first call).
LAUNCHER_MODULES: dict[str, str] = {
    "all_gather_copy_in": "fsdp",
    "all_gather_copy_out": "fsdp",
    "reduce_scatter_copy_in": "fsdp",
    "reduce_scatter_copy_in_out": "fsdp",
    "post_reduce": "fsdp",
    "post_reduce_inplace": "fsdp",
    "post_reduce_accumulate": "fsdp",
    "permute_tokens": "moe",
    "unpermute_tokens": "moe",
    "permute_tokens_aligned": "moe",
    "combine_tokens": "moe",
    "merge_attention_partials": "attention",
    "mega_moe": "mega_moe",
    "mega_moe_grad": "mega_moe",
}

#: The device type the kernels are registered for (Triton's GPU backend).
TRITON_DEVICE_TYPE = CUDA_DEVICE_TYPE


def triton_available() -> bool:
    """Whether ``triton`` is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


class LazyLauncher:
    """A kernel registered for an op that imports its Triton module on the first call."""

    def __init__(self, op_name: str) -> None:
        self.op_name = op_name
        self.module = f"{__name__}.{LAUNCHER_MODULES[op_name]}"

    def __call__(self, *args: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.op_name)(*args)


def launcher(op_name: str) -> Any:
    """The Triton launcher of ``op_name`` (imports ``triton``)."""
    return getattr(importlib.import_module(f"{__name__}.{LAUNCHER_MODULES[op_name]}"), op_name)


def register(shipped: ShippedKernels) -> None:
    """Register every launcher for the CUDA key when ``triton`` is installed."""
    if not triton_available():
        return
    for op_name in LAUNCHER_MODULES:
        shipped.register(op_name, TRITON_DEVICE_TYPE, LazyLauncher(op_name))
