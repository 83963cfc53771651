"""LoRA fine-tuning: frozen base weights, trainable low-rank adapters (``--model.converters lora``).

Each targeted ``nn.Linear`` (``y = W x``) computes ``W x + (alpha / rank) * B A dropout(x)``.
``A`` (``rank x in``) starts Kaiming-uniform and ``B`` (``out x rank``) at zero, as PEFT does,
so the converted model computes exactly what the base model does until the first step. Every
parameter of the model is frozen except the adapters.

Layout of the adapters. The adapter of ``<parent>.<name>`` is the sibling module
``<parent>.<name>_lora`` (holding ``lora_a`` and ``lora_b``): base FQNs stay unchanged (base
checkpoints, HF adapters and tensor-parallel tables keep working), the adapter lives in the
same transformer block as its base linear, so FSDP puts frozen and trainable parameters in the
same unit, and a pipeline split keeps each adapter with its base. The base linear's class is
swapped for a subclass whose forward adds the adapter's output. Under tensor parallel the
adapter follows its base weight when the TP plan distributes it: a column-wise base
(``Shard(0)``) gets ``A`` replicated and ``B`` column-wise (``Shard(0)``), a row-wise base
(``Shard(1)``) gets ``A`` row-wise (``Shard(1)``) and ``B`` replicated, so the adapter's output
has the base output's placement and the TP styles' output hooks lay out the sum.

Checkpoints (``lora.save_adapter_only``) hold only the adapters and the ``lora`` state
(rank, alpha, targets: a checkpoint of another rank or alpha is refused on load); the HF
export of the last step is the merged model, and the adapters are also written in PEFT's format
(``adapter_config.json`` + ``adapter_model.safetensors``).

See Also:
    :titan:`torchtitan.components.lora.LoRAConverter`; PEFT's ``LoraConfig`` and
    ``get_peft_model`` (the initialisation and file format followed here).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from hp_trainer.components.metrics import logger

if TYPE_CHECKING:
    from hp_trainer.config import JobConfig, LoRAConfig
    from hp_trainer.distributed.parallel_dims import ParallelDims

__all__ = [
    "LORA_SUFFIX",
    "LoRAAdapter",
    "LoRAConverter",
    "apply_lora",
    "is_lora_key",
    "merge_lora_state_dict",
    "peft_adapter_state_dict",
    "save_peft_adapter",
]

LORA_SUFFIX = "_lora"
"""The adapter of ``<parent>.<name>`` is the module ``<parent>.<name>_lora``."""

_LORA_KEY = re.compile(rf"{LORA_SUFFIX}\.lora_[ab]\.weight$")
_ATTR = "_hp_lora_adapter"


def is_lora_key(key: str) -> bool:
    """Whether a state-dict key is an adapter weight (``..._lora.lora_a.weight`` / ``lora_b``).

    Args:
        key: A model state-dict key.

    Returns:
        True for the adapters' keys.
    """
    return _LORA_KEY.search(key) is not None


class LoRAAdapter(nn.Module):
    """The trainable low-rank update of one linear layer: ``scaling * B A dropout(x)``.

    Args:
        in_features: The base linear's input features.
        out_features: The base linear's output features.
        rank: The adapter rank ``r``.
        alpha: The scaling numerator (``scaling = alpha / rank``).
        dropout: Dropout probability on the input (0: none).
        device: Device of the new parameters.
        dtype: Dtype of the new parameters.

    See Also:
        PEFT's ``peft.tuners.lora.layer.Linear``: the same update (its ``lora_A``/``lora_B``
        are our ``lora_a``/``lora_b``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        *,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.rank = rank
        self.alpha = alpha
        self.scaling = alpha / rank
        self.dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_a = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_b = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``A`` Kaiming-uniform (``a = sqrt(5)``, as ``nn.Linear`` and PEFT), ``B`` zero."""
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update ``scaling * B A dropout(x)``."""
        update: torch.Tensor = self.lora_b(self.lora_a(self.dropout(x)))
        return update * self.scaling

    def follow_tensor_parallel(self, weight: DTensor) -> None:
        """Distribute ``A`` and ``B`` over the base weight's TP mesh, consistently with it.

        Args:
            weight: The base linear's weight, just distributed by a TP style.

        Raises:
            ValueError: For a base placement other than ``Shard(0)``, ``Shard(1)``,
                ``Replicate()``.
        """
        mesh = weight.device_mesh
        (placement,) = weight.placements
        a_pl: Placement
        b_pl: Placement
        if placement == Shard(0):  # column-wise base: output features sharded
            a_pl, b_pl = Replicate(), Shard(0)
        elif placement == Shard(1):  # row-wise base: input features sharded, partial output
            a_pl, b_pl = Shard(1), Replicate()
        elif placement == Replicate():
            a_pl, b_pl = Replicate(), Replicate()
        else:
            raise ValueError(
                f"LoRA under tensor parallel: the base weight's placement {placement} is not "
                "supported (expected Shard(0), Shard(1) or Replicate())"
            )
        for linear, pl in ((self.lora_a, a_pl), (self.lora_b, b_pl)):
            param = linear.weight
            if isinstance(param, DTensor):
                continue
            # every rank holds the same (seeded) values: no broadcast needed
            dt = distribute_tensor(param.data, mesh, (pl,), src_data_rank=None)
            linear.register_parameter("weight", nn.Parameter(dt, requires_grad=param.requires_grad))


