"""gpt-oss <-> HuggingFace ``GptOssForCausalLM`` (fused, transposed expert tensors there).

Key mapping per block ``{i}`` (``model.layers.{i}.`` prefix on HF's side)::

    attention.wq / wk .weight / .bias     self_attn.q_proj / k_proj   (rotary rows permuted)
    attention.wv / wo .weight / .bias     self_attn.v_proj / o_proj
    attention.sinks                       self_attn.sinks
    attention_norm / ffn_norm .weight     input_layernorm / post_attention_layernorm .weight
    moe.router.gate.weight / .bias        mlp.router.weight / .bias
    moe.experts.w1, w3 ([E, I, D])        mlp.experts.gate_up_proj ([E, D, 2I]: gate on even
                                          columns, up on odd ones)
    moe.experts.b1, b3 ([E, I, 1])        mlp.experts.gate_up_proj_bias ([E, 2I], interleaved)
    moe.experts.w2 ([E, D, I])            mlp.experts.down_proj ([E, I, D])
    moe.expert_output_bias.weight         mlp.experts.down_proj_bias ([E, D])

plus the embedding, final norm and LM head of the dense adapter. The conversion is exact
(renames, slicing, transposes and a rotary permutation), so a round trip gives back the same
tensors. The adapter converts whole tensors (a fused expert tensor holds two of ours), so
checkpoint import and export go through the full state dict rather than per-rank slices.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from hp_trainer.components.hf_io.adapters import (
    StateDictAdapter,
    full_tensor_of,
    half_to_interleaved_rotary,
    interleaved_to_half_rotary,
)
from hp_trainer.components.hf_io.config import rope_scaling_to_hf
from hp_trainer.models.gpt_oss.model import GptOssArgs

__all__ = ["GptOssStateDictAdapter"]

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_BLOCK = {
    f"attention.{ours}.{kind}": f"self_attn.{theirs}.{kind}"
    for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))
    for kind in ("weight", "bias")
} | {
    "attention.sinks": "self_attn.sinks",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "moe.router.gate.weight": "mlp.router.weight",
    "moe.router.gate.bias": "mlp.router.bias",
    "moe.experts.w2": "mlp.experts.down_proj",
    "moe.expert_output_bias.weight": "mlp.experts.down_proj_bias",
}
_HF_TOP = {v: k for k, v in _TOP.items()}
_HF_BLOCK = {v: k for k, v in _BLOCK.items()}
_FUSED = ("moe.experts.w1", "moe.experts.w3", "moe.experts.b1", "moe.experts.b3")


class GptOssStateDictAdapter(StateDictAdapter):
    """HF ``GptOssForCausalLM`` <-> our ``GptOss``.

    Args:
        model_args: The model's ``GptOssArgs``.
        hf_assets_path: Folder of HF assets; kept for reference.

    Raises:
        TypeError: If ``model_args`` is not a ``GptOssArgs``.

    See Also:
        HF's ``GptOssForCausalLM``; TorchTitan's gpt-oss state-dict adapter.
    """

    model_type: ClassVar[str] = "gpt_oss"
    architecture: ClassVar[str] = "GptOssForCausalLM"

    def __init__(self, model_args: GptOssArgs, hf_assets_path: str | None = None) -> None:
        if not isinstance(model_args, GptOssArgs):
            raise TypeError(
                f"{type(self).__name__} needs GptOssArgs, got {type(model_args).__name__}"
            )
        super().__init__(model_args, hf_assets_path)
        self.args = model_args

    def _heads(self, rest: str) -> int | None:
        """Heads along dim 0 of a rotary-permuted tensor (None: no permutation)."""
        if rest.startswith("attention.wq."):
            return self.args.n_heads
        if rest.startswith("attention.wk."):
            return self.args.n_kv_heads
        return None

    def to_hf(self, state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Convert our state dict to HuggingFace names and layouts.

        Args:
            state_dict: Our model state dict (DTensors are gathered: a collective).

        Returns:
            The HuggingFace state dict.

        Raises:
            KeyError: For a key this adapter does not know, or half of a fused expert pair.
            TypeError: For a value that is not a tensor.

        See Also:
            HF's ``GptOssForCausalLM.state_dict``: the names written.
        """
        out: dict[str, torch.Tensor] = {}
        fused: dict[str, dict[str, torch.Tensor]] = {}
        for key in state_dict:
            value = full_tensor_of(state_dict[key], key)
            if key in _TOP:
                if key == "lm_head.weight" and self.args.enable_weight_tying:
                    continue
                out[_TOP[key]] = value
                continue
            m = _LAYER.match(key)
            if m is None:
                raise KeyError(f"{type(self).__name__}.to_hf: no HuggingFace name for {key!r}")
            block, rest = m.group(1), m.group(2)
            if rest in _FUSED:
                fused.setdefault(block, {})[rest.rsplit(".", 1)[1]] = value
                continue
            if rest not in _BLOCK:
                raise KeyError(f"{type(self).__name__}.to_hf: no HuggingFace name for {key!r}")
            heads = self._heads(rest)
            if heads is not None:
                value = interleaved_to_half_rotary(value, heads)
            elif rest == "moe.experts.w2":
                value = value.transpose(1, 2).contiguous()
            out[f"model.layers.{block}.{_BLOCK[rest]}"] = value
        for block, parts in fused.items():
            if set(parts) != {"w1", "w3", "b1", "b3"}:
                raise KeyError(
                    f"{type(self).__name__}.to_hf: layer {block} has {sorted(parts)} of the "
                    "fused expert tensors; expected w1, w3, b1 and b3 together"
                )
            w1, w3 = parts["w1"], parts["w3"]  # [E, I, D]
            gate_up = torch.stack([w1, w3], dim=2).reshape(w1.shape[0], -1, w1.shape[2])
            bias = torch.stack([parts["b1"][..., 0], parts["b3"][..., 0]], dim=2)
            prefix = f"model.layers.{block}.mlp.experts."
            out[prefix + "gate_up_proj"] = gate_up.transpose(1, 2).contiguous()
            out[prefix + "gate_up_proj_bias"] = bias.reshape(w1.shape[0], -1).contiguous()
        return out

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Convert a HuggingFace state dict to ours.

        Args:
            hf_state_dict: The HuggingFace state dict (``transformers``' dequantized layout).

        Returns:
            Our state dict.

        Raises:
            KeyError: For a key this adapter does not know (an MXFP4 ``_blocks``/``_scales``
                tensor included: dequantize first, e.g. by loading it in ``transformers``).

        See Also:
            HF's ``GptOssForCausalLM.load_state_dict``.
        """
        out: dict[str, torch.Tensor] = {}
        for key, value in hf_state_dict.items():
            if key.endswith("rotary_emb.inv_freq"):
                continue
            if key in _HF_TOP:
                if key == "lm_head.weight" and self.args.enable_weight_tying:
                    continue
                out[_HF_TOP[key]] = value
                continue
            m = _HF_LAYER.match(key)
            if m is None:
                raise KeyError(f"{type(self).__name__}.from_hf: no native name for {key!r}")
            block, rest = m.group(1), m.group(2)
            prefix = f"layers.{block}."
            if rest == "mlp.experts.gate_up_proj":  # [E, D, 2I]
                pairs = value.transpose(1, 2)  # [E, 2I, D]
                out[prefix + "moe.experts.w1"] = pairs[:, 0::2].contiguous()
                out[prefix + "moe.experts.w3"] = pairs[:, 1::2].contiguous()
                continue
            if rest == "mlp.experts.gate_up_proj_bias":  # [E, 2I]
                out[prefix + "moe.experts.b1"] = value[:, 0::2].unsqueeze(-1).contiguous()
                out[prefix + "moe.experts.b3"] = value[:, 1::2].unsqueeze(-1).contiguous()
                continue
            if rest not in _HF_BLOCK:
                raise KeyError(f"{type(self).__name__}.from_hf: no native name for {key!r}")
            ours = _HF_BLOCK[rest]
            heads = self._heads(ours)
            if heads is not None:
                value = half_to_interleaved_rotary(value, heads)
            elif ours == "moe.experts.w2":
                value = value.transpose(1, 2).contiguous()
            out[prefix + ours] = value
        if self.args.enable_weight_tying and "tok_embeddings.weight" in out:
            out["lm_head.weight"] = out["tok_embeddings.weight"]
        return out

    def hf_config(self) -> dict[str, Any]:
        """Return the ``config.json`` contents for ``transformers``.

        Returns:
            ``GptOssConfig``'s fields (sizes, experts, window and layer types, YaRN in
            ``rope_parameters``, the SwiGLU's alpha and limit).

        See Also:
            ``transformers.GptOssConfig``.
        """
        args = self.args
        rope: dict[str, Any] = rope_scaling_to_hf(args.rope_scaling) or {"rope_type": "default"}
        rope["rope_theta"] = args.rope_theta
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_size": args.dim,
            "intermediate_size": args.moe_hidden_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim,
            "vocab_size": args.vocab_size,
            "rms_norm_eps": args.norm_eps,
            "rope_parameters": rope,
            "max_position_embeddings": args.max_seq_len,
            "tie_word_embeddings": args.enable_weight_tying,
            "hidden_act": "silu",
            "attention_bias": args.attention_bias,
            "num_local_experts": args.moe_args.num_experts,
            "num_experts_per_tok": args.moe_args.top_k,
            "router_aux_loss_coef": args.moe_args.aux_loss_coeff,
            "output_router_logits": False,
            "sliding_window": args.sliding_window,
            "layer_types": list(args.layer_types or ()),
            "swiglu_alpha": args.swiglu_alpha,
            "swiglu_limit": args.swiglu_limit,
            "torch_dtype": "float32",
        }
