"""Llama 4 <-> HuggingFace ``Llama4ForCausalLM`` (fused expert tensors there, three here).

Key mapping (``{i}`` is the block index; no rotary permutation: both rotate interleaved
pairs)::

    tok_embeddings.weight               model.embed_tokens.weight
    layers.{i}.attention.wq/wk/wv/wo    model.layers.{i}.self_attn.q/k/v/o_proj.weight
    layers.{i}.attention_norm.weight    model.layers.{i}.input_layernorm.weight
    layers.{i}.ffn_norm.weight          model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.feed_forward.w1/w2/w3    model.layers.{i}.feed_forward.gate/down/up_proj.weight
    layers.{i}.moe.router.gate.weight   model.layers.{i}.feed_forward.router.weight
    layers.{i}.moe.shared_experts.w1/w2/w3
                                        model.layers.{i}.feed_forward.shared_expert.gate/down/up_proj.weight
    layers.{i}.moe.experts.w1, w3       model.layers.{i}.feed_forward.experts.gate_up_proj
                                        ([E, dim, 2 * hidden]: w1 then w3, transposed)
    layers.{i}.moe.experts.w2           model.layers.{i}.feed_forward.experts.down_proj
                                        ([E, hidden, dim]: transposed)
    norm.weight                         model.norm.weight
    lm_head.weight                      lm_head.weight  (absent when embeddings are tied)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from hp_trainer.components.hf_io.adapters import StateDictAdapter, full_tensor_of
from hp_trainer.components.hf_io.config import rope_scaling_to_hf
from hp_trainer.models.llama4.model import Llama4Args

__all__ = ["Llama4StateDictAdapter"]

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_BLOCK_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "feed_forward.gate_proj.weight",
    "feed_forward.w2.weight": "feed_forward.down_proj.weight",
    "feed_forward.w3.weight": "feed_forward.up_proj.weight",
    "moe.router.gate.weight": "feed_forward.router.weight",
    "moe.shared_experts.w1.weight": "feed_forward.shared_expert.gate_proj.weight",
    "moe.shared_experts.w2.weight": "feed_forward.shared_expert.down_proj.weight",
    "moe.shared_experts.w3.weight": "feed_forward.shared_expert.up_proj.weight",
}
_HF_BLOCK_KEYS = {v: k for k, v in _BLOCK_KEYS.items()}
_TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_HF_TOP_KEYS = {v: k for k, v in _TOP_KEYS.items()}
_GATE_UP = "feed_forward.experts.gate_up_proj"
_DOWN = "feed_forward.experts.down_proj"


class Llama4StateDictAdapter(StateDictAdapter):
    """HF ``Llama4ForCausalLM`` <-> our Llama 4 (experts fused/transposed there).

    The conversion is exact (renames, transposes, a concatenation and its split), so a round
    trip gives back the same tensors. HF keeps each block's routed experts in two fused tensors,
    so the import and export go through whole tensors (no per-rank slices).

    Args:
        model_args: The model's :class:`~hp_trainer.models.llama4.model.Llama4Args`.
        hf_assets_path: Folder of HF assets; kept for reference.

    Raises:
        TypeError: If ``model_args`` is not a ``Llama4Args``.

    See Also:
        :titan:`torchtitan.protocols.state_dict_adapter.StateDictAdapter`;
        ``transformers.Llama4ForCausalLM``.
    """

    model_type: ClassVar[str] = "llama4_text"
    architecture: ClassVar[str] = "Llama4ForCausalLM"

    def __init__(self, model_args: Llama4Args, hf_assets_path: str | None = None) -> None:
        if not isinstance(model_args, Llama4Args):
            raise TypeError(
                f"{type(self).__name__} needs Llama4Args, got {type(model_args).__name__}"
            )
        super().__init__(model_args, hf_assets_path)
        self.args: Llama4Args = model_args

    def to_hf(self, state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Convert our state dict to HuggingFace names and layouts.

        Args:
            state_dict: Our model state dict (DTensors are gathered: a collective).

        Returns:
            The HuggingFace state dict.

        Raises:
            KeyError: For a key this adapter does not know, or an expert ``w1`` without its
                ``w3`` (they are fused).

        See Also:
            :titan:`torchtitan.protocols.state_dict_adapter.StateDictAdapter.to_hf`.
        """
        out: dict[str, torch.Tensor] = {}
        for key in state_dict:
            value = full_tensor_of(state_dict[key], key)
            if key in _TOP_KEYS:
                if key == "lm_head.weight" and self.args.enable_weight_tying:
                    continue
                out[_TOP_KEYS[key]] = value
                continue
            m = _LAYER.match(key)
            if m is None:
                raise KeyError(f"{type(self).__name__}.to_hf: no HuggingFace name for {key!r}")
            block, rest = m.group(1), m.group(2)
            prefix = f"model.layers.{block}."
            if rest in _BLOCK_KEYS:
                out[prefix + _BLOCK_KEYS[rest]] = value
            elif rest == "moe.experts.w2":
                out[prefix + _DOWN] = value.transpose(1, 2).contiguous()
            elif rest == "moe.experts.w1":
                partner = f"layers.{block}.moe.experts.w3"
                if partner not in state_dict:
                    raise KeyError(f"{key!r} is fused with {partner!r}, which is missing")
                w3 = full_tensor_of(state_dict[partner], partner)
                out[prefix + _GATE_UP] = torch.cat(
                    [value.transpose(1, 2), w3.transpose(1, 2)], dim=-1
                ).contiguous()
            elif rest != "moe.experts.w3":  # w3 went in with w1
                raise KeyError(f"{type(self).__name__}.to_hf: no HuggingFace name for {key!r}")
        return out

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Convert a HuggingFace state dict to ours (fused experts split and transposed).

        Args:
            hf_state_dict: The HuggingFace state dict.

        Returns:
            Our state dict.

        Raises:
            KeyError: For a key this adapter does not know.
            ValueError: A ``gate_up_proj`` whose last dimension is odd.

        See Also:
            :titan:`torchtitan.protocols.state_dict_adapter.StateDictAdapter.from_hf`.
        """
        out: dict[str, torch.Tensor] = {}
        for key, value in hf_state_dict.items():
            if key.endswith("rotary_emb.inv_freq"):
                continue
            if key in _HF_TOP_KEYS:
                if key == "lm_head.weight" and self.args.enable_weight_tying:
                    continue
                out[_HF_TOP_KEYS[key]] = value
                continue
            m = _HF_LAYER.match(key)
            if m is None:
                raise KeyError(f"{type(self).__name__}.from_hf: no native name for {key!r}")
            block, rest = m.group(1), m.group(2)
            prefix = f"layers.{block}."
            if rest in _HF_BLOCK_KEYS:
                out[prefix + _HF_BLOCK_KEYS[rest]] = value
            elif rest == _DOWN:
                out[prefix + "moe.experts.w2"] = value.transpose(1, 2).contiguous()
            elif rest == _GATE_UP:
                if value.shape[-1] % 2:
                    raise ValueError(
                        f"{key} has shape {list(value.shape)}: expected [experts, dim, 2 * hidden]"
                    )
                gate, up = value.chunk(2, dim=-1)
                out[prefix + "moe.experts.w1"] = gate.transpose(1, 2).contiguous()
                out[prefix + "moe.experts.w3"] = up.transpose(1, 2).contiguous()
            else:
                raise KeyError(f"{type(self).__name__}.from_hf: no native name for {key!r}")
        if self.args.enable_weight_tying and "tok_embeddings.weight" in out:
            out["lm_head.weight"] = out["tok_embeddings.weight"]
        return out

    def hf_config(self) -> dict[str, Any]:
        """Return the ``config.json`` contents for ``transformers``.

        See Also:
            ``transformers.Llama4TextConfig``.
        """
        args = self.args
        moe = args.moe_args

        def number(x: float) -> float | int:
            return int(x) if float(x).is_integer() else x

        config: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_size": args.dim,
            "intermediate_size": args.moe_hidden_dim,
            "intermediate_size_mlp": args.ffn_hidden_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim,
            "vocab_size": args.vocab_size,
            "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_scaling": rope_scaling_to_hf(args.rope_scaling),
            "max_position_embeddings": args.max_seq_len,
            "tie_word_embeddings": args.enable_weight_tying,
            "hidden_act": "silu",
            "attention_bias": False,
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "interleave_moe_layer_step": args.interleave_moe_layer_step,
            "no_rope_layer_interval": args.no_rope_layer_interval,
            "use_qk_norm": args.qk_norm,
            "attention_chunk_size": args.attention_chunk_size,
            "attn_temperature_tuning": args.attn_temperature_tuning,
            "floor_scale": number(args.floor_scale),
            "attn_scale": args.attn_scale,
            "output_router_logits": False,
            "torch_dtype": "float32",
        }
        if args.moe_layers is not None:
            config["moe_layers"] = list(args.moe_layers)
        if args.no_rope_layers is not None:
            config["no_rope_layers"] = list(args.no_rope_layers)
        return config
