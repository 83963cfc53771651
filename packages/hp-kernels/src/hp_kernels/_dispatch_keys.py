"""The device-type and dispatch-key names hp-kernels spells (its only such module).

hp-kernels depends on torch only, so it cannot import ``hp_dtensor.device``; every device or
dispatch-key string the package needs lives here instead. Out-of-tree accelerators (Ascend's
``torch_npu`` among them) plug into PyTorch's generic PrivateUse1 slot, whose device type
``"privateuseone"`` is valid on every torch build, with or without the plugin; the plugin's own
name only exists once it has renamed the slot, so kernels for it register under the generic one.
Other device types are not named: they come from the tensors and from
``torch._C._dispatch_key_for_device``, except the one the Triton kernels register for.
"""

from __future__ import annotations

__all__: list[str] = []

#: PyTorch's device type for the PrivateUse1 dispatch key (out-of-tree accelerators).
PRIVATEUSE1_DEVICE_TYPE = "privateuseone"

#: The dispatch key behind :data:`PRIVATEUSE1_DEVICE_TYPE`.
PRIVATEUSE1_DISPATCH_KEY = "PrivateUse1"

#: The device type of the Triton kernels (Triton's NVIDIA GPU backend).
CUDA_DEVICE_TYPE = "cuda"

#: The meta device: shapes only, served by the fake kernels.
META_DEVICE_TYPE = "meta"

#: The alias key under which the reference kernels are registered (every backend).
REFERENCE_DISPATCH_KEY = "CompositeExplicitAutograd"
