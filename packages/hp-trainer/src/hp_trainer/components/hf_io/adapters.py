"""State-dict adapters between hp-trainer's decoders and HuggingFace checkpoints.

Our :class:`~hp_trainer.models.common.decoder.Decoder` rotates *interleaved* pairs of each head
(elements ``2i`` and ``2i + 1``, Meta's original Llama layout), HuggingFace's Llama and Qwen 3
rotate the two *halves* of each head (elements ``i`` and ``i + head_dim / 2``). Both describe the
same model once the rows of ``wq``/``wk`` (and, for Qwen 3, the per-head QK-norm scales) are
permuted inside every head; the adapters apply that permutation, rename the keys and handle tied
embeddings, so that an HF checkpoint loaded here computes the same logits as in ``transformers``.

Key mapping (``{i}`` is the block index)::

    tok_embeddings.weight                    model.embed_tokens.weight
    layers.{i}.attention.wq.weight           model.layers.{i}.self_attn.q_proj.weight  (permuted)
    layers.{i}.attention.wk.weight           model.layers.{i}.self_attn.k_proj.weight  (permuted)
    layers.{i}.attention.wv.weight           model.layers.{i}.self_attn.v_proj.weight
    layers.{i}.attention.wo.weight           model.layers.{i}.self_attn.o_proj.weight
    layers.{i}.attention.q_norm.weight       model.layers.{i}.self_attn.q_norm.weight  (permuted)
    layers.{i}.attention.k_norm.weight       model.layers.{i}.self_attn.k_norm.weight  (permuted)
    layers.{i}.feed_forward.w1.weight        model.layers.{i}.mlp.gate_proj.weight
    layers.{i}.feed_forward.w2.weight        model.layers.{i}.mlp.down_proj.weight
    layers.{i}.feed_forward.w3.weight        model.layers.{i}.mlp.up_proj.weight
    layers.{i}.attention_norm.weight         model.layers.{i}.input_layernorm.weight
    layers.{i}.ffn_norm.weight               model.layers.{i}.post_attention_layernorm.weight
    norm.weight                              model.norm.weight
    lm_head.weight                           lm_head.weight  (absent when embeddings are tied)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch.distributed.tensor import DTensor

from hp_trainer.components.hf_io.config import rope_scaling_to_hf
from hp_trainer.models.common.decoder import DecoderArgs, compute_ffn_hidden_dim

__all__ = [
    "DecoderStateDictAdapter",
    "StateDictAdapter",
    "full_tensor_of",
    "half_to_interleaved_rotary",
    "interleaved_to_half_rotary",
]

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# per-block names: ours -> HF's (the inverse is built below)
_BLOCK_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_HF_BLOCK_KEYS = {v: k for k, v in _BLOCK_KEYS.items()}
_TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_HF_TOP_KEYS = {v: k for k, v in _TOP_KEYS.items()}


def full_tensor_of(value: Any, key: str) -> torch.Tensor:
    """The whole tensor behind a state-dict value (a DTensor gathered), or a TypeError."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"state dict value {key!r} is a {type(value).__name__}, expected a tensor")
    return value


