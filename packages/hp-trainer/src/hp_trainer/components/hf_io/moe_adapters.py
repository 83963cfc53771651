"""The state-dict adapter base of the MoE families (their classes live in each family's folder).

Routed experts are one 3-D tensor per weight here (``moe.experts.w1`` is ``[E, hidden, dim]``)
and one matrix per expert in HuggingFace checkpoints (``mlp.experts.{j}.gate_proj.weight``, the
layout of the published files, which ``transformers`` fuses on load). Per-block key mapping on
top of :class:`~hp_trainer.components.hf_io.adapters.DecoderStateDictAdapter`'s::

    moe.router.gate.weight           mlp.gate.weight
    moe.expert_bias                  mlp.gate.e_score_correction_bias   (DeepSeek-V3)
    moe.experts.w1[j]                mlp.experts.{j}.gate_proj.weight
    moe.experts.w2[j]                mlp.experts.{j}.down_proj.weight
    moe.experts.w3[j]                mlp.experts.{j}.up_proj.weight
    moe.shared_experts.w1/w2/w3      mlp.shared_experts.gate_proj/down_proj/up_proj.weight
    attention.wq / wq_a / q_norm / wq_b / wkv_a / kv_norm / wkv_b / wo  (DeepSeek-V3)
                                     self_attn.q_proj / q_a_proj / q_a_layernorm / q_b_proj /
                                     kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj / o_proj
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from hp_trainer.components.hf_io.adapters import DecoderStateDictAdapter, full_tensor_of

__all__ = ["MoEStateDictAdapter"]

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.weight$")
_EXPERT_WEIGHTS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_HF_EXPERT_WEIGHTS = {v: k for k, v in _EXPERT_WEIGHTS.items()}
_MOE_KEYS = {
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}


class MoEStateDictAdapter(DecoderStateDictAdapter):
    """Adds the MoE keys (router, bias, stacked experts, shared experts) to the dense adapter.

    The conversion is exact (renames, slicing and stacking), so a round trip gives back the
    same tensors.

    Args:
        model_args: The model's :class:`~hp_trainer.models.common.moe_decoder.MoEDecoderArgs`.
        hf_assets_path: Folder of HF assets; kept for reference.

    See Also:
        :titan:`torchtitan.models.qwen3.model.state_dict_adapter.Qwen3StateDictAdapter` (MoE keys).
    """

    extra_block_keys: ClassVar[dict[str, str]] = {}
    """Family-specific per-block names, ours -> HF's, converted without permutation."""

    def _block_to_hf(self, rest: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """HF entries of one of our per-block keys, or None when the dense adapter handles it."""
        if rest in self.extra_block_keys:
            return {self.extra_block_keys[rest]: value}
        if rest in _MOE_KEYS:
            return {_MOE_KEYS[rest]: value}
        if rest.startswith("moe.experts.") and rest[len("moe.experts.") :] in _EXPERT_WEIGHTS:
            hf_name = _EXPERT_WEIGHTS[rest[len("moe.experts.") :]]
            return {
                f"mlp.experts.{j}.{hf_name}.weight": value[j].clone() for j in range(value.shape[0])
            }
        return None

    def hf_source(self, key: str) -> tuple[str, int | None]:
        """Where one of our tensors is stored in a HuggingFace checkpoint.

        Args:
            key: Our state-dict key (not a stacked expert weight: see
                :meth:`hf_stacked_sources`).

        Returns:
            The HF tensor name and the heads whose rotary rows are permuted (``None``: none).

        Raises:
            KeyError: For a stacked expert weight or a key this adapter does not know.

        See Also:
            :titan:`torchtitan.protocols.state_dict_adapter.StateDictAdapter.fqn_to_index_mapping`.
        """
        m = _LAYER.match(key)
        if m is not None:
            rest = m.group(2)
            if rest in self.extra_block_keys:
                return f"model.layers.{m.group(1)}.{self.extra_block_keys[rest]}", None
            if rest in _MOE_KEYS:
                return f"model.layers.{m.group(1)}.{_MOE_KEYS[rest]}", None
            if self.hf_stacked_sources(key) is not None:
                raise KeyError(f"{key!r} stacks HF tensors: see hf_stacked_sources")
        return super().hf_source(key)

    def hf_stacked_sources(self, key: str) -> tuple[str, ...] | None:
        """The HF tensors stacked along dimension 0 into one of our expert weights.

        Args:
            key: Our state-dict key.

        Returns:
            One HF name per expert, in order, for ``layers.{i}.moe.experts.w1/w2/w3``; None for
            every other key.

        See Also:
            :titan:`torchtitan.models.deepseek_v3.model.state_dict_adapter.DeepSeekV3StateDictAdapter`.
        """
        m = _LAYER.match(key)
        if m is None or not m.group(2).startswith("moe.experts."):
            return None
        weight = _EXPERT_WEIGHTS.get(m.group(2)[len("moe.experts.") :])
        if weight is None:
            return None
        experts: int = self.args.moe_args.num_experts  # type: ignore[attr-defined]
        return tuple(
            f"model.layers.{m.group(1)}.mlp.experts.{j}.{weight}.weight" for j in range(experts)
        )

    def to_hf(self, state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Convert our state dict to HuggingFace names (one matrix per expert).

        Args:
            state_dict: Our model state dict (DTensors are gathered: a collective).

        Returns:
            The HuggingFace state dict.

        Raises:
            KeyError: For a key this adapter does not know.

        See Also:
            :titan:`torchtitan.models.deepseek_v3.model.state_dict_adapter.DeepSeekV3StateDictAdapter`.
        """
        out: dict[str, torch.Tensor] = {}
        dense: dict[str, Any] = {}
        for key, value in state_dict.items():
            m = _LAYER.match(key)
            converted = None
            if m is not None:
                converted = self._block_to_hf(m.group(2), full_tensor_of(value, key))
            if converted is None:
                dense[key] = value
                continue
            out.update({f"model.layers.{m.group(1)}.{k}": v for k, v in converted.items()})  # type: ignore[union-attr]
        out.update(super().to_hf(dense))
        return out

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Convert a HuggingFace state dict to ours (per-expert matrices stacked).

        Args:
            hf_state_dict: The HuggingFace state dict.

        Returns:
            Our state dict.

        Raises:
            KeyError: For a key this adapter does not know, or missing experts.

        See Also:
            :titan:`torchtitan.models.deepseek_v3.model.state_dict_adapter.DeepSeekV3StateDictAdapter`.
        """
        hf_extra = {v: k for k, v in self.extra_block_keys.items()}
        hf_moe = {v: k for k, v in _MOE_KEYS.items()}
        out: dict[str, torch.Tensor] = {}
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        dense: dict[str, torch.Tensor] = {}
        for key, value in hf_state_dict.items():
            m = _HF_LAYER.match(key)
            if m is None:
                dense[key] = value
                continue
            block, rest = m.group(1), m.group(2)
            if rest in hf_extra:
                out[f"layers.{block}.{hf_extra[rest]}"] = value
            elif rest in hf_moe:
                out[f"layers.{block}.{hf_moe[rest]}"] = value
            elif (e := _HF_EXPERT.match(rest)) is not None:
                name = _HF_EXPERT_WEIGHTS[e.group(2)]
                experts.setdefault((block, name), {})[int(e.group(1))] = value
            else:
                dense[key] = value
        for (block, name), by_index in experts.items():
            count = len(by_index)
            if sorted(by_index) != list(range(count)):
                raise KeyError(
                    f"{type(self).__name__}.from_hf: layer {block} has experts "
                    f"{sorted(by_index)} for {_EXPERT_WEIGHTS[name]}, expected 0..{count - 1}"
                )
            out[f"layers.{block}.moe.experts.{name}"] = torch.stack(
                [by_index[j] for j in range(count)]
            )
        out.update(super().from_hf(dense))
        return out

    def _moe_hf_config(self) -> dict[str, Any]:
        args: Any = self.args
        return {
            "moe_intermediate_size": args.moe_hidden_dim,
            "num_experts_per_tok": args.moe_args.top_k,
            "norm_topk_prob": args.moe_args.route_norm,
            "output_router_logits": False,
        }
