"""Qwen3.5 <-> HuggingFace ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``.

Our layouts are ``transformers``' (rotary halves, ``1 + weight`` norms), so most tensors are
renamed only. Per block ``{i}`` (HF under ``model.layers.{i}.``)::

    attention_norm / ffn_norm                     input_layernorm / post_attention_layernorm
    attention.wq / wk / wv / wo / q_norm / k_norm self_attn.q_proj / k_proj / v_proj / o_proj /
                                                  q_norm / k_norm
    linear_attention.wq | wk | wv  (stacked)      linear_attn.in_proj_qkv
    linear_attention.conv_q | conv_k | conv_v     linear_attn.conv1d.weight  (channels, 1, taps)
    linear_attention.wz / wb / wa / wo            linear_attn.in_proj_z / in_proj_b / in_proj_a /
                                                  out_proj
    linear_attention.dt_bias / A_log / norm       linear_attn.dt_bias / A_log / norm
    feed_forward.w1 / w2 / w3                     mlp.gate_proj / down_proj / up_proj
    moe.router.gate                               mlp.gate
    moe.experts.w1[j] / w2[j] / w3[j]             mlp.experts.{j}.gate_proj / down_proj / up_proj
    moe.shared_expert.w1 / w2 / w3                mlp.shared_expert.gate_proj / down_proj / up_proj
    moe.shared_expert_gate                        mlp.shared_expert_gate

Experts are written one matrix per expert (the published files' layout, which ``transformers``
fuses on load); :meth:`hp_trainer.Qwen35StateDictAdapter.from_hf` also reads the fused
``mlp.experts.gate_up_proj`` / ``down_proj`` tensors and the ``model.language_model.`` prefix
of the vision-language checkpoints, and skips their ``mtp.`` and ``model.visual.`` tensors.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from hp_trainer.components.hf_io.adapters import StateDictAdapter, full_tensor_of
from hp_trainer.components.hf_io.config import rope_scaling_to_hf
from hp_trainer.models.qwen3_5.model import Qwen35Args, Qwen35MoeArgs

__all__ = ["Qwen35MoeStateDictAdapter", "Qwen35StateDictAdapter"]

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.weight$")
_EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_QKV = ("wq", "wk", "wv")
_CONV = ("conv_q", "conv_k", "conv_v")

_RENAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "linear_attention.wz.weight": "linear_attn.in_proj_z.weight",
    "linear_attention.wb.weight": "linear_attn.in_proj_b.weight",
    "linear_attention.wa.weight": "linear_attn.in_proj_a.weight",
    "linear_attention.wo.weight": "linear_attn.out_proj.weight",
    "linear_attention.dt_bias": "linear_attn.dt_bias",
    "linear_attention.A_log": "linear_attn.A_log",
    "linear_attention.norm.weight": "linear_attn.norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.shared_expert.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "moe.shared_expert.w2.weight": "mlp.shared_expert.down_proj.weight",
    "moe.shared_expert.w3.weight": "mlp.shared_expert.up_proj.weight",
    "moe.shared_expert_gate.weight": "mlp.shared_expert_gate.weight",
}
_HF_RENAMES = {v: k for k, v in _RENAMES.items()}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_HF_TOP = {v: k for k, v in _TOP.items()}


class Qwen35StateDictAdapter(StateDictAdapter):
    """HF ``Qwen3_5ForCausalLM`` <-> our :class:`~hp_trainer.Qwen35`.

    Renames, and splits (stacks) the fused query/key/value projection and convolution of the
    Gated DeltaNet blocks. Exact: a round trip gives back the same tensors.

    Args:
        model_args: The model's :class:`~hp_trainer.models.qwen3_5.model.Qwen35Args`.
        hf_assets_path: Folder of HF assets; kept for reference.

    Raises:
        TypeError: ``model_args`` of another family.

    See Also:
        :titan:`torchtitan.protocols.state_dict_adapter.StateDictAdapter`: TorchTitan's protocol.
    """

    model_type: ClassVar[str] = "qwen3_5_text"
    architecture: ClassVar[str] = "Qwen3_5ForCausalLM"
    args_type: ClassVar[type] = Qwen35Args

    def __init__(self, model_args: Qwen35Args, hf_assets_path: str | None = None) -> None:
        if not isinstance(model_args, self.args_type):
            raise TypeError(
                f"{type(self).__name__} needs {self.args_type.__name__}, got "
                f"{type(model_args).__name__}"
            )
        super().__init__(model_args, hf_assets_path)
        self.args: Qwen35Args = model_args

    def _split_sizes(self) -> tuple[int, int, int]:
        a = self.args
        keys = a.linear_num_key_heads * a.linear_key_head_dim
        return keys, keys, a.linear_num_value_heads * a.linear_value_head_dim

    def to_hf(self, state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Convert our state dict to HuggingFace names and layouts.

        Args:
            state_dict: Our model state dict (DTensors are gathered: a collective every rank
                must join).

        Returns:
            The HuggingFace state dict.

        Raises:
            KeyError: For a key this adapter does not know, or a missing part of a fused
                tensor.
            TypeError: For a value that is not a tensor.

        See Also:
            :titan:`torchtitan.protocols.state_dict_adapter.StateDictAdapter.to_hf`.
        """
        out: dict[str, torch.Tensor] = {}
        fused: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
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
            prefix = f"model.layers.{block}."
            if rest in _RENAMES:
                out[prefix + _RENAMES[rest]] = value
            elif rest in (f"linear_attention.{p}.weight" for p in _QKV):
                fused.setdefault((block, "qkv"), {})[rest.split(".")[1]] = value
            elif rest in (f"linear_attention.{c}" for c in _CONV):
                fused.setdefault((block, "conv"), {})[rest.split(".")[1]] = value
            elif rest.startswith("moe.experts.") and rest[12:] in _EXPERT_NAMES:
                name = _EXPERT_NAMES[rest[12:]]
                for j in range(value.shape[0]):
                    out[f"{prefix}mlp.experts.{j}.{name}.weight"] = value[j].clone()
            else:
                raise KeyError(f"{type(self).__name__}.to_hf: no HuggingFace name for {key!r}")
        for (block, kind), parts in fused.items():
            names = _QKV if kind == "qkv" else _CONV
            if set(parts) != set(names):
                raise KeyError(
                    f"{type(self).__name__}.to_hf: block {block} has {sorted(parts)} of the "
                    f"fused {kind} tensors, expected {list(names)}"
                )
            whole = torch.cat([parts[n] for n in names], dim=0)
            if kind == "qkv":
                out[f"model.layers.{block}.linear_attn.in_proj_qkv.weight"] = whole
            else:
                out[f"model.layers.{block}.linear_attn.conv1d.weight"] = whole.unsqueeze(1)
        return out

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Convert a HuggingFace state dict to our names and layouts.

        Args:
            hf_state_dict: The HuggingFace state dict (text model; a vision-language
                checkpoint's ``model.language_model.`` tensors are read, its vision and
                multi-token-prediction tensors skipped).

        Returns:
            Our state dict.

        Raises:
            KeyError: For a key this adapter does not know, or missing experts.

        See Also:
            :titan:`torchtitan.protocols.state_dict_adapter.StateDictAdapter.from_hf`.
        """
        out: dict[str, torch.Tensor] = {}
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        sizes = self._split_sizes()
        for raw_key, value in hf_state_dict.items():
            key = raw_key.replace("model.language_model.", "model.", 1)
            if key.startswith(("mtp.", "model.visual.")) or key.endswith("rotary_emb.inv_freq"):
                continue
            if key in _HF_TOP:
                if key == "lm_head.weight" and self.args.enable_weight_tying:
                    continue
                out[_HF_TOP[key]] = value
                continue
            m = _HF_LAYER.match(key)
            if m is None:
                raise KeyError(f"{type(self).__name__}.from_hf: no native name for {raw_key!r}")
            block, rest = m.group(1), m.group(2)
            prefix = f"layers.{block}."
            if rest in _HF_RENAMES:
                out[prefix + _HF_RENAMES[rest]] = value
            elif rest == "linear_attn.in_proj_qkv.weight":
                for name, part in zip(_QKV, torch.split(value, list(sizes)), strict=True):
                    out[f"{prefix}linear_attention.{name}.weight"] = part.clone()
            elif rest == "linear_attn.conv1d.weight":
                for name, part in zip(
                    _CONV, torch.split(value.squeeze(1), list(sizes)), strict=True
                ):
                    out[f"{prefix}linear_attention.{name}"] = part.clone()
            elif rest == "mlp.experts.gate_up_proj":  # transformers' fused in-memory layout
                w1, w3 = value.chunk(2, dim=1)
                out[prefix + "moe.experts.w1"] = w1.contiguous()
                out[prefix + "moe.experts.w3"] = w3.contiguous()
            elif rest == "mlp.experts.down_proj":
                out[prefix + "moe.experts.w2"] = value
            elif (e := _HF_EXPERT.match(rest)) is not None:
                experts.setdefault((block, e.group(2)), {})[int(e.group(1))] = value
            else:
                raise KeyError(f"{type(self).__name__}.from_hf: no native name for {raw_key!r}")
        ours_of = {v: k for k, v in _EXPERT_NAMES.items()}
        for (block, name), by_index in experts.items():
            count = len(by_index)
            if sorted(by_index) != list(range(count)):
                raise KeyError(
                    f"{type(self).__name__}.from_hf: layer {block} has experts "
                    f"{sorted(by_index)} for {name}, expected 0..{count - 1}"
                )
            stacked = torch.stack([by_index[j] for j in range(count)])
            out[f"layers.{block}.moe.experts.{ours_of[name]}"] = stacked
        if self.args.enable_weight_tying and "tok_embeddings.weight" in out:
            out["lm_head.weight"] = out["tok_embeddings.weight"]
        return out

    def hf_config(self) -> dict[str, Any]:
        """Return the ``config.json`` contents for ``transformers``.

        See Also:
            ``transformers.Qwen3_5TextConfig``.
        """
        a = self.args
        rope: dict[str, Any] = rope_scaling_to_hf(a.rope_scaling) or {"rope_type": "default"}
        rope.update(rope_theta=a.rope_theta, partial_rotary_factor=a.partial_rotary_factor)
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "head_dim": a.head_dim,
            "vocab_size": a.vocab_size,
            "rms_norm_eps": a.norm_eps,
            "rope_parameters": rope,
            "max_position_embeddings": a.max_seq_len,
            "tie_word_embeddings": a.enable_weight_tying,
            "hidden_act": "silu",
            "attention_bias": False,
            "layer_types": list(a.layer_types or ()),
            "linear_conv_kernel_dim": a.linear_conv_kernel_dim,
            "linear_num_key_heads": a.linear_num_key_heads,
            "linear_num_value_heads": a.linear_num_value_heads,
            "linear_key_head_dim": a.linear_key_head_dim,
            "linear_value_head_dim": a.linear_value_head_dim,
            "torch_dtype": "float32",
        }


class Qwen35MoeStateDictAdapter(Qwen35StateDictAdapter):
    """HF ``Qwen3_5MoeForCausalLM`` <-> our :class:`~hp_trainer.Qwen35Moe`.

    Args:
        model_args: The model's :class:`~hp_trainer.models.qwen3_5.model.Qwen35MoeArgs`.
        hf_assets_path: Folder of HF assets; kept for reference.

    See Also:
        :titan:`torchtitan.protocols.state_dict_adapter.StateDictAdapter`.
    """

    model_type: ClassVar[str] = "qwen3_5_moe_text"
    architecture: ClassVar[str] = "Qwen3_5MoeForCausalLM"
    args_type: ClassVar[type] = Qwen35MoeArgs

    def hf_config(self) -> dict[str, Any]:
        """Return the ``config.json`` contents for ``transformers``.

        See Also:
            ``transformers.Qwen3_5MoeTextConfig``.
        """
        a: Any = self.args
        config = super().hf_config()
        del config["intermediate_size"]  # every block routes: no dense feed-forward
        config.update(
            {
                "moe_intermediate_size": a.moe_hidden_dim,
                "shared_expert_intermediate_size": a.shared_expert_hidden_dim,
                "num_experts": a.moe_args.num_experts,
                "num_experts_per_tok": a.moe_args.top_k,
                "router_aux_loss_coef": a.moe_args.aux_loss_coeff,
                "output_router_logits": False,
            }
        )
        return config