class _LoRALinearMixin:
    """Forward of a base linear with an adapter; TP distribution of its weight is followed."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = super().forward(input)  # type: ignore[misc]
        update: torch.Tensor = self.__dict__[_ATTR](input)
        return out + update

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        super().register_parameter(name, param)  # type: ignore[misc]
        adapter = self.__dict__.get(_ATTR)
        tp_key = self.__dict__.get("_hp_lora_tp_mesh")
        if (
            name == "weight"
            and adapter is not None
            and tp_key is not None
            and isinstance(param, DTensor)
            and _mesh_key(param.device_mesh) == tp_key
        ):
            adapter.follow_tensor_parallel(param)


_LORA_CLASSES: dict[type, type] = {}


def _lora_class(cls: type) -> type:
    if cls not in _LORA_CLASSES:
        _LORA_CLASSES[cls] = type(f"LoRA{cls.__name__}", (_LoRALinearMixin, cls), {})
    return _LORA_CLASSES[cls]


def _mesh_key(mesh: Any) -> tuple[Any, ...]:
    return (tuple(mesh.mesh.flatten().tolist()), mesh.mesh_dim_names)


def _pattern_of(fqn: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", fqn)


def _targets(model: nn.Module, names: list[str]) -> list[str]:
    linears = [
        fqn
        for fqn, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and not isinstance(mod, _LoRALinearMixin) and fqn
    ]
    chosen: list[str] = []
    for name in names:
        hits = [f for f in linears if f == name or f.endswith("." + name)]
        if not hits:
            available = sorted(dict.fromkeys(_pattern_of(f) for f in linears))
            raise ValueError(
                f"invalid config value lora.target_modules: {name!r} matches no linear layer of "
                f"{type(model).__name__}; its linear layers are {', '.join(available)}"
            )
        chosen.extend(h for h in hits if h not in chosen)
    return [f for f in linears if f in chosen]  # model order


def apply_lora(
    model: nn.Module,
    target_modules: list[str],
    *,
    rank: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    tp_mesh: Any = None,
) -> list[str]:
    """Add LoRA adapters to the targeted linear layers and freeze everything else (in place).

    Args:
        model: The model (on meta, the adapters are created on meta too: initialise them with
            ``LoRAConverter.init_weights`` once the model has storage).
        target_modules: Names; a name matches a linear layer whose FQN equals it or ends with
            ``.name``.
        rank: Keyword-only; adapter rank.
        alpha: Keyword-only; scaling numerator.
        dropout: Keyword-only; dropout on the adapter input.
        tp_mesh: Keyword-only; the tensor-parallel mesh the model will be sharded over (None:
            no TP): adapters follow their base weight onto it.

    Returns:
        The FQNs of the adapted linear layers.

    Raises:
        ValueError: A name matching no linear layer (the linear layers are listed), a parent
            that is a container (``ModuleList``/``ModuleDict``/``Sequential``), or a model that
            already has adapters.

    See Also:
        PEFT's ``get_peft_model``; :titan:`torchtitan.components.lora.LoRAConverter.convert`.
    """
    if any(isinstance(m, _LoRALinearMixin) for m in model.modules()):
        raise ValueError("the model already has LoRA adapters: convert it once")
    targets = _targets(model, target_modules)
    tp_key = _mesh_key(tp_mesh) if tp_mesh is not None else None
    for p in model.parameters():
        p.requires_grad_(False)
    for fqn in targets:
        parent_name, _, leaf = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(parent, nn.ModuleList | nn.ModuleDict | nn.Sequential):
            raise ValueError(
                f"LoRA target {fqn!r} sits in a {type(parent).__name__}: its adapter cannot be "
                "a sibling there; target linear layers held by a regular module"
            )
        base = parent.get_submodule(leaf)
        assert isinstance(base, nn.Linear)
        adapter = LoRAAdapter(
            base.in_features,
            base.out_features,
            rank,
            alpha,
            dropout,
            device=base.weight.device,
            dtype=base.weight.dtype,
        )
        parent.add_module(leaf + LORA_SUFFIX, adapter)
        base.__class__ = _lora_class(type(base))
        # plain attributes (not submodules): the adapter is registered once, as the sibling
        base.__dict__[_ATTR] = adapter
        base.__dict__["_hp_lora_tp_mesh"] = tp_key
    return targets


class LoRAConverter:
    """The ``lora`` model converter: adapters on ``lora.target_modules``, the rest frozen.

    Built from the ``[lora]`` section. Its ``lora`` checkpoint state records rank, alpha and
    targets; loading a checkpoint saved with other values is refused.

    Args:
        job_config: The configuration (``[lora]``, ``model.init_device``).
        parallel_dims: The job's parallel dimensions (the TP mesh, when TP is on).

    See Also:
        :titan:`torchtitan.components.lora.LoRAConverter`.
    """

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
        self.config: LoRAConfig = job_config.lora
        self.tp_mesh = parallel_dims.get_mesh("tp") if parallel_dims.tp_enabled else None
        self.targets: list[str] = []
        """The adapted linear layers (after :meth:`convert`)."""

    def convert(self, model: nn.Module) -> None:
        """Add the adapters and freeze the base model.

        Args:
            model: The whole model, before parallelisation.
        """
        cfg = self.config
        self.targets = apply_lora(
            model,
            list(cfg.target_modules),
            rank=cfg.rank,
            alpha=cfg.alpha,
            dropout=cfg.dropout,
            tp_mesh=self.tp_mesh,
        )
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        logger.info(
            "LoRA rank %d alpha %g on %d linear layers: %s trainable of %s parameters (%.2f%%)",
            cfg.rank,
            cfg.alpha,
            len(self.targets),
            f"{trainable:,}",
            f"{total:,}",
            100.0 * trainable / max(total, 1),
        )

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """Nothing to do after a step: the adapters are ordinary parameters."""

    def init_weights(self, part: nn.Module) -> None:
        """Initialise the adapters of a meta-built part (``model.init_device = "meta"``).

        Called after the part got real storage and its own ``init_weights``: ``A``
        Kaiming-uniform, ``B`` zero, on whatever layout the parameters have (sharded DTensors
        draw through DTensor's random-number tracker).

        Args:
            part: The model part.
        """
        for module in part.modules():
            if isinstance(module, LoRAAdapter):
                module.reset_parameters()

    # -- checkpoint state ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The adapter configuration saved with checkpoints (``rank``, ``alpha``, targets)."""
        cfg = self.config
        return {
            "rank": cfg.rank,
            "alpha": float(cfg.alpha),
            "target_modules": ",".join(cfg.target_modules),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Refuse a checkpoint whose adapters were trained with another rank, alpha or targets.

        Args:
            state_dict: The saved :meth:`state_dict`.

        Raises:
            ValueError: Naming the saved and configured values.
        """
        mine = self.state_dict()
        for key in ("rank", "alpha", "target_modules"):
            if state_dict.get(key) != mine[key]:
                raise ValueError(
                    f"the checkpoint's LoRA adapters have {key} = {state_dict.get(key)!r} but "
                    f"lora.{key} = {mine[key]!r}: resume with the configuration it was saved "
                    "with (or start a new run)"
                )

    def model_key_filter(self) -> Any:
        """The model state-dict keys checkpoints hold (``save_adapter_only``), or None (all)."""
        return is_lora_key if self.config.save_adapter_only else None

    def hf_export(self, full_state: dict[str, torch.Tensor], path: Path, sd_adapter: Any) -> Any:
        """Merge the adapters for the HF export; write the PEFT adapter next to it.

        Args:
            full_state: The whole model's full state dict (rank 0).
            path: The HF export folder (``step-N-hf``); the PEFT adapter goes to
                ``step-N-hf/adapter`` when ``lora.save_peft_format``.
            sd_adapter: The model's HF state-dict adapter.

        Returns:
            The merged state dict (our names) that the HF export writes.
        """
        if self.config.save_peft_format:
            save_peft_adapter(full_state, path / "adapter", sd_adapter, self.config)
        return merge_lora_state_dict(full_state, self.config.alpha / self.config.rank)


def merge_lora_state_dict(
    state: Mapping[str, torch.Tensor], scaling: float
) -> dict[str, torch.Tensor]:
    """Fold every adapter into its base weight: ``W + scaling * B @ A``; adapter keys dropped.

    Args:
        state: A full (unsharded) state dict holding base weights and adapters.
        scaling: ``alpha / rank``.

    Returns:
        The merged state dict, in the base model's keys.

    See Also:
        PEFT's ``LoraModel.merge_and_unload``: the same merge on a ``transformers`` model.
    """
    out = {k: v for k, v in state.items() if not is_lora_key(k)}
    for key in state:
        if key.endswith(f"{LORA_SUFFIX}.lora_a.weight"):
            stem = key[: -len(f"{LORA_SUFFIX}.lora_a.weight")]
            a = state[key]
            b = state[f"{stem}{LORA_SUFFIX}.lora_b.weight"]
            base = out[f"{stem}.weight"]
            delta = (b.double() @ a.double()) * scaling
            out[f"{stem}.weight"] = (base.double() + delta).to(base.dtype)
    return out


def peft_adapter_state_dict(
    state: Mapping[str, torch.Tensor], sd_adapter: Any
) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's names (``base_model.model.<hf module>.lora_A.weight``).

    The HF module name is the one the model's state-dict adapter gives the base weight; ``B``
    goes through the same conversion as the base weight (rows permuted where the base's are),
    ``A`` (whose columns are the base's inputs) is stored as is.

    Args:
        state: A full state dict holding the adapters (other keys are ignored).
        sd_adapter: The model's HF state-dict adapter (``to_hf``).

    Returns:
        PEFT's adapter state dict.

    See Also:
        PEFT's ``get_peft_model_state_dict``: the names PEFT saves.
    """
    out: dict[str, torch.Tensor] = {}
    for key in state:
        if not key.endswith(f"{LORA_SUFFIX}.lora_b.weight"):
            continue
        stem = key[: -len(f"{LORA_SUFFIX}.lora_b.weight")]
        ((hf_key, b_hf),) = sd_adapter.to_hf({f"{stem}.weight": state[key]}).items()
        module = hf_key.removesuffix(".weight")
        out[f"base_model.model.{module}.lora_A.weight"] = state[
            f"{stem}{LORA_SUFFIX}.lora_a.weight"
        ].contiguous()
        out[f"base_model.model.{module}.lora_B.weight"] = b_hf.contiguous()
    return out


def save_peft_adapter(
    state: Mapping[str, torch.Tensor],
    path: str | Path,
    sd_adapter: Any,
    config: LoRAConfig,
) -> Path:
    """Write the adapters in PEFT's format: ``adapter_config.json``, ``adapter_model.safetensors``.

    ``peft.PeftModel.from_pretrained(hf_model, path)`` loads it onto the ``transformers`` model
    of the HF export.

    Args:
        state: The full state dict (holding the adapters).
        path: The output folder.
        sd_adapter: The model's HF state-dict adapter.
        config: The ``[lora]`` section.

    Returns:
        ``path``.

    See Also:
        PEFT's ``PeftModel.save_pretrained``: the same two files.
    """
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = peft_adapter_state_dict(state, sd_adapter)
    save_file(
        {k: v.detach().cpu() for k, v in tensors.items()}, str(out / "adapter_model.safetensors")
    )
    hf_modules = sorted({k.split(".")[-3] for k in tensors})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": hf_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": str(out.parent),
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out