def interleaved_to_half_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the rows of each head from interleaved rotary pairs to HF's half-split layout.

    Row ``2i`` of a head becomes row ``i`` and row ``2i + 1`` becomes row ``i + head_dim / 2``.
    Works for projection weights ``(n_heads * head_dim, in)`` and per-head norm scales
    ``(head_dim,)`` (``n_heads=1``).

    Args:
        weight: The weight in our (interleaved) layout.
        n_heads: Number of heads stacked along dimension 0.

    Returns:
        A new tensor in HF's layout.

    Raises:
        ValueError: If dimension 0 is not ``n_heads`` times an even head size.

    See Also:
        ``transformers.models.llama.convert_llama_weights_to_hf``: HF's ``permute`` for Meta
        checkpoints.
    """
    rows = weight.shape[0]
    if n_heads < 1 or rows % n_heads != 0 or (rows // n_heads) % 2 != 0:
        raise ValueError(
            f"cannot split dimension 0 of size {rows} into {n_heads} heads of even size"
        )
    head_dim = rows // n_heads
    rest = weight.shape[1:]
    out = weight.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2)
    return out.reshape(weight.shape).contiguous()


def half_to_interleaved_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`interleaved_to_half_rotary`: HF's half-split rows back to pairs.

    Args:
        weight: The weight in HF's layout.
        n_heads: Number of heads stacked along dimension 0.

    Returns:
        A new tensor in our (interleaved) layout.

    Raises:
        ValueError: If dimension 0 is not ``n_heads`` times an even head size.

    See Also:
        ``transformers.models.llama.convert_llama_weights_to_hf``: HF's ``permute``.
    """
    rows = weight.shape[0]
    if n_heads < 1 or rows % n_heads != 0 or (rows // n_heads) % 2 != 0:
        raise ValueError(
            f"cannot split dimension 0 of size {rows} into {n_heads} heads of even size"
        )
    head_dim = rows // n_heads
    rest = weight.shape[1:]
    out = weight.reshape(n_heads, 2, head_dim // 2, *rest).transpose(1, 2)
    return out.reshape(weight.shape).contiguous()


class StateDictAdapter:
    """Base class of the converters between a model's state dict and a HuggingFace one.

    Args:
        model_args: The model's arguments (shapes are needed for layout changes).
        hf_assets_path: Folder of HF assets (``config.json``, tokenizer); kept for reference.

    See Also:
        :titan:`torchtitan.protocols.state_dict_adapter.StateDictAdapter`: TorchTitan's protocol.
    """

    def __init__(self, model_args: Any, hf_assets_path: str | None = None) -> None:
        self.model_args = model_args
        self.hf_assets_path = hf_assets_path

    def to_hf(self, state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Convert our state dict to HuggingFace names and layouts.

        Args:
            state_dict: Our model state dict (full tensors; DTensors are gathered, which is a
                collective every rank must join).

        Returns:
            The HuggingFace state dict.

        Raises:
            NotImplementedError: In the base class.

        See Also:
            :titan:`torchtitan.protocols.state_dict_adapter.StateDictAdapter.to_hf`.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement to_hf")

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Convert a HuggingFace state dict to our names and layouts.

        Args:
            hf_state_dict: The HuggingFace state dict.

        Returns:
            Our state dict.

        Raises:
            NotImplementedError: In the base class.

        See Also:
            :titan:`torchtitan.protocols.state_dict_adapter.StateDictAdapter.from_hf`.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement from_hf")

    def hf_config(self) -> dict[str, Any]:
        """Return the ``config.json`` contents describing the model to ``transformers``.

        Returns:
            The configuration dictionary.

        Raises:
            NotImplementedError: In the base class.

        See Also:
            ``transformers.PretrainedConfig.to_dict``: HF's configuration export.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement hf_config")


class DecoderStateDictAdapter(StateDictAdapter):
    """Adapter for the dense :class:`~hp_trainer.models.common.decoder.Decoder` (Llama, Qwen 3).

    Renames keys, permutes the rotary rows of ``wq``/``wk`` (and QK-norm scales) between our
    interleaved layout and HF's half-split layout, and drops/recreates ``lm_head.weight`` for
    tied embeddings. The conversion is exact (a permutation and copies), so a round trip gives
    back bitwise the same tensors.

    Args:
        model_args: The decoder's :class:`~hp_trainer.models.common.decoder.DecoderArgs`.
        hf_assets_path: Folder of HF assets; kept for reference.

    Raises:
        TypeError: If ``model_args`` is not a ``DecoderArgs``.

    See Also:
        :titan:`torchtitan.models.llama3.model.state_dict_adapter.Llama3StateDictAdapter`.
    """

    model_type: ClassVar[str] = "llama"
    architecture: ClassVar[str] = "LlamaForCausalLM"

    def __init__(self, model_args: DecoderArgs, hf_assets_path: str | None = None) -> None:
        if not isinstance(model_args, DecoderArgs):
            raise TypeError(
                f"{type(self).__name__} needs DecoderArgs, got {type(model_args).__name__}"
            )
        super().__init__(model_args, hf_assets_path)
        self.args: DecoderArgs = model_args

    def _heads(self, block_key: str) -> int | None:
        """Heads along dim 0 of a rotary-permuted weight (None: no permutation)."""
        args = self.args
        if block_key == "attention.wq.weight":
            return args.n_heads
        if block_key == "attention.wk.weight":
            return args.n_kv_heads
        if block_key in ("attention.q_norm.weight", "attention.k_norm.weight"):
            return 1
        return None

    def hf_source(self, key: str) -> tuple[str, int | None]:
        """Where one of our tensors is stored in a HuggingFace checkpoint.

        Lets a sharded import read only the rows a rank owns: rotary-permuted rows move only
        inside their head, so a range of whole heads converts on its own.

        Args:
            key: Our state-dict key.

        Returns:
            The HF tensor name and the heads stacked along dimension 0 whose rows are
            permuted (``None``: stored as is). A tied ``lm_head.weight`` reads the embedding.

        Raises:
            KeyError: For a key this adapter does not know.

        See Also:
            :titan:`torchtitan.protocols.state_dict_adapter.StateDictAdapter.fqn_to_index_mapping`.
        """
        if key in _TOP_KEYS:
            if key == "lm_head.weight" and self.args.enable_weight_tying:
                return _TOP_KEYS["tok_embeddings.weight"], None
            return _TOP_KEYS[key], None
        m = _LAYER.match(key)
        if m is None or m.group(2) not in _BLOCK_KEYS:
            raise KeyError(f"{type(self).__name__}: no HuggingFace name for {key!r}")
        return f"model.layers.{m.group(1)}.{_BLOCK_KEYS[m.group(2)]}", self._heads(m.group(2))

    def to_hf(self, state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Convert our state dict to HuggingFace names and layouts.

        Args:
            state_dict: Our model state dict (plain tensors; DTensors are gathered with
                ``full_tensor``, a collective every rank must join in the same order).

        Returns:
            The HuggingFace state dict (new tensors where rows were permuted, else the same
            tensors).

        Raises:
            KeyError: For a key this adapter does not know.
            TypeError: For a value that is not a tensor.

        See Also:
            :titan:`torchtitan.models.llama3.model.state_dict_adapter.Llama3StateDictAdapter.to_hf`.
        """
        out: dict[str, torch.Tensor] = {}
        for key in state_dict:
            value = full_tensor_of(state_dict[key], key)
            if key in _TOP_KEYS:
                if key == "lm_head.weight" and self.args.enable_weight_tying:
                    continue  # HF stores tied embeddings once (tie_word_embeddings=True)
                out[_TOP_KEYS[key]] = value
                continue
            m = _LAYER.match(key)
            if m is None or m.group(2) not in _BLOCK_KEYS:
                raise KeyError(f"{type(self).__name__}.to_hf: no HuggingFace name for {key!r}")
            block, rest = m.group(1), m.group(2)
            heads = self._heads(rest)
            if heads is not None:
                value = interleaved_to_half_rotary(value, heads)
            out[f"model.layers.{block}.{_BLOCK_KEYS[rest]}"] = value
        return out

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Convert a HuggingFace state dict to our names and layouts.

        Rotary embedding buffers (``rotary_emb.inv_freq``) stored by old ``transformers``
        versions are dropped: the decoder recomputes its table. With tied embeddings,
        ``lm_head.weight`` is the embedding matrix.

        Args:
            hf_state_dict: The HuggingFace state dict.

        Returns:
            Our state dict.

        Raises:
            KeyError: For a key this adapter does not know.

        See Also:
            :titan:`torchtitan.models.llama3.model.state_dict_adapter.Llama3StateDictAdapter.from_hf`.
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
            if m is None or m.group(2) not in _HF_BLOCK_KEYS:
                raise KeyError(f"{type(self).__name__}.from_hf: no native name for {key!r}")
            block, rest = m.group(1), _HF_BLOCK_KEYS[m.group(2)]
            heads = self._heads(rest)
            if heads is not None:
                value = half_to_interleaved_rotary(value, heads)
            out[f"layers.{block}.{rest}"] = value
        if self.args.enable_weight_tying and "tok_embeddings.weight" in out:
            out["lm_head.weight"] = out["tok_embeddings.weight"]
        return out

    def hf_config(self) -> dict[str, Any]:
        """Return the ``config.json`` contents for ``transformers``.

        Returns:
            The configuration dictionary (``architectures``, ``model_type``, sizes, RoPE base
            and scaling, norm epsilon, tying).

        See Also:
            ``transformers.LlamaConfig``: HF's Llama configuration.
        """
        args = self.args
        hidden = args.ffn_hidden_dim
        if hidden is None:
            hidden = compute_ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier)
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_size": args.dim,
            "intermediate_size": hidden,
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
            "torch_dtype": "float32",
        }
