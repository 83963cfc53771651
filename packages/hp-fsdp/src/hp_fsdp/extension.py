"""PyTorch FSDP2's tensor-subclass all-gather extension, for one parameter.

A parameter whose local tensor defines ``fsdp_pre_all_gather`` and ``fsdp_post_all_gather``
chooses what is all-gathered (e.g. int8 data and an fp32 scale instead of the dequantized
weight) and how the gathered tensors become the unsharded parameter:

- ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)`` (or the older
  ``fsdp_pre_all_gather(mesh)``) returns ``(all_gather_inputs, metadata)``;
- ``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)`` returns
  ``(unsharded_tensor, inner_tensors_to_free)`` on the first all-gather, and later fills
  ``out`` (the existing unsharded parameter) in place.

See Also:
    :pt:`torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam.all_gather_inputs` and
    ``FSDPParam.init_unsharded_param``: PyTorch's implementation of the protocol.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from hp_fsdp.errors import FSDPUsageError

__all__ = ["AllGatherExtension"]


def _free(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _alloc(tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


class AllGatherExtension:
    """The all-gather state of one parameter using the tensor-subclass extension.

    Holds what ``fsdp_pre_all_gather`` returned until ``fsdp_post_all_gather`` consumes it,
    the per-input all-gather outputs (kept across iterations, storage freed at reshard) and
    the inner tensors the subclass asked to free at reshard.
    """

    def __init__(self, shard_mesh: DeviceMesh) -> None:
        #: The mesh ``fsdp_pre_all_gather`` is given: the shard axis only (HSDP: not the
        #: replicate axis), as in PyTorch.
        self.shard_mesh = shard_mesh
        self._metadata: Any = None
        self._input_sizes: list[torch.Size] = []
        self._outputs: list[torch.Tensor] = []
        self._inner_to_free: list[torch.Tensor] = []

    def inputs(
        self,
        local: torch.Tensor,
        orig_size: torch.Size,
        orig_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: object,
        padded_size: torch.Size,
    ) -> list[torch.Tensor]:
        """Call ``fsdp_pre_all_gather`` and return its inputs, flattened.

        Args:
            local: the sharded local tensor (the subclass instance).
            orig_size: the unsharded parameter's size.
            orig_stride: its contiguous stride.
            module: the module registering the parameter.
            mp_policy: the unit's mixed-precision policy.
            padded_size: the padded sharded size (chunk 0's).

        Returns:
            One flat tensor per all-gather input.

        Raises:
            FSDPUsageError: (an ``AssertionError``, as in PyTorch) for a
                ``fsdp_pre_all_gather`` taking neither 1 nor 5 arguments, or when an uneven
                shard's inputs are not of the padded sharded size.
        """
        pre = local.fsdp_pre_all_gather  # type: ignore[attr-defined]
        num_args = len(inspect.signature(pre).parameters)
        if num_args == 1:  # the original signature: the mesh only
            inputs, self._metadata = pre(self.shard_mesh)
        elif num_args == 5:
            inputs, self._metadata = pre(self.shard_mesh, orig_size, orig_stride, module, mp_policy)
        else:
            raise FSDPUsageError(
                f"fsdp_pre_all_gather of {type(local).__name__} takes {num_args} arguments; "
                "expected (mesh, outer_size, outer_stride, module, mp_policy) or (mesh)"
            )
        # Every rank must send equally many elements: an uneven (padded) shard's inputs
        # carry the padding, or the collective would mismatch on the padded ranks only.
        if local.size() != padded_size and any(t.size() != padded_size for t in inputs):
            raise FSDPUsageError(
                f"for an unevenly sharded parameter of size {tuple(orig_size)}, "
                f"fsdp_pre_all_gather must return inputs of the padded sharded size "
                f"{tuple(padded_size)}, got {[tuple(t.size()) for t in inputs]}"
            )
        self._input_sizes = [t.size() for t in inputs]
        return [t.reshape(-1) for t in inputs]

    def outputs(
        self, numels: list[int], dtypes: list[torch.dtype], world_size: int, device: torch.device
    ) -> list[torch.Tensor]:
        """The flat all-gather output of each input (allocated once, storage re-allocated).

        Args:
            numels: each input's element count.
            dtypes: each input's dtype.
            world_size: the all-gather world size.
            device: the compute device.

        Returns:
            One flat tensor of ``world_size * numel`` elements per input.
        """
        if not self._outputs:
            self._outputs = [
                torch.empty(n * world_size, dtype=d, device=device)
                for n, d in zip(numels, dtypes, strict=True)
            ]
        for tensor in self._outputs:
            _alloc(tensor)
        return self._outputs

    def unsharded(
        self, local: torch.Tensor, param_dtype: torch.dtype, out: nn.Parameter | None
    ) -> torch.Tensor | None:
        """Call ``fsdp_post_all_gather`` on the gathered outputs.

        Args:
            local: the sharded local tensor (the subclass instance).
            param_dtype: the compute dtype.
            out: the existing unsharded parameter, filled in place; None on the first
                all-gather.

        Returns:
            The new unsharded tensor on the first all-gather, else None.
        """
        gathered = tuple(
            t.view(-1, *s[1:]) for t, s in zip(self._outputs, self._input_sizes, strict=True)
        )
        post = local.fsdp_post_all_gather  # type: ignore[attr-defined]
        metadata, self._metadata = self._metadata, None
        if out is not None:
            for tensor in self._inner_to_free:
                _alloc(tensor)
            post(gathered, metadata, param_dtype, out=out)
            return None
        tensor, inner = post(gathered, metadata, param_dtype)
        self._inner_to_free = list(inner)
        return tensor  # type: ignore[no-any-return]

    def free(self) -> None:
        """Free the storage of the all-gather outputs and the subclass's inner tensors."""
        for tensor in (*self._outputs, *self._inner_to_free):
            _free(tensor)
