"""The attention kernels context parallelism calls: one block of SDPA that returns its LSE.

Every CP mode splits attention into blocks (a query block against a key/value block) whose
partial outputs are merged by their log-sum-exp, and whose backward is the kernel's backward run
with the *merged* output and LSE. So a kernel qualifies when its forward returns the LSE and its
backward accepts an output and LSE it did not compute. The kernel is chosen by the device of the
query through :mod:`hp_dtensor.device`:

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (tested in CI).
  They take grouped-query attention (fewer K/V heads) as it is, as SDPA's ``enable_gqa=True``
  does: no K/V repetition, and the K/V gradients come back with the K/V heads.
* CUDA: the flash kernel for fp16/bf16 without a mask, otherwise the memory-efficient kernel; the
  cuDNN kernel when it is the only SDPA backend enabled in ``torch.backends.cuda``. The flash
  kernel takes fewer K/V heads as they are (as SDPA's ``enable_gqa=True`` does); for the
  memory-efficient and cuDNN kernels, which take equal head counts only, K/V heads are repeated
  for that call and their gradients summed back (as SDPA itself does for them). Written from the
  ops' schemas and not run in CI (no GPU there).

A document mask reaches a kernel as a boolean mask, converted to the additive bias the kernels
take for that call only, and is passed again (rebuilt by the caller) to the backward: no kernel
state keeps a mask or bias between forward and backward.

Any other device raises a ``RuntimeError`` naming the devices that have a kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from hp_dtensor.device import DEVICE_TYPE_CPU, DEVICE_TYPE_CUDA

_aten = torch.ops.aten


@dataclass(frozen=True)
class BlockResult:
    """One block's forward: output ``[B, H, Sq, D]``, float32 LSE ``[B, H, Sq]``, kernel state."""

    out: torch.Tensor
    lse: torch.Tensor
    aux: Any


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Boolean ``True = attend`` mask to the additive form the kernels take."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    group = heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _sum_kv_grad(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = grad.shape
    if h == kv_heads:
        return grad
    return grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


class _CpuFlashKernel:
    """CPU flash attention (``..._flash_attention_for_cpu``), GQA and masks supported."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool,
        scale: float | None,
        mask: torch.Tensor | None,
    ) -> BlockResult:
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=_additive_mask(mask, q.dtype), scale=scale
        )
        return BlockResult(out, lse, None)

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        aux: Any,
        is_causal: bool,
        scale: float | None,
        mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            0.0,
            is_causal,
            attn_mask=_additive_mask(mask, q.dtype),
            scale=scale,
        )
        return dq, dk, dv


class _CudaKernel:
    """CUDA flash / memory-efficient / cuDNN attention (not exercised in CI: no GPU there)."""

    def _choice(self, q: torch.Tensor, mask: torch.Tensor | None) -> str:
        backends = torch.backends.cuda
        if (
            backends.cudnn_sdp_enabled()  # type: ignore[no-untyped-call]
            and not backends.flash_sdp_enabled()  # type: ignore[no-untyped-call]
            and not backends.mem_efficient_sdp_enabled()  # type: ignore[no-untyped-call]
        ):
            return "cudnn"
        if mask is None and q.dtype in (torch.float16, torch.bfloat16):
            return "flash"
        return "efficient"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool,
        scale: float | None,
        mask: torch.Tensor | None,
    ) -> BlockResult:
        heads, sq = q.shape[1], q.shape[2]
        bias = _additive_mask(mask, q.dtype)
        kind = self._choice(q, bias)
        if kind != "flash":  # flash takes fewer K/V heads natively
            k, v = _repeat_kv(k, heads), _repeat_kv(v, heads)
        if kind == "flash":
            out, lse, cq, ck, mq, mk, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, is_causal, False, scale=scale
            )
            aux: tuple[Any, ...] = (kind, cq, ck, mq, mk, seed, offset)
        elif kind == "cudnn":
            out, lse, cq, ck, mq, mk, seed, offset, _ = _aten._scaled_dot_product_cudnn_attention(
                q, k, v, bias, True, 0.0, is_causal, False, scale=scale
            )
            aux = (kind, cq, ck, mq, mk, seed, offset)
        else:
            if bias is not None:
                bias = bias.expand(q.shape[0], heads, sq, k.shape[2])
            out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(
                q, k, v, bias, True, 0.0, is_causal, scale=scale
            )
            # The efficient kernel pads the LSE's last dim; the merge needs exactly Sq.
            aux = (kind, seed, offset, lse.shape[-1])
            lse = lse[..., :sq]
        # Some kernels give the LSE a trailing unit dim; the merge wants out.shape[:-1].
        trailing = lse.dim() == out.dim()
        lse = lse.squeeze(-1) if trailing else lse
        return BlockResult(out, lse.float(), (aux, trailing))

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        aux: Any,
        is_causal: bool,
        scale: float | None,
        mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        heads, kv_heads = q.shape[1], k.shape[1]
        aux, trailing = aux
        lse = lse.float()  # the CUDA kernels keep their LSE in float32
        lse = lse.unsqueeze(-1) if trailing else lse
        kind = aux[0]
        bias = _additive_mask(mask, q.dtype)  # rebuilt: the forward kept none
        if kind != "flash":
            k, v = _repeat_kv(k, heads), _repeat_kv(v, heads)
        if kind == "flash":
            _, cq, ck, mq, mk, seed, offset = aux
            dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, is_causal, seed, offset, scale=scale
            )
        elif kind == "cudnn":
            _, cq, ck, mq, mk, seed, offset = aux
            dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, k, v, out, lse, seed, offset, bias, cq, ck, mq, mk, 0.0, is_causal,
                scale=scale,
            )  # fmt: skip
        else:
            _, seed, offset, padded = aux
            if bias is not None:
                bias = bias.expand(q.shape[0], heads, q.shape[2], k.shape[2])
            pad = padded - lse.shape[-1]
            lse_in = torch.nn.functional.pad(lse, (0, pad)) if pad > 0 else lse
            dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
                dout, q, k, v, bias, out, lse_in.contiguous(), seed, offset, 0.0,
                [True, True, True, False], is_causal, scale=scale,
            )  # fmt: skip
        return dq, _sum_kv_grad(dk, kv_heads), _sum_kv_grad(dv, kv_heads)


class AttentionKernel:
    """Forward/backward of one attention block on the query's device, LSE included."""

    def __init__(self, device_type: str) -> None:
        if device_type == DEVICE_TYPE_CPU:
            self._impl: _CpuFlashKernel | _CudaKernel = _CpuFlashKernel()
        elif device_type == DEVICE_TYPE_CUDA:
            self._impl = _CudaKernel()
        else:
            raise RuntimeError(
                f"context-parallel attention has kernels for {DEVICE_TYPE_CPU!r} and "
                f"{DEVICE_TYPE_CUDA!r} tensors; got tensors on {device_type!r}"
            )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        is_causal: bool,
        scale: float | None,
        mask: torch.Tensor | None = None,
    ) -> BlockResult:
        return self._impl.forward(q, k, v, is_causal, scale, mask)

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        aux: Any,
        *,
        is_causal: bool,
        scale: float | None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._impl.backward(dout, q, k, v, out, lse, aux, is_causal, scale, mask)
