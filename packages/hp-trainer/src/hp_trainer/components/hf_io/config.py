"""HuggingFace ``config.json`` <-> :class:`~hp_trainer.models.common.decoder.DecoderArgs`.

An HF checkpoint says what model it holds in its ``config.json``. On import, hp-trainer either
builds the model arguments from it (``--model.flavor auto``) or checks the chosen flavor
against it and names every field that differs, so that a Llama 3.1 checkpoint can never be
loaded silently into a flavor without its RoPE scaling. The export writes the same fields back
(:meth:`~hp_trainer.DecoderStateDictAdapter.hf_config`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hp_trainer.models.common.decoder import (
    DecoderArgs,
    RopeScaling,
    YarnRopeScaling,
    compute_ffn_hidden_dim,
)

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig
    from hp_trainer.protocols.model_spec import ModelSpec

__all__ = [
    "AUTO_FLAVOR",
    "AUTO_MODEL_TYPES",
    "decoder_args_from_hf_config",
    "dense_fields_from_hf_config",
    "hf_config_mismatches",
    "model_args_from_hf_config",
    "read_hf_config",
    "require_hf_field",
    "resolve_model_args",
    "rope_scaling_from_hf",
    "rope_scaling_to_hf",
]

AUTO_FLAVOR = "auto"
"""``--model.flavor auto``: take the model arguments from the HF checkpoint's config.json."""

# HF model_type -> whether the decoder uses per-head QK-norm
_QK_NORM = {"llama": False, "qwen3": True}

AUTO_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
}
"""The HF ``model_type`` values (and architectures) ``--model.flavor auto`` builds."""


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """Read the ``config.json`` of an HF checkpoint folder (or the file itself).

    Args:
        path: The checkpoint folder or its ``config.json``.

    Returns:
        The parsed configuration.

    Raises:
        FileNotFoundError: If there is no ``config.json``.
        ValueError: If it is not a JSON object.

    See Also:
        ``transformers.AutoConfig.from_pretrained``: HF's reader.
    """
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"no HuggingFace config.json at {file}")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(config).__name__}")
    return config


def _rope_theta(config: Mapping[str, Any]) -> float:
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(config.get("rope_theta", 10000.0))


def rope_scaling_from_hf(config: Mapping[str, Any]) -> RopeScaling | YarnRopeScaling | None:
    """The RoPE scaling an HF config asks for (``rope_scaling``, or ``rope_parameters``).

    Args:
        config: The HF configuration.

    Returns:
        The scaling, or None for plain RoPE.

    Raises:
        ValueError: For a rope type other than ``default``, ``llama3`` and ``yarn``.

    See Also:
        ``transformers.modeling_rope_utils``: HF's rope types.
    """
    scaling = config.get("rope_scaling") or config.get("rope_parameters")
    if not isinstance(scaling, Mapping):
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind == "yarn":
        return _yarn_from_hf(scaling, config)
    if kind != "llama3":
        raise ValueError(
            f"rope type {kind!r} is not supported (hp-trainer implements 'default', 'llama3' "
            "and 'yarn')"
        )
    return RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _yarn_from_hf(scaling: Mapping[str, Any], config: Mapping[str, Any]) -> YarnRopeScaling:
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    if factor is None:  # HF's rule: the ratio of the context lengths
        factor = float(config["max_position_embeddings"]) / original

    def optional(key: str) -> float | None:
        value = scaling.get(key)
        return None if value is None else float(value)

    return YarnRopeScaling(
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        attention_factor=optional("attention_factor"),
        truncate=bool(scaling.get("truncate", True)),
    )


def rope_scaling_to_hf(scaling: RopeScaling | YarnRopeScaling | None) -> dict[str, Any] | None:
    """The ``rope_scaling`` entry of ``config.json`` for ``scaling``.

    Args:
        scaling: The scaling (None: plain RoPE).

    Returns:
        HF's dictionary (``rope_type: "llama3"`` or ``"yarn"``), or None.

    See Also:
        ``transformers.LlamaConfig``: ``rope_scaling``.
    """
    if scaling is None:
        return None
    if isinstance(scaling, YarnRopeScaling):
        out: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": scaling.factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
            "beta_fast": scaling.beta_fast,
            "beta_slow": scaling.beta_slow,
            "truncate": scaling.truncate,
        }
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(scaling, key) is not None:
                out[key] = getattr(scaling, key)
        return out
    return {
        "rope_type": "llama3",
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }


def decoder_args_from_hf_config(config: Mapping[str, Any], *, source: str = "") -> DecoderArgs:
    """Build decoder arguments from an HF Llama or Qwen 3 ``config.json``.

    Args:
        config: The HF configuration.
        source: Keyword-only; where it came from, for error messages.

    Returns:
        The arguments of the same model.

    Raises:
        ValueError: For a model type, activation, bias or rope type the decoder does not have,
            or a missing size.

    See Also:
        :titan:`torchtitan.protocols.state_dict_adapter`: TorchTitan reads the HF assets likewise.
    """
    where = f" in {source}" if source else ""
    model_type = config.get("model_type")
    if model_type not in _QK_NORM:
        raise ValueError(
            f"model_type {model_type!r}{where} is not supported: expected one of "
            + ", ".join(repr(t) for t in _QK_NORM)
        )
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r}{where}: the decoder uses 'silu'")
    if config.get("attention_bias", False) or config.get("mlp_bias", False):
        raise ValueError(f"attention_bias/mlp_bias{where}: the decoder has no biases")
    try:
        heads = int(config["num_attention_heads"])
        dim = int(config["hidden_size"])
        return DecoderArgs(
            dim=dim,
            n_layers=int(config["num_hidden_layers"]),
            n_heads=heads,
            n_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or dim // heads),
            vocab_size=int(config["vocab_size"]),
            ffn_hidden_dim=int(config["intermediate_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(config),
            rope_scaling=rope_scaling_from_hf(config),
            max_seq_len=int(config.get("max_position_embeddings", 2048)),
            qk_norm=_QK_NORM[model_type],
            enable_weight_tying=bool(config.get("tie_word_embeddings", False)),
        )
    except KeyError as exc:
        raise ValueError(f"{exc.args[0]!r} is missing{where}") from None


def require_hf_field(config: Mapping[str, Any], key: str, where: str) -> Any:
    """``config[key]``, or a ValueError naming the missing key and ``where`` it was read."""
    if key not in config or config[key] is None:
        raise ValueError(f"{key!r} is missing{where}")
    return config[key]


def dense_fields_from_hf_config(
    config: Mapping[str, Any], model_type: str, source: str
) -> dict[str, Any]:
    """The dense decoder's fields of an HF config read as ``model_type`` (for MoE families)."""
    dense = decoder_args_from_hf_config({**config, "model_type": model_type}, source=source)
    return {f.name: getattr(dense, f.name) for f in dataclasses.fields(dense)}


def model_args_from_hf_config(config: Mapping[str, Any], *, source: str = "") -> Any:
    """Build the model arguments of any ``model_type`` in ``AUTO_MODEL_TYPES``.

    Dense Llama / Qwen 3 give :class:`~hp_trainer.models.common.decoder.DecoderArgs`
    (``decoder_args_from_hf_config``); Qwen 3 MoE gives ``MoEDecoderArgs`` and DeepSeek-V3
    ``DeepSeekV3Args``, with the family's routing (softmax top-k for Qwen 3 MoE; sigmoid,
    group-limited, bias-corrected for DeepSeek-V3) and every size, expert count and routing
    option that ``config.json`` states. Training-only options (the routing-bias update rate)
    keep the family's flavor values.

    Args:
        config: The HF configuration.
        source: Keyword-only; where it came from, for error messages.

    Returns:
        The arguments of the same model.

    Raises:
        ValueError: For a model type not in ``AUTO_MODEL_TYPES`` (naming its
            ``architectures`` and the supported ones), or a size or option the model lacks.

    See Also:
        ``transformers.AutoConfig``: HF's dispatch on ``model_type``.
    """
    from hp_trainer.protocols.model_spec import get_model_spec, list_model_specs

    model_type = config.get("model_type")
    if model_type in _QK_NORM:
        return decoder_args_from_hf_config(config, source=source)
    for name in list_model_specs():
        spec = get_model_spec(name)
        if (
            getattr(spec.state_dict_adapter, "model_type", None) == model_type
            and spec.args_from_hf_config is not None
        ):
            return spec.args_from_hf_config(config, source)
    where = f" in {source}" if source else ""
    raise ValueError(
        f"config.json{where} describes architectures {config.get('architectures')!r} "
        f"(model_type {model_type!r}), which --model.flavor auto cannot build; supported: "
        + ", ".join(f"{t} ({a})" for t, a in AUTO_MODEL_TYPES.items())
    )


def _ffn_hidden(args: DecoderArgs) -> int:
    if args.ffn_hidden_dim is not None:
        return args.ffn_hidden_dim
    return compute_ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier)


def _moe_mismatches(args: Any, config: Mapping[str, Any]) -> list[str]:
    """MoE flavors: the arguments ``config.json`` builds, compared field by field."""
    ours_type = getattr(type(args), "hf_model_type", "qwen3_moe")
    if config.get("model_type") != ours_type:
        return [
            f"model_type: flavor has {ours_type!r}, config.json has {config.get('model_type')!r}"
        ]
    try:
        theirs = model_args_from_hf_config(config)
    except ValueError as exc:
        return [str(exc)]
    out = []
    for f in dataclasses.fields(args):
        if not f.compare:  # how to compute, not which model (e.g. a kernel's chunk size)
            continue
        ours_value, theirs_value = getattr(args, f.name), getattr(theirs, f.name)
        if f.name == "moe_args" and dataclasses.is_dataclass(ours_value):
            for g in dataclasses.fields(ours_value):
                a, b = getattr(ours_value, g.name), getattr(theirs_value, g.name)
                if a != b:
                    out.append(f"moe_args.{g.name}: flavor has {a!r}, config.json has {b!r}")
        elif ours_value != theirs_value:
            out.append(f"{f.name}: flavor has {ours_value!r}, config.json has {theirs_value!r}")
    return out


def hf_config_mismatches(args: DecoderArgs, config: Mapping[str, Any]) -> list[str]:
    """Every field where ``args`` and an HF ``config.json`` describe different models.

    Args:
        args: The flavor's arguments.
        config: The HF configuration.

    Returns:
        ``"field: flavor has X, config.json has Y"`` lines (empty when they agree).

    See Also:
        ``transformers.PretrainedConfig``: the fields compared.
    """
    if hasattr(args, "moe_args") or hasattr(type(args), "hf_model_type"):
        return _moe_mismatches(args, config)  # families with their own args: field by field
    heads = config.get("num_attention_heads")
    hidden = config.get("hidden_size")
    try:
        theirs_scaling: Any = rope_scaling_from_hf(config)
    except ValueError as exc:
        theirs_scaling = str(exc)
    default_head = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) else None
    pairs: list[tuple[str, Any, Any]] = [
        ("model_type", "qwen3" if args.qk_norm else "llama", config.get("model_type")),
        ("hidden_size", args.dim, hidden),
        ("num_hidden_layers", args.n_layers, config.get("num_hidden_layers")),
        ("num_attention_heads", args.n_heads, heads),
        ("num_key_value_heads", args.n_kv_heads, config.get("num_key_value_heads") or heads),
        ("head_dim", args.head_dim, config.get("head_dim") or default_head),
        ("intermediate_size", _ffn_hidden(args), config.get("intermediate_size")),
        ("vocab_size", args.vocab_size, config.get("vocab_size")),
        ("rms_norm_eps", args.norm_eps, config.get("rms_norm_eps")),
        ("rope_theta", args.rope_theta, _rope_theta(config)),
        ("rope_scaling", args.rope_scaling, theirs_scaling),
        ("max_position_embeddings", args.max_seq_len, config.get("max_position_embeddings")),
        ("tie_word_embeddings", args.enable_weight_tying, config.get("tie_word_embeddings", False)),
    ]
    out = []
    for name, ours, theirs in pairs:
        same = ours == theirs
        if isinstance(ours, float) and isinstance(theirs, int | float):
            same = math.isclose(ours, float(theirs), rel_tol=1e-9)
        if not same:
            out.append(f"{name}: flavor has {ours!r}, config.json has {theirs!r}")
    return out


def resolve_model_args(spec: ModelSpec, job_config: JobConfig) -> Any:
    """The model arguments of a job: its flavor, checked against the HF checkpoint it loads.

    With ``--model.flavor auto`` the arguments come from the ``config.json`` of
    ``checkpoint.initial_load_path`` (``checkpoint.initial_load_in_hf`` set), dense or MoE
    (:func:`~hp_trainer.components.hf_io.config.model_args_from_hf_config`). With a named
    flavor and such a checkpoint, the flavor must describe the same model. In both cases the
    sequence length must fit the model's ``max_seq_len``.

    Args:
        spec: The model spec (``model.name``).
        job_config: The configuration.

    Returns:
        The model arguments (a fresh copy).

    Raises:
        ValueError: ``auto`` without an HF checkpoint, or with a config.json whose
            ``model_type`` is not in ``AUTO_MODEL_TYPES`` or not ``model.name``'s (naming
            its ``architectures``); a flavor that differs from the checkpoint's config.json
            (naming every field); ``training.seq_len`` over the model's maximum;
            ``moe.aux_loss_type`` set for a model without MoE layers.
        FileNotFoundError: ``auto`` and the checkpoint has no config.json.

    See Also:
        :titan:`torchtitan.train.Trainer`: TorchTitan takes the flavor as given.
    """
    ckpt = job_config.checkpoint
    hf_path = ckpt.initial_load_path if ckpt.initial_load_in_hf else None
    flavor = job_config.model.flavor
    expected_type = getattr(spec.state_dict_adapter, "model_type", None)
    if flavor == AUTO_FLAVOR:
        if hf_path is None:
            raise ValueError(
                "model.flavor = 'auto' builds the model from the config.json of a HuggingFace "
                "checkpoint: set checkpoint.initial_load_path to its folder and "
                "checkpoint.initial_load_in_hf = true"
            )
        config = read_hf_config(hf_path)
        args: Any = model_args_from_hf_config(config, source=str(Path(hf_path)))
        if config.get("model_type") != expected_type:
            from hp_trainer.protocols.model_spec import get_model_spec, list_model_specs

            fits = [
                name
                for name in list_model_specs()
                if getattr(get_model_spec(name).state_dict_adapter, "model_type", None)
                == config.get("model_type")
            ]
            raise ValueError(
                f"{Path(hf_path) / 'config.json'} holds a {config.get('model_type')!r} model "
                f"({config.get('architectures')!r}), not model.name = {spec.name!r} "
                f"(model_type {expected_type!r})"
                + (f": use --model.name {fits[0]}" if fits else "")
            )
    else:
        args = spec.model_args(flavor)
        if hf_path is not None and (Path(hf_path) / "config.json").is_file():
            config = read_hf_config(hf_path)
            mismatches = hf_config_mismatches(args, config)
            if mismatches:
                raise ValueError(
                    f"model {spec.name}/{flavor} does not describe the checkpoint in {hf_path} "
                    "(use --model.flavor auto to build it from config.json):\n  "
                    + "\n  ".join(mismatches)
                )
    if hasattr(args, "attn_backend"):
        args = dataclasses.replace(args, attn_backend=job_config.model.attn_backend)
    aux_loss_type = job_config.moe.aux_loss_type
    if aux_loss_type != "model":
        moe_args = getattr(args, "moe_args", None)
        if moe_args is None:
            raise ValueError(
                f"moe.aux_loss_type = {aux_loss_type!r} with model {spec.name}, which has no "
                "mixture-of-experts layers: expected moe.aux_loss_type = 'model'"
            )
        args = dataclasses.replace(
            args, moe_args=dataclasses.replace(moe_args, aux_loss_type=aux_loss_type)
        )
    if job_config.moe.fused:
        moe_args = getattr(args, "moe_args", None)
        if moe_args is None:
            raise ValueError(
                f"moe.fused = true with model {spec.name}, which has no mixture-of-experts "
                "layers: expected moe.fused = false"
            )
        args = dataclasses.replace(args, moe_args=dataclasses.replace(moe_args, fused=True))
    seq_len = job_config.training.seq_len
    max_seq_len = getattr(args, "max_seq_len", seq_len)
    if seq_len > max_seq_len:
        raise ValueError(
            f"training.seq_len = {seq_len} is over the maximum sequence length {max_seq_len} "
            f"of model {spec.name}/{flavor}"
        )
    return args
