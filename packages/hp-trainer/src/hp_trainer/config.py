"""Job configuration: sectioned dataclasses, TOML/YAML loading and ``--section.field`` overrides.

Every section is a keyword-only dataclass whose fields carry a docstring (a string literal right
below the field, as in TorchTitan); :class:`ConfigManager` reads those docstrings for ``--help``.
Precedence: command line > config file > dataclass defaults.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import sys
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hp_dcp.huggingface import parse_size

__all__ = [
    "ActivationCheckpointConfig",
    "CheckpointConfig",
    "CompileConfig",
    "ConfigManager",
    "DSAConfig",
    "DataConfig",
    "FaultToleranceConfig",
    "Float8Config",
    "JobConfig",
    "JobSection",
    "LRSchedulerConfig",
    "LoRAConfig",
    "MXConfig",
    "MetricsConfig",
    "ModelConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "ProfilingConfig",
    "TrainingConfig",
    "ValidationConfig",
    "builtin_config_names",
    "parse_args",
]

_CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def _fail(section: str, name: str, value: object, allowed: str) -> typing.NoReturn:
    raise ValueError(f"invalid config value {section}.{name} = {value!r}: expected {allowed}")


def _check_literals(obj: object, section: str) -> None:
    hints = _type_hints(type(obj))
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        choices = _literal_choices(hints[f.name])
        value = getattr(obj, f.name)
        if choices is not None and value not in choices:
            allowed = "one of " + ", ".join(repr(c) for c in choices)
            _fail(section, f.name, value, allowed)


@dataclass(kw_only=True)
class JobSection:
    """General settings of the run: name, output folder, launcher and logging.

    See Also:
        :titan:`torchtitan.config.job_config.Job`: TorchTitan's ``[job]`` section.
    """

    config_file: str | None = None
    """Config file (TOML or YAML) or the name of a shipped config (e.g. ``debug``)."""
    run_name: str = "run"
    """Name of the run; outputs go to ``<dump_folder>/<run_name>/``."""
    dump_folder: str = "outputs"
    """Folder that holds one sub-folder of outputs (metrics, plots, checkpoints) per run."""
    description: str = ""
    """Free-text description, logged at start-up."""
    nproc_per_node: int = 0
    """Local ranks ``hp-train`` starts when not already under a launcher (0: product of the
    parallel degrees, or 1 when ``dp_shard`` is -1)."""
    print_config: bool = False
    """Print the resolved configuration at start-up."""
    callbacks: list[str] = field(default_factory=list)
    """Callback classes the trainer builds (no argument) and calls after its own, as
    ``module:Class`` (comma-separated on the command line); each is imported and checked when
    the configuration is parsed (see :class:`hp_trainer.Callback`)."""

    def __post_init__(self) -> None:
        from hp_trainer.callbacks import load_callback_class

        for spec in self.callbacks:
            try:
                load_callback_class(spec)
            except (ValueError, TypeError) as exc:
                _fail("job", "callbacks", spec, f"an importable callback class ({exc})")
        if self.nproc_per_node < 0:
            _fail("job", "nproc_per_node", self.nproc_per_node, "an integer >= 0")
        if not self.run_name or "/" in self.run_name:
            _fail("job", "run_name", self.run_name, "a non-empty name without '/'")


@dataclass(kw_only=True)
class ModelConfig:
    """Which model to build.

    See Also:
        :titan:`torchtitan.config.job_config.Model`: TorchTitan's ``[model]`` section.
    """

    name: str = "llama3"
    """Registered model name (see ``hp_trainer.get_model_spec``): ``llama3`` or ``qwen3``."""
    flavor: str = "debugmodel"
    """Model size preset of the chosen model (e.g. ``tiny``, ``debugmodel``, ``3.1-8B``,
    ``0.6B``), checked against the config.json of an HF checkpoint being imported; ``auto``
    builds the model from that config.json (``checkpoint.initial_load_path`` with
    ``initial_load_in_hf``)."""
    init_device: Literal["cpu", "meta"] = "cpu"
    """Where parameters are first created, ``cpu`` (full weights, seeded, then sharded, so
    identical numbers in every layout) or ``meta`` (shard first, then initialize: for models
    that do not fit on one host)."""
    attn_mask_type: Literal["causal", "block_causal"] = "causal"
    """Attention mask, ``causal`` or ``block_causal`` (document masking: a position attends
    only to earlier positions of its own document in the packed sample; documents are split at
    the tokenizer's BOS/EOS). Under context parallel with the ``allgather`` or ``ulysses``
    rotate method and without pipeline parallel only."""
    attn_backend: Literal["sdpa", "flex", "varlen"] = "sdpa"
    """Attention kernel (TorchTitan's ``attn_backend``): ``sdpa`` (PyTorch's fused attention;
    a dense mask only where the mask needs one), ``flex`` (FlexAttention block masks; compiled
    on accelerators; no backward on CPU in torch 2.13, so refused here for training on CPU) or
    ``varlen`` (variable-length attention over the documents' cumulative lengths: torch's
    kernel on CUDA, a reference elsewhere). Under context parallel: ``sdpa`` only (the
    context-parallel engine takes every mask kind and sinks through it)."""
    converters: list[str] = field(default_factory=list)
    """Model converters applied in this order after the model is built and before it is
    parallelised (comma-separated on the command line): ``float8``, ``mx``, ``lora`` or a name
    given to ``hp_trainer.register_model_converter``; unknown names are refused here."""

    def __post_init__(self) -> None:
        _check_literals(self, "model")
        from hp_trainer.components.converters import check_converter_names

        check_converter_names(self.converters)


@dataclass(kw_only=True)
class TrainingConfig:
    """Batch, sequence, steps, precision and determinism.

    See Also:
        :titan:`torchtitan.config.job_config.Training`: TorchTitan's ``[training]`` section.
    """

    local_batch_size: int = 8
    """Samples per micro-batch on each data-parallel rank."""
    global_batch_size: int = -1
    """Samples per optimizer step over all data-parallel ranks; -1 means ``local_batch_size``
    times the data-parallel degree (no gradient accumulation). A multiple of that product."""
    seq_len: int = 2048
    """Tokens per sample."""
    steps: int = 10
    """Number of optimizer steps."""
    max_norm: float = 1.0
    """Maximum total 2-norm of the gradients for clipping (0 disables clipping)."""
    seed: int | None = None
    """Random seed for model init and data order (None means 0 for both)."""
    deterministic: bool = False
    """Use deterministic algorithms only (``torch.use_deterministic_algorithms``)."""
    mixed_precision_param: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Compute dtype of forward/backward. With FSDP/HSDP it is the dtype parameters are
    gathered in; without data parallelism (one process, TP only) ``torch.autocast`` computes in
    it, with float32 parameters, gradients and optimizer state (TorchTitan's choice)."""
    mixed_precision_reduce: Literal["float32", "bfloat16", "float16"] = "float32"
    """FSDP gradient-reduction dtype."""
    enable_cpu_offload: bool = False
    """Offload FSDP parameters, gradients and optimizer state to host memory."""
    gc_freq: int = 50
    """Run Python's garbage collector every this many steps (0 leaves gc automatic)."""

    def __post_init__(self) -> None:
        _check_literals(self, "training")
        for name in ("local_batch_size", "seq_len", "steps"):
            if getattr(self, name) < 1:
                _fail("training", name, getattr(self, name), "an integer >= 1")
        if self.global_batch_size != -1 and self.global_batch_size < 1:
            _fail("training", "global_batch_size", self.global_batch_size, "-1 or an integer >= 1")
        if self.max_norm < 0:
            _fail("training", "max_norm", self.max_norm, "a number >= 0")
        if self.gc_freq < 0:
            _fail("training", "gc_freq", self.gc_freq, "an integer >= 0")


@dataclass(kw_only=True)
class ParallelismConfig:
    """Degrees of each parallel dimension and their options.

    See Also:
        :titan:`torchtitan.config.job_config.Parallelism`: TorchTitan's ``[parallelism]`` section.
    """

    data_parallel_replicate_degree: int = 1
    """Replicas of the model for HSDP/DDP (outer data-parallel axis)."""
    data_parallel_shard_degree: int = -1
    """FSDP shard degree (-1 takes all ranks left after the other degrees)."""
    tensor_parallel_degree: int = 1
    """Tensor-parallel degree (Megatron-style column/row sharding with sequence parallel)."""
    context_parallel_degree: int = 1
    """Context-parallel degree (the sequence of each sample is split over this many ranks,
    head-tail load balanced; attention runs context-parallel; FSDP shards over dp_shard x cp)."""
    context_parallel_rotate_method: Literal[
        "allgather", "alltoall", "ring", "ulysses", "hybrid"
    ] = "allgather"
    """How attention reaches the other ranks' keys/values under CP, ``allgather`` (gather K/V),
    ``alltoall`` or ``ring`` (pass K/V shards around a ring), ``ulysses`` (all-to-all from
    sequence to heads) or ``hybrid`` (Ulysses inside groups of
    ``context_parallel_ulysses_degree`` ranks, ring across them)."""
    context_parallel_ulysses_degree: int = 1
    """Ulysses group size of the ``hybrid`` rotate method (divides context_parallel_degree)."""
    pipeline_parallel_degree: int = 1
    """Pipeline-parallel degree (the model is split into stages of consecutive blocks)."""
    pipeline_parallel_schedule: str = "1F1B"
    """Pipeline schedule by name, ``GPipe``, ``1F1B`` (one stage per rank), ``Interleaved1F1B``,
    ``LoopedBFS``, ``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV`` (two stages per
    rank)."""
    pipeline_parallel_schedule_csv: str = ""
    """A CSV file with a custom schedule (hp-pp's compact notation) run on the stages of
    ``pipeline_parallel_schedule``'s placement; empty: the named schedule's own table."""
    pipeline_parallel_microbatch_size: int = 1
    """Samples per pipeline micro-batch; ``local_batch_size`` / this = micro-batches per step."""
    expert_parallel_degree: int = 1
    """Expert-parallel degree for MoE models; borrows ranks from dp_shard * cp * tp."""
    disable_loss_parallel: bool = False
    """Gather the logits before the loss instead of computing it on vocab-sharded logits."""
    enable_async_tensor_parallel: bool = False
    """Overlap TP collectives with matmuls (needs symmetric memory, so CUDA only)."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """When to free gathered parameters after forward, ``always``, ``never`` or ``default``
    (which frees them unless pipeline parallel is on)."""
    enable_symm_mem: bool = False
    """Use symmetric memory for FSDP collectives (CUDA with SM >= 9.0 only)."""
    auto: bool = False
    """Let the planner (:mod:`hp_trainer.planner`, ``hp-plan``) choose the degrees, pipeline
    schedule, micro-batch size and AC mode for this world size; the degrees given are ignored."""
    auto_device: str = ""
    """Device profile the planner uses with ``auto`` (``h100``, ``h200``, ``ascend910b``,
    ``cpu`` or a ``.toml`` path); empty: ``cpu`` on a CPU run, else named by the device."""

    def __post_init__(self) -> None:
        _check_literals(self, "parallelism")
        for name in (
            "data_parallel_replicate_degree",
            "tensor_parallel_degree",
            "context_parallel_degree",
            "pipeline_parallel_degree",
            "expert_parallel_degree",
            "context_parallel_ulysses_degree",
            "pipeline_parallel_microbatch_size",
        ):
            if getattr(self, name) < 1:
                _fail("parallelism", name, getattr(self, name), "an integer >= 1")
        from hp_pp import get_schedule_class

        try:
            get_schedule_class(self.pipeline_parallel_schedule)
        except ValueError as exc:
            _fail("parallelism", "pipeline_parallel_schedule", self.pipeline_parallel_schedule,
                  f"a schedule name ({exc})")  # fmt: skip
        csv = self.pipeline_parallel_schedule_csv
        if csv and not Path(csv).is_file():
            _fail("parallelism", "pipeline_parallel_schedule_csv", csv, "an existing CSV file")
        if self.data_parallel_shard_degree == 0 or self.data_parallel_shard_degree < -1:
            _fail(
                "parallelism",
                "data_parallel_shard_degree",
                self.data_parallel_shard_degree,
                "-1 (infer) or an integer >= 1",
            )


@dataclass(kw_only=True)
class OptimizerConfig:
    """AdamW/Adam/SGD settings.

    See Also:
        :titan:`torchtitan.components.optimizer.OptimizersContainer`: TorchTitan's optimizer config.
    """

    name: Literal["AdamW", "Adam", "SGD", "Muon"] = "AdamW"
    """Optimizer class from ``torch.optim``, or ``Muon`` (``hp_trainer.Muon`` on the 2-D hidden
    matrices, AdamW with ``beta1``/``beta2``/``eps`` on embeddings, heads and 1-D parameters)."""
    lr: float = 8e-4
    """Peak learning rate."""
    beta1: float = 0.9
    """First-moment decay (Adam/AdamW)."""
    beta2: float = 0.95
    """Second-moment decay (Adam/AdamW)."""
    eps: float = 1e-8
    """Denominator epsilon (Adam/AdamW)."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW) or L2 penalty (Adam/SGD)."""
    implementation: Literal["for-loop", "foreach", "fused"] = "fused"
    """Optimizer kernel style, a per-parameter loop, multi-tensor ``foreach`` or ``fused``
    (TorchTitan's default; torch's fused Adam/AdamW/SGD kernels run on CPU too)."""
    muon_gather_dtype: Literal["bf16", "fp32"] = "bf16"
    """Dtype of the update shards (Muon only) sent to each matrix's owner rank, ``bf16`` (half
    the bytes, as Moonlight does) or ``fp32``. Newton-Schulz rounds its input to bf16 first, so
    both give the same update; the owners return their results in bf16 either way."""

    def __post_init__(self) -> None:
        _check_literals(self, "optimizer")
        if self.lr <= 0:
            _fail("optimizer", "lr", self.lr, "a number > 0")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                _fail("optimizer", name, getattr(self, name), "a number in [0, 1)")
        if self.weight_decay < 0:
            _fail("optimizer", "weight_decay", self.weight_decay, "a number >= 0")


@dataclass(kw_only=True)
class LRSchedulerConfig:
    """Learning-rate schedule: linear warm-up, then stable, then decay.

    See Also:
        :titan:`torchtitan.components.lr_scheduler.LRSchedulersContainer`: TorchTitan's schedule.
    """

    warmup_steps: int = 200
    """Steps of linear warm-up from ``lr / (warmup_steps + 1)`` up to the peak ``lr``."""
    decay_type: Literal["cosine", "linear", "sqrt", "wsd", "constant"] = "linear"
    """Decay after warm-up. ``cosine``, ``linear`` and ``sqrt`` decay over the ``decay_ratio``
    tail; ``wsd`` is warmup-stable-decay with a linear tail; ``constant`` keeps the peak."""
    decay_ratio: float | None = None
    """Fraction of the steps after warm-up spent decaying (None means all of them, except for
    ``wsd`` which defaults to 0.2)."""
    min_lr_factor: float = 0.0
    """Final learning rate as a fraction of the peak."""

    def __post_init__(self) -> None:
        _check_literals(self, "lr_scheduler")
        if self.warmup_steps < 0:
            _fail("lr_scheduler", "warmup_steps", self.warmup_steps, "an integer >= 0")
        if self.decay_ratio is not None and not 0.0 <= self.decay_ratio <= 1.0:
            _fail("lr_scheduler", "decay_ratio", self.decay_ratio, "None or a number in [0, 1]")
        if not 0.0 <= self.min_lr_factor <= 1.0:
            _fail("lr_scheduler", "min_lr_factor", self.min_lr_factor, "a number in [0, 1]")


@dataclass(kw_only=True)
class ActivationCheckpointConfig:
    """Activation checkpointing (recompute activations in backward to save memory).

    See Also:
        :titan:`torchtitan.config.job_config.ActivationCheckpoint`: TorchTitan's AC section.
    """

    mode: Literal["none", "full", "selective", "swap", "memory_budget"] = "none"
    """``none``, ``full`` (recompute every block), ``selective`` (see ``selective_ac_option``),
    ``swap`` (saved activations to host memory, prefetched back for backward) or
    ``memory_budget`` (``torch.compile``'s min-cut partitioner keeps ``memory_budget`` of the
    activations; needs ``compile.enable``)."""
    selective_ac_option: str = "2"
    """For ``selective``: an integer N checkpoints every N-th block; ``op`` saves the outputs of
    compute-heavy ops (matmuls, attention) and recomputes the rest."""
    preserve_rng_state: bool = False
    """Restore the RNG state for recomputation (needed with dropout)."""
    memory_budget: float = 0.5
    """For ``memory_budget``: fraction in [0, 1] of the activation memory to keep (0 recomputes
    everything that can be recomputed, 1 saves like no checkpointing)."""
    every_n_layers: int = 1
    """For ``swap`` and ``memory_budget``: apply to every N-th block (1 = every block)."""

    def __post_init__(self) -> None:
        _check_literals(self, "activation_checkpoint")
        if isinstance(self.memory_budget, bool) or not 0.0 <= self.memory_budget <= 1.0:
            _fail(
                "activation_checkpoint", "memory_budget", self.memory_budget, "a number in [0, 1]"
            )
        if self.every_n_layers < 1:
            _fail("activation_checkpoint", "every_n_layers", self.every_n_layers, "an integer >= 1")
        opt = self.selective_ac_option
        if opt != "op" and not (opt.isdigit() and int(opt) >= 1):
            _fail("activation_checkpoint", "selective_ac_option", opt, "'op' or an integer >= 1")


@dataclass(kw_only=True)
class OffloadConfig:
    """Hyper-offload: optimizer state in host memory with the optimizer step run there.

    See Also:
        :pt:`torch.distributed.fsdp.CPUOffloadPolicy`: FSDP2's offload policy (parameters and
        gradients as well, only under FSDP).
    """

    optimizer: bool = False
    """Keep the optimizer state (and fp32 master weights) on the host and step there, group by
    group; the device keeps the parameters it computes with (AdamW, Adam, SGD)."""
    params: bool = False
    """Keep the parameters (and their gradients) in host memory; each block's parameters are
    copied to the device for its forward and again for its backward, the next block's copy
    issued ahead (:func:`hp_trainer.distributed.param_offload.offload_params`); the optimizer
    then steps on the host. One process, without FSDP, TP, PP, CP, EP or ``compile``."""

    def __post_init__(self) -> None:
        if not isinstance(self.optimizer, bool):
            _fail("offload", "optimizer", self.optimizer, "true or false")
        if not isinstance(self.params, bool):
            _fail("offload", "params", self.params, "true or false")


@dataclass(kw_only=True)
class MoEConfig:
    """Mixture-of-experts options that override the model flavor's (MoE models only).

    See Also:
        :titan:`torchtitan.config.job_config.JobConfig`: TorchTitan sets these on the model's
        MoE arguments.
    """

    aux_loss_type: Literal["model", "batch", "sequence"] = "model"
    """The auxiliary load-balancing loss (when the flavor's coefficient is > 0). ``model``
    keeps the flavor's choice; ``batch`` balances the experts' load over the whole batch;
    ``sequence`` is DeepSeek-V3's sequence-wise balance loss (each sequence balanced on its own;
    needs ``parallelism.context_parallel_degree = 1``)."""
    hot_expert_replicas: int = 0
    """An extension. The ``K`` most loaded experts of each MoE layer get a copy on the least loaded
    expert-parallel ranks (``hp_cp_ep.TokenDispatcher.replicate_hot_experts``; their rows split
    between the copies, the replica's gradient summed into the owner's: training is unchanged).
    0: off. Needs ``parallelism.expert_parallel_degree > 1``."""
    hot_expert_update_interval: int = 10
    """An extension. Re-plan the replicas from the global expert load every this many steps."""
    dedup_dispatch: bool = False
    """An extension. Send a token routed to several experts on the same expert-parallel rank once
    and fan it out there (:class:`hp_cp_ep.DedupTokenDispatcher`, HyperParallel's
    ``DeredundencyTokenDispatcher``): fewer all-to-all bytes whenever ``top_k > 1``. Needs
    ``parallelism.expert_parallel_degree > 1``; with ``tensor_parallel_degree > 1`` the experts'
    partial outputs are summed over TP once per token, after the combine."""
    dedup_ranks_per_node: int = 1
    """An extension. With ``dedup_dispatch``: the expert-parallel ranks form nodes of this many
    consecutive ranks, and dispatch has two stages (a token crosses to each destination node once,
    then to each destination rank inside it; the EP mesh becomes ``[ep_inter, ep_intra]``). 1:
    one stage. Must divide ``parallelism.expert_parallel_degree``; not with
    ``hot_expert_replicas`` (replicas need a flat EP group) nor ``tensor_parallel_degree > 1``
    (the trainer's expert mesh is then ``[ep, tp]``, one stage)."""
    overlap_backward: bool = False
    """An extension. Issue the combine's backward all-to-all before the shared experts' backward
    and wait for it after (:class:`hp_cp_ep.BackwardOverlap`); off, the backward all-to-alls
    block. Needs ``parallelism.expert_parallel_degree > 1`` (any ``tensor_parallel_degree``)."""
    fused: bool = False
    """An extension. The routed experts compute through the fused op :func:`hp_kernels.mega_moe`
    (HyperParallel's ``mega_moe``: a Triton kernel on CUDA, the composed reference elsewhere;
    no host sync): without expert or tensor parallelism, permutation, experts and combine are
    that one op, otherwise the experts' grouped GEMMs are. Training is unchanged (bitwise on the
    CPU where ``torch._grouped_mm`` applies). MoE models only."""

    def __post_init__(self) -> None:
        _check_literals(self, "moe")
        if self.hot_expert_replicas < 0 or self.hot_expert_update_interval < 1:
            raise ValueError(
                "moe.hot_expert_replicas must be >= 0 and moe.hot_expert_update_interval >= 1, "
                f"got {self.hot_expert_replicas} and {self.hot_expert_update_interval}"
            )
        if self.dedup_ranks_per_node < 1:
            raise ValueError(
                f"moe.dedup_ranks_per_node must be >= 1, got {self.dedup_ranks_per_node}"
            )
        if self.dedup_ranks_per_node > 1 and not self.dedup_dispatch:
            raise ValueError(
                f"moe.dedup_ranks_per_node = {self.dedup_ranks_per_node} is the node size of the "
                "two-stage de-duplicating dispatch; expected moe.dedup_dispatch = true"
            )
        if self.dedup_ranks_per_node > 1 and self.hot_expert_replicas:
            raise ValueError(
                f"moe.dedup_ranks_per_node = {self.dedup_ranks_per_node} with "
                f"moe.hot_expert_replicas = {self.hot_expert_replicas}: hot-expert replicas need "
                "a flat expert-parallel group; expected one of them off"
            )


@dataclass(kw_only=True)
class DSAConfig:
    """DeepSeek Sparse Attention's indexer training (``model.name = "deepseek_v32"`` only).

    See Also:
        ``hp_trainer.models.deepseek_v32.DSAttention``: the stages and the indexer's loss.
    """

    indexer_stage: Literal["dense_warmup", "sparse"] = "sparse"
    """``dense_warmup``: dense attention, every parameter but the lightning indexers' frozen,
    the indexers trained to the attention's distribution over all visible tokens (DeepSeek-V3.2's
    warm-up); ``sparse``: attention over each query's top-k tokens, the model trained by the
    language-modelling loss and the indexers (their inputs detached) by their loss on the
    selected tokens."""
    indexer_loss_coeff: float = 1.0
    """Weight of the indexers' KL loss; 0 leaves the indexers untrained."""

    def __post_init__(self) -> None:
        _check_literals(self, "dsa")
        if not self.indexer_loss_coeff >= 0:
            _fail("dsa", "indexer_loss_coeff", self.indexer_loss_coeff, "a number >= 0")


@dataclass(kw_only=True)
class LoRAConfig:
    """LoRA fine-tuning (``model.converters`` holding ``lora``): frozen base, trainable adapters.

    Each targeted linear ``y = W x`` becomes ``y = W x + (alpha / rank) * B A dropout(x)``
    with ``A`` (``rank x in``) drawn like PEFT (Kaiming-uniform) and ``B`` (``out x rank``)
    zero, so training starts from the base model; only ``A`` and ``B`` train.

    See Also:
        :titan:`torchtitan.components.lora.LoRAConverter`; PEFT's ``LoraConfig``.
    """

    rank: int = 8
    """Rank of the adapters (PEFT's ``r``)."""
    alpha: float = 16.0
    """The scaling numerator; the adapter output is multiplied by ``alpha / rank`` (PEFT's
    ``lora_alpha``)."""
    dropout: float = 0.0
    """Dropout probability on the adapter's input (PEFT's ``lora_dropout``)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
    )
    """The linear layers that get adapters; a name matches a module whose fully qualified name
    equals it or ends with ``.name`` (comma-separated on the command line). A name matching no
    ``nn.Linear`` is refused, listing the linear layers of the model."""
    save_adapter_only: bool = True
    """Checkpoints hold only the adapters (plus the training state); the frozen base weights
    come from ``checkpoint.initial_load_path`` again on resume."""
    save_peft_format: bool = True
    """With ``checkpoint.last_save_in_hf``, also write the adapters in PEFT's format
    (``adapter_config.json`` + ``adapter_model.safetensors``) next to the merged HF export."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or self.rank < 1:
            _fail("lora", "rank", self.rank, "an integer >= 1")
        if self.alpha <= 0:
            _fail("lora", "alpha", self.alpha, "a number > 0")
        if not 0.0 <= self.dropout < 1.0:
            _fail("lora", "dropout", self.dropout, "a number in [0, 1)")
        if not self.target_modules or any(not t.strip() for t in self.target_modules):
            _fail("lora", "target_modules", self.target_modules, "a non-empty list of names")


@dataclass(kw_only=True)
class Float8Config:
    """Float8 training through torchao (``model.converters`` holding ``float8``).

    Every ``nn.Linear`` not matched by :attr:`filter_fqns` becomes torchao's ``Float8Linear``
    (its matmuls in float8 with dynamic scales); with FSDP, tensorwise weights can be
    all-gathered in float8 (a quarter of the fp32 bytes). Needs ``hp-trainer[float8]``
    (torchao); runs on CPU too (``torch._scaled_mm``).

    See Also:
        TorchTitan's Float8 converter config (``recipe_name``,
        ``enable_fsdp_float8_all_gather``, ``precompute_float8_dynamic_scale_for_fsdp``,
        ``filter_fqns``, ``emulate``); torchao's ``Float8LinearConfig``.
    """

    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    """The torchao scaling recipe, ``tensorwise`` (one scale per tensor), ``rowwise`` (one scale
    per row) or ``rowwise_with_gw_hp`` (rowwise, weight gradient in high precision)."""
    enable_fsdp_float8_all_gather: bool = False
    """All-gather the FSDP-sharded weights in float8 (tensorwise only; ignored without FSDP)."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """After each optimizer step, compute every float8 weight's scale in one all-reduce
    (needs ``enable_fsdp_float8_all_gather``); otherwise each all-gather reduces its own."""
    filter_fqns: list[str] = field(default_factory=lambda: ["lm_head"])
    """The linear layers left in high precision; a layer is skipped when one of these strings
    occurs in its fully qualified name (comma-separated on the command line; the default keeps
    the output head, TorchTitan's ``output``). Layers whose dimensions are not divisible by 16
    must be listed here, or the conversion is refused."""
    emulate: bool = False
    """Emulate the float8 matmuls in high precision (testing without float8 kernels)."""

    def __post_init__(self) -> None:
        _check_literals(self, "float8")
        if self.enable_fsdp_float8_all_gather and self.recipe_name != "tensorwise":
            _fail("float8", "enable_fsdp_float8_all_gather", True,
                  f"false with recipe_name = {self.recipe_name!r} (the float8 all-gather needs "
                  "the tensorwise recipe)")  # fmt: skip
        if self.precompute_float8_dynamic_scale_for_fsdp and not self.enable_fsdp_float8_all_gather:
            _fail("float8", "precompute_float8_dynamic_scale_for_fsdp", True,
                  "false unless enable_fsdp_float8_all_gather = true (the precomputed scales are "
                  "those of the float8 all-gather)")  # fmt: skip
        if any(not isinstance(f, str) or not f.strip() for f in self.filter_fqns):
            _fail("float8", "filter_fqns", self.filter_fqns, "a list of non-empty names")


@dataclass(kw_only=True)
class MXConfig:
    """MXFP8 training through torchao (``model.converters`` holding ``mx``).

    Every ``nn.Linear`` not matched by :attr:`filter_fqns` gets torchao's MXFP8 training weight
    (32-element blocks sharing one power-of-two scale). The MXFP8 kernels need a CUDA device of
    compute capability 10.0 or newer and Triton; elsewhere the converter refuses them, and the
    emulated recipe (PyTorch-native quantization, high-precision matmuls) runs anywhere.

    See Also:
        TorchTitan's MXFP8 converter config; torchao's ``MXFP8TrainingOpConfig``.
    """

    recipe_name: Literal["mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp", "mxfp8_emulated_rceil"] = (
        "mxfp8_rceil"
    )
    """The torchao MXFP8 recipe, ``mxfp8_rceil`` (MXFP8 kernels), ``mxfp8_rceil_wgrad_with_hp``
    (weight gradient in high precision) or ``mxfp8_emulated_rceil`` (emulated, any device)."""
    filter_fqns: list[str] = field(default_factory=lambda: ["lm_head"])
    """Linear layers left in high precision (substring of the fully qualified name). Layers
    whose dimensions are not divisible by 32 must be listed here, or the conversion is
    refused."""

    def __post_init__(self) -> None:
        _check_literals(self, "mx")
        if any(not isinstance(f, str) or not f.strip() for f in self.filter_fqns):
            _fail("mx", "filter_fqns", self.filter_fqns, "a list of non-empty names")


@dataclass(kw_only=True)
class FaultToleranceConfig:
    """Fault tolerance through torchft: replica groups coordinated by a lighthouse.

    Each replica group is an ordinary job (FSDP, TP, PP, CP, EP inside it) started by its own
    ``hp-train``; the data-parallel replicate dimension across groups is managed by a torchft
    ``Manager``. See :doc:`/fault_tolerance`.

    See Also:
        :titan:`torchtitan.components.ft.config.job_config.FaultTolerance`: TorchTitan's
        ``[fault_tolerance]`` section (the same field names).
    """

    enable: bool = False
    """Run this job as one replica group of a torchft fault-tolerant job (needs torchft)."""
    process_group: Literal["gloo", "nccl"] = "gloo"
    """Backend of the managed cross-group process group (gloo on CPU)."""
    process_group_timeout_ms: int = 10000
    """Timeout of the cross-group collectives, the commit vote and the recovery transfer."""
    replica_id: int = 0
    """This replica group's index, in ``[0, group_size)``."""
    group_size: int = 0
    """Number of replica groups of the job (the replicate degree across groups)."""
    min_replica_size: int = 1
    """Fewest replica groups that may commit a step (``Manager.min_replica_size``)."""
    semi_sync_method: Literal["none", "local_sgd", "diloco"] = "none"
    """``none``: gradients all-reduced across groups every step; ``local_sgd`` / ``diloco``:
    groups train alone and synchronise every ``sync_steps`` steps (torchft's implementations)."""
    sync_steps: int = 5
    """Local steps between two synchronisations (LocalSGD / DiLoCo)."""
    fragment_sync_delay: int = 0
    """With DiLoCo, the steps a fragment's synchronisation may overlap before it is applied."""
    fragment_update_alpha: float = 0.0
    """With DiLoCo, the weight of the local parameters when merging a fragment's global update."""
    num_fragments: int = 1
    """With DiLoCo, the number of model fragments synchronised in turn (streaming DiLoCo)."""
    module_fqns_per_model_fragment: list[list[str]] = field(default_factory=list)
    """With DiLoCo, the fragments by name, one list of module names per fragment (e.g.
    ``[["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]``); every parameter must
    fall in exactly one fragment (checked when the job starts). Empty: ``num_fragments``
    consecutive slices of the blocks."""
    should_quantize: bool = False
    """With DiLoCo, all-reduce the pseudo-gradients quantized to fp8 (torchft's Triton kernels:
    needs ``process_group = "nccl"``, refused otherwise)."""
    outer_lr: float = 0.7
    """An extension. DiLoCo's outer optimizer (Nesterov SGD) learning rate."""
    outer_momentum: float = 0.9
    """An extension. DiLoCo's outer optimizer momentum."""
    lighthouse: str = ""
    """An extension. Lighthouse address ``http://host:port`` (empty: ``$TORCHFT_LIGHTHOUSE``)."""
    quorum_timeout_ms: int = 60000
    """An extension. How long a quorum (waiting for ``min_replica_size`` groups) may take."""
    trace: bool = False
    """An extension. Write one JSON record per step to ``<run folder>/ft_trace_rank<r>.jsonl``
    (commit, participants, stream positions read, parameter digest)."""

    def __post_init__(self) -> None:
        _check_literals(self, "fault_tolerance")
        if not self.enable:
            return
        if self.group_size < 1:
            _fail("fault_tolerance", "group_size", self.group_size, "the number of groups >= 1")
        if not 0 <= self.replica_id < self.group_size:
            allowed = f"an index in [0, group_size = {self.group_size})"
            _fail("fault_tolerance", "replica_id", self.replica_id, allowed)
        if not 1 <= self.min_replica_size <= self.group_size:
            allowed = f"a count in [1, group_size = {self.group_size}]"
            _fail("fault_tolerance", "min_replica_size", self.min_replica_size, allowed)
        for name in ("process_group_timeout_ms", "quorum_timeout_ms", "sync_steps"):
            if getattr(self, name) < 1:
                _fail("fault_tolerance", name, getattr(self, name), "a positive integer")
        if self.num_fragments < 1:
            _fail("fault_tolerance", "num_fragments", self.num_fragments, "an integer >= 1")
        if not 0 <= self.fragment_sync_delay < self.sync_steps:
            allowed = f"a delay in [0, sync_steps = {self.sync_steps})"
            _fail("fault_tolerance", "fragment_sync_delay", self.fragment_sync_delay, allowed)
        fqns = self.module_fqns_per_model_fragment
        if fqns:
            if any(
                not isinstance(frag, list) or not frag or not all(isinstance(n, str) for n in frag)
                for frag in fqns
            ):
                _fail(
                    "fault_tolerance",
                    "module_fqns_per_model_fragment",
                    fqns,
                    "a list of non-empty lists of module names",
                )
            if self.semi_sync_method != "diloco" or self.num_fragments not in (1, len(fqns)):
                _fail(
                    "fault_tolerance",
                    "module_fqns_per_model_fragment",
                    fqns,
                    f"fragments for semi_sync_method = 'diloco' (got {self.semi_sync_method!r}), "
                    f"with num_fragments 1 or {len(fqns)} (got {self.num_fragments})",
                )
        if self.should_quantize and (
            self.semi_sync_method != "diloco" or self.process_group != "nccl"
        ):
            _fail(
                "fault_tolerance",
                "should_quantize",
                True,
                "false, or semi_sync_method = 'diloco' with process_group = 'nccl' (torchft "
                f"quantizes with Triton kernels on CUDA; got {self.semi_sync_method!r}, "
                f"{self.process_group!r})",
            )


@dataclass(kw_only=True)
class CompileConfig:
    """``torch.compile`` of each transformer block.

    See Also:
        :titan:`torchtitan.config.job_config.Compile`: TorchTitan's ``[compile]`` section.
    """

    enable: bool = False
    """Compile each transformer block (and the loss) with ``torch.compile``."""
    backend: str = "inductor"
    """``torch.compile`` backend (``inductor``, ``aot_eager``, ``eager``)."""
    fullgraph: bool = True
    """Require each block to compile into one graph."""


@dataclass(kw_only=True)
class MetricsConfig:
    """Logging of the per-step metrics.

    See Also:
        :titan:`torchtitan.components.metrics.MetricsProcessor`: TorchTitan's metrics config.
    """

    log_freq: int = 10
    """Log every this many steps (and always on the first and last step)."""
    enable_jsonl: bool = True
    """Write one JSON object per logged step to ``metrics.jsonl`` in the run folder."""
    enable_tensorboard: bool = False
    """Write TensorBoard event files to ``tb/`` in the run folder (needs ``tensorboard``)."""
    enable_plot: bool = True
    """Save the loss curve as ``loss.png`` at the end of the run (needs ``matplotlib``)."""
    enable_progress_bar: bool = True
    """Show a progress bar with the console log line."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device for MFU (0 looks the device up; unknown devices show n/a)."""
    rank_0_only: bool = True
    """Log on rank 0 only (otherwise every rank prints its own line)."""
    enable_wandb: bool = False
    """Log to Weights & Biases from rank 0 (needs ``wandb``: ``pip install 'hp-trainer[wandb]'``;
    ``WANDB_PROJECT`` names the project, default ``hp-trainer``; ``WANDB_MODE=offline`` writes
    ``wandb/`` in the run folder without a network). A resumed run continues the same W&B run."""

    def __post_init__(self) -> None:
        if self.log_freq < 1:
            _fail("metrics", "log_freq", self.log_freq, "an integer >= 1")
        if self.peak_flops < 0:
            _fail("metrics", "peak_flops", self.peak_flops, "a number >= 0")


@dataclass(kw_only=True)
class DataConfig:
    """Training data and tokenizer.

    See Also:
        :titan:`torchtitan.config.job_config.Training.dataset`: TorchTitan's dataset options.
    """

    dataset: str = "tiny_stories_synth"
    """``tiny_stories_synth`` (the shipped corpus), or a path to a ``.txt``/``.txt.gz`` file (one
    document per line), a ``.jsonl`` file, or a folder of such files."""
    jsonl_text_field: str = "text"
    """Field holding the document text in JSONL files, and in the records of a streamed
    dataset (``streaming``; text files always use ``text``)."""
    tokenizer_path: str = "builtin"
    """``tokenizer.json`` file or folder holding one (``builtin``: the shipped 2K BPE)."""
    bos_token: str | None = None
    """BOS token text; None takes the ``bos_token`` of the tokenizer's
    ``tokenizer_config.json`` or ``special_tokens_map.json``. Documents are framed by BOS/EOS,
    and one of them must be known."""
    eos_token: str | None = None
    """EOS token text; None takes the ``eos_token`` of the tokenizer's config files."""
    shuffle: bool = True
    """Shuffle the global sample order every epoch (seeded, identical on every rank); must be
    false with ``streaming`` (a stream is read in its order)."""
    streaming: bool = False
    """Read ``dataset`` with HuggingFace ``datasets`` (the ``datasets`` extra) as a stream and
    tokenize on the fly, each data-parallel rank its own part, instead of reading it whole:
    a ``.jsonl``/``.json``/``.parquet``/``.arrow``/``.txt`` file or folder, or a hub name."""

    def __post_init__(self) -> None:
        if not self.dataset:
            _fail("data", "dataset", self.dataset, "a dataset name or path")
        if self.streaming and self.shuffle:
            _fail("data", "shuffle", self.shuffle, "false with data.streaming (read in order)")


@dataclass(kw_only=True)
class ValidationConfig:
    """Validation loss and perplexity on a held-out dataset during training.

    See Also:
        :titan:`torchtitan.config.job_config.Validation`: TorchTitan's ``[validation]`` section.
    """

    enable: bool = False
    """Evaluate the model every ``freq`` steps and at the last step."""
    dataset: str = ""
    """The held-out data, a built-in name, a text/JSONL file or folder, or a prepared folder
    (``hp-train-prepare``); required when ``enable`` is set."""
    local_batch_size: int = 8
    """Samples per validation batch on each data-parallel rank."""
    freq: int = 100
    """Validate every this many training steps (and after the last one)."""
    steps: int = -1
    """Batches per validation; -1 makes one pass over the whole dataset, in file order."""

    def __post_init__(self) -> None:
        if self.enable and not self.dataset:
            _fail("validation", "dataset", self.dataset, "a dataset when validation.enable")
        for name in ("local_batch_size", "freq"):
            if getattr(self, name) < 1:
                _fail("validation", name, getattr(self, name), "an integer >= 1")
        if self.steps == 0 or self.steps < -1:
            _fail("validation", "steps", self.steps, "-1 (the whole dataset) or an integer >= 1")


@dataclass(kw_only=True)
class ProfilingConfig:
    """Torch profiler traces and allocator memory snapshots.

    See Also:
        :titan:`torchtitan.config.job_config.Profiling`: TorchTitan's ``[profiling]`` section.
    """

    enable_profiling: bool = False
    """Record torch profiler traces (one Chrome trace file per rank) of a window of steps."""
    save_traces_folder: str = "profile_traces"
    """Folder in the run folder for the traces (``iteration_N/rankR_trace.json``)."""
    profile_freq: int = 10
    """Trace the last ``profiler_active`` steps of every ``profile_freq`` steps."""
    profiler_warmup: int = 3
    """Steps the profiler runs untraced before each traced window."""
    profiler_active: int = 1
    """Steps traced per window."""
    enable_memory_snapshot: bool = False
    """Record the device allocator's history and dump snapshots (CUDA only; on other devices
    a note says it is unavailable)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Folder in the run folder for the snapshots (``iteration_N/rankR_memory_snapshot.pickle``)."""

    def __post_init__(self) -> None:
        for name in ("profile_freq", "profiler_active"):
            if getattr(self, name) < 1:
                _fail("profiling", name, getattr(self, name), "an integer >= 1")
        if self.profiler_warmup < 0:
            _fail("profiling", "profiler_warmup", self.profiler_warmup, "an integer >= 0")
        if self.profiler_warmup + self.profiler_active > self.profile_freq:
            _fail(
                "profiling",
                "profile_freq",
                self.profile_freq,
                f">= profiler_warmup + profiler_active = "
                f"{self.profiler_warmup + self.profiler_active}",
            )


@dataclass(kw_only=True)
class CheckpointConfig:
    """Distributed checkpointing with the checkpoint manager (``hp_trainer.CheckpointManager``).

    Checkpoints are DCP directories ``<dump_folder>/<run_name>/<folder>/step-N``. With
    ``enable`` set, a run resumes from the latest complete one (a corrupted latest is reported
    and the previous one is used), saves every ``interval`` steps and on SIGTERM.

    See Also:
        :titan:`torchtitan.config.job_config.Checkpoint`: TorchTitan's ``[checkpoint]`` section.
    """

    enable: bool = False
    """Save checkpoints and resume from the latest one in the checkpoint folder."""
    folder: str = "checkpoint"
    """Checkpoint folder inside the run folder (``step-N`` sub-folders)."""
    interval: int = 500
    """Save every this many steps (the last step is always saved)."""
    keep_latest_k: int = 10
    """Keep this many newest checkpoints and delete older ones (0 keeps all; the seed
    checkpoint ``step-0`` is never deleted)."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """Write checkpoints synchronously, in a background thread, or in the background from pinned
    host buffers (accelerators only)."""
    load_step: int = -1
    """Step to resume from (-1 means the latest complete checkpoint)."""
    initial_load_path: str | None = None
    """Checkpoint loaded when the checkpoint folder is empty (DCP, or HuggingFace safetensors
    with ``initial_load_in_hf``)."""
    initial_load_model_only: bool = True
    """Load only the model weights from ``initial_load_path``."""
    initial_load_in_hf: bool = False
    """Read ``initial_load_path`` as a HuggingFace safetensors checkpoint."""
    last_save_model_only: bool = True
    """Save only the model (in ``export_dtype``) at the last step."""
    last_save_in_hf: bool = False
    """Also export the last step as a HuggingFace checkpoint to ``step-N-hf``."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Data type of the model-only last save and of the HuggingFace export."""
    hf_max_shard_size: str = "5GB"
    """Largest safetensors file of the HuggingFace export (HF's ``max_shard_size``: ``"5GB"``,
    ``"500MiB"`` or bytes; a larger tensor gets a file of its own)."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """States not restored on resume (for instance ``dataloader,lr_scheduler``)."""
    create_seed_checkpoint: bool = False
    """Write the freshly initialized model as ``step-0`` and exit (single process), so that
    runs in any layout start from identical weights."""
    enable_first_step_checkpoint: bool = False
    """Also save after step 1."""

    def __post_init__(self) -> None:
        if self.interval < 1:
            _fail("checkpoint", "interval", self.interval, "an integer >= 1")
        if self.keep_latest_k < 0:
            _fail("checkpoint", "keep_latest_k", self.keep_latest_k, "an integer >= 0")
        if self.load_step < -1:
            _fail("checkpoint", "load_step", self.load_step, "-1 or a step >= 0")
        try:
            parse_size(self.hf_max_shard_size)
        except ValueError:
            allowed = "a positive size like '5GB', '500MiB' or bytes"
            _fail("checkpoint", "hf_max_shard_size", self.hf_max_shard_size, allowed)
        _check_literals(self, "checkpoint")


@dataclass(kw_only=True)
class JobConfig:
    """The whole configuration of a training job, one attribute per section.

    See Also:
        :titan:`torchtitan.config.job_config.JobConfig`: TorchTitan's monolithic job config.
    """

    job: JobSection = field(default_factory=JobSection)
    """General settings (run name, output folder, launcher)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model name and flavor."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Batch, sequence, steps, precision."""
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """Parallel degrees."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer."""
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    """Learning-rate schedule."""
    activation_checkpoint: ActivationCheckpointConfig = field(
        default_factory=ActivationCheckpointConfig
    )
    """Activation checkpointing."""
    compile: CompileConfig = field(default_factory=CompileConfig)
    """``torch.compile``."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Metrics and logging."""
    data: DataConfig = field(default_factory=DataConfig)
    """Dataset and tokenizer."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    """Validation loop."""
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    """Profiler traces and memory snapshots."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts overrides."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Hyper-offload of the optimizer to host memory."""
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    """Fault tolerance through torchft (replica groups, live recovery, LocalSGD/DiLoCo)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters (with ``model.converters = ["lora"]``)."""
    float8: Float8Config = field(default_factory=Float8Config)
    """Float8 training (with ``model.converters = ["float8"]``)."""
    mx: MXConfig = field(default_factory=MXConfig)
    """MXFP8 training (with ``model.converters = ["mx"]``)."""
    dsa: DSAConfig = field(default_factory=DSAConfig)
    """DeepSeek-V3.2's sparse-attention indexer training (``model.name = "deepseek_v32"``)."""

    def __post_init__(self) -> None:
        self._check_document_masking()
        self._check_attention_backend()
        self._check_dsa()
        self._check_param_offload()
        if self.moe.aux_loss_type == "sequence" and self.parallelism.context_parallel_degree > 1:
            _fail(
                "moe",
                "aux_loss_type",
                "sequence",
                "'batch' or 'model' with parallelism.context_parallel_degree = "
                f"{self.parallelism.context_parallel_degree} (the sequence-wise loss needs whole "
                "sequences on each rank)",
            )
        if self.activation_checkpoint.mode == "memory_budget" and not self.compile.enable:
            _fail(
                "activation_checkpoint",
                "mode",
                "memory_budget",
                "a mode other than memory_budget unless compile.enable = true (the budget is "
                "applied by torch.compile's partitioner)",
            )

    def _check_param_offload(self) -> None:
        """``offload.params`` runs in one process without sharded or compiled blocks."""
        if not self.offload.params:
            return
        par = self.parallelism
        for name in ("data_parallel_shard_degree", "data_parallel_replicate_degree",
                     "tensor_parallel_degree", "pipeline_parallel_degree",
                     "context_parallel_degree", "expert_parallel_degree"):  # fmt: skip
            if getattr(par, name) > 1:
                hint = " (under FSDP use training.enable_cpu_offload)" if "shard" in name else ""
                _fail("offload", "params", True,
                      f"false with parallelism.{name} = {getattr(par, name)}: parameter "
                      f"offload runs FSDP-free in one process{hint}")  # fmt: skip
        if self.training.enable_cpu_offload:
            _fail("offload", "params", True,
                  "false with training.enable_cpu_offload = true (FSDP's own offload)")  # fmt: skip
        if self.compile.enable:
            _fail("offload", "params", True,
                  "false with compile.enable = true (the per-block copies run in module hooks "
                  "that compiled blocks would trace)")  # fmt: skip
        if self.activation_checkpoint.mode == "swap":
            _fail("offload", "params", True,
                  "false with activation_checkpoint.mode = 'swap' (both keep a block's saved "
                  "tensors through saved-tensor hooks; use 'full' or 'selective')")  # fmt: skip

    def _check_dsa(self) -> None:
        """``[dsa]`` only with ``deepseek_v32``; the model family's own parse-time check (its
        ``ModelSpec.job_check``, e.g. DeepSeek-V3.2's)."""
        from hp_trainer.protocols.model_spec import get_model_spec

        defaults = DSAConfig()
        if self.model.name != "deepseek_v32":
            for name in ("indexer_stage", "indexer_loss_coeff"):
                value = getattr(self.dsa, name)
                if value != getattr(defaults, name):
                    _fail("dsa", name, value,
                          f"the default {getattr(defaults, name)!r} with model.name = "
                          f"{self.model.name!r}: the [dsa] options train DeepSeek-V3.2's "
                          "indexer (model.name = 'deepseek_v32')")  # fmt: skip
        try:
            spec = get_model_spec(self.model.name)
        except ValueError:
            return  # an unknown model is named when the model is resolved
        problem = spec.job_check(self) if spec.job_check is not None else None
        if problem is not None:
            _fail(*problem)

    def _check_attention_backend(self) -> None:
        """Refuse a backend that cannot run this job's attention, naming the alternative."""
        from hp_dtensor.device import get_device_type
        from hp_trainer.models.common.attention import backend_error

        backend = self.model.attn_backend
        if backend == "sdpa":
            return
        reason = backend_error(backend, device_type=get_device_type(), training=True)
        if reason is not None:
            _fail("model", "attn_backend", backend, f"a backend that runs here ({reason})")
        if self.parallelism.context_parallel_degree > 1:
            _fail("model", "attn_backend", backend,
                  "'sdpa' with parallelism.context_parallel_degree > 1 (the context-parallel "
                  "engine runs its own blockwise attention: it takes every mask spec, the "
                  "documents' ids and sinks, through sdpa)")  # fmt: skip

    def _check_document_masking(self) -> None:
        """Refuse the layouts that cannot carry the documents' mask to the attention."""
        if self.model.attn_mask_type != "block_causal":
            return
        par = self.parallelism
        if par.context_parallel_degree > 1 and par.pipeline_parallel_degree > 1:
            # the CP attention holds the ids of the whole local batch, the stages run slices
            _fail("model", "attn_mask_type", "block_causal",
                  "causal with both pipeline_parallel_degree and context_parallel_degree > 1 "
                  "(the context-parallel attention would get the ids of the whole local batch "
                  "for one pipeline micro-batch)")  # fmt: skip

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Return the configuration as nested plain dictionaries.

        Returns:
            ``{section: {field: value}}``.

        See Also:
            :titan:`torchtitan.config.configurable.Configurable.Config.to_dict`: TorchTitan's
            export.
        """
        return dataclasses.asdict(self)

    @property
    def run_folder(self) -> Path:
        """The folder this run writes to, ``<dump_folder>/<run_name>``.

        See Also:
            :titan:`torchtitan.config.job_config.Job.dump_folder`: TorchTitan's output folder.
        """
        return Path(self.job.dump_folder) / self.job.run_name


# --------------------------------------------------------------------------------------------
# Introspection helpers


_TYPE_HINTS: dict[type, dict[str, Any]] = {}


def _type_hints(cls: type) -> dict[str, Any]:
    # resolved once per section class: every config built re-checked its literals, and
    # get_type_hints evaluating the string annotations took ~28% of a 1024-rank hp-plan search
    hints = _TYPE_HINTS.get(cls)
    if hints is None:
        hints = _TYPE_HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _literal_choices(tp: Any) -> tuple[Any, ...] | None:
    tp, _ = _unwrap_optional(tp)
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    return None


def _field_docs(cls: type) -> dict[str, str]:
    """Map each field of a dataclass to the string literal written below it."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    tree = ast.parse(source)
    docs: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    inner, optional = _unwrap_optional(tp)
    choices = _literal_choices(inner)
    if choices is not None:
        name = "{" + ",".join(str(c) for c in choices) + "}"
    elif typing.get_origin(inner) is list:
        name = "list[" + _type_name(typing.get_args(inner)[0]) + "]"
    else:
        name = getattr(inner, "__name__", str(inner))
    return name + (" | None" if optional else "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert ``value`` (a string from the command line, or a file value) to type ``tp``."""
    inner, optional = _unwrap_optional(tp)
    if optional and (value is None or (isinstance(value, str) and value.lower() == "none")):
        return None
    choices = _literal_choices(inner)
    if choices is not None:
        for choice in choices:
            if value == choice or str(value) == str(choice):
                return choice
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"invalid config value {where} = {value!r}: expected one of {allowed}")
    if inner is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"invalid config value {where} = {value!r}: expected true or false")
    if inner is int:
        if isinstance(value, bool):
            raise ValueError(f"invalid config value {where} = {value!r}: expected an integer")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"invalid config value {where} = {value!r}: expected an integer"
            ) from None
    if inner is float:
        if isinstance(value, bool):
            raise ValueError(f"invalid config value {where} = {value!r}: expected a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"invalid config value {where} = {value!r}: expected a number"
            ) from None
    if inner is str:
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise ValueError(f"invalid config value {where} = {value!r}: expected a string")
        return str(value)
    if typing.get_origin(inner) is list:
        (item_tp,) = typing.get_args(inner)
        items = value.split(",") if isinstance(value, str) else list(value)
        return [_coerce(v.strip() if isinstance(v, str) else v, item_tp, where) for v in items]
    raise TypeError(f"unsupported config field type {tp!r} for {where}")  # pragma: no cover


def builtin_config_names() -> list[str]:
    """Names of the configs shipped with hp-trainer (usable as ``--config NAME``).

    Returns:
        Sorted config names (file stems under ``hp_trainer/configs``).

    See Also:
        :titan:`torchtitan.models.llama3.config_registry`: TorchTitan's registry of run configs.
    """
    return sorted(p.stem for p in _CONFIG_DIR.iterdir() if p.suffix in (".toml", ".yaml", ".yml"))


def _resolve_config_file(name: str) -> Path:
    path = Path(name)
    if path.is_file():
        return path
    for suffix in (".toml", ".yaml", ".yml"):
        candidate = _CONFIG_DIR / f"{name}{suffix}"
        if candidate.is_file():
            return candidate
    names = ", ".join(builtin_config_names())
    raise ValueError(
        f"config {name!r} is neither a file nor a shipped config; shipped configs: {names}"
    )


def _load_file(path: Path) -> dict[str, Any]:
    text = path.read_text()
    if path.suffix == ".toml":
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            try:
                import tomli as tomllib
            except ImportError as exc:
                raise ImportError(
                    "reading TOML configs on Python 3.10 needs 'tomli': pip install tomli"
                ) from exc
        data: Any = tomllib.loads(text)
    elif path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as exc:
            raise ImportError(
                f"reading the YAML config {path} needs PyYAML: pip install 'hp-trainer[yaml]'"
            ) from exc
        data = yaml.safe_load(text) or {}
    else:
        raise ValueError(f"config file {path} must end in .toml, .yaml or .yml")
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a table of sections, got {type(data)}")
    return data


class ConfigManager:
    """Build a :class:`JobConfig` from defaults, a TOML/YAML file and command-line overrides.

    Precedence is command line > config file > defaults. ``--config NAME`` (alias of
    ``--job.config_file``) selects a file or a shipped config; ``--section.field value`` or
    ``--section.field=value`` sets one field; a bare boolean flag ``--section.flag`` sets it true.

    Example:
        >>> cfg = ConfigManager().parse_args(["--training.steps", "3"])
        >>> cfg.training.steps
        3

    See Also:
        :titan:`torchtitan.config.ConfigManager`: TorchTitan's config loader.
    """

    def __init__(self, config_cls: type[JobConfig] = JobConfig) -> None:
        self.config_cls = config_cls
        self.config: JobConfig | None = None

    # -- public API ------------------------------------------------------------------------

    def parse_args(self, args: list[str] | None = None) -> JobConfig:
        """Parse command-line arguments into a validated :class:`JobConfig`.

        Args:
            args: Arguments without the program name (default: ``sys.argv[1:]``).

        Returns:
            The resolved configuration (also stored as ``self.config``).

        Raises:
            ValueError: For an unknown option, a bad value or a missing value; the message names
                the field, the value and what is allowed.

        See Also:
            :titan:`torchtitan.config.ConfigManager.parse_args`: TorchTitan's parser.
        """
        argv = list(sys.argv[1:] if args is None else args)
        if "--help" in argv or "-h" in argv:
            print(self.help_text())
            raise SystemExit(0)
        overrides = self._split_overrides(argv)
        config_file = overrides.pop("job.config_file", None)
        values: dict[str, dict[str, Any]] = {}
        if config_file is not None:
            path = _resolve_config_file(str(config_file))
            values = _load_file(path)
            values.setdefault("job", {})["config_file"] = str(path)
        for key, raw in overrides.items():
            section, name = key.split(".", 1)
            values.setdefault(section, {})[name] = raw
        self.config = self.from_dict(values)
        return self.config

    def from_dict(self, values: dict[str, Any]) -> JobConfig:
        """Build a :class:`JobConfig` from ``{section: {field: value}}``.

        Args:
            values: Section tables as read from TOML/YAML; values may be strings (coerced).

        Returns:
            The validated configuration.

        Raises:
            ValueError: For unknown sections/fields or invalid values.

        See Also:
            :titan:`torchtitan.config.ConfigManager`: TorchTitan's TOML merge.
        """
        hints = _type_hints(self.config_cls)
        sections: dict[str, Any] = {}
        for section, table in values.items():
            if section not in hints:
                raise ValueError(
                    f"unknown config section {section!r}"
                    + self._suggest(section, list(hints))
                    + f"; sections: {', '.join(hints)}"
                )
            if not isinstance(table, dict):
                raise ValueError(f"config section {section!r} must be a table, got {table!r}")
            section_cls = hints[section]
            field_hints = _type_hints(section_cls)
            kwargs: dict[str, Any] = {}
            for name, raw in table.items():
                if name not in field_hints:
                    raise ValueError(
                        f"unknown config field {section}.{name}"
                        + self._suggest(name, list(field_hints), prefix=f"{section}.")
                        + f"; fields of [{section}]: {', '.join(field_hints)}"
                    )
                kwargs[name] = _coerce(raw, field_hints[name], f"{section}.{name}")
            sections[section] = section_cls(**kwargs)
        return self.config_cls(**sections)

    def help_text(self) -> str:
        """Return the ``--help`` text: every field with its type, default and docstring.

        Returns:
            Multi-line help text.

        See Also:
            :titan:`torchtitan.config.ConfigManager`: TorchTitan's tyro-generated help.
        """
        lines = [
            "usage: hp-train [--config NAME_OR_FILE] [--nproc N] [--section.field VALUE ...]",
            "",
            "Train a language model with hyper-parallel (FSDP/HSDP, TP) on any number of ranks.",
            "Values: command line > config file (TOML or YAML) > defaults shown below.",
            "",
            "  --config NAME_OR_FILE  alias of --job.config_file; shipped configs: "
            + ", ".join(builtin_config_names()),
            "  --nproc N              alias of --job.nproc_per_node",
        ]
        hints = _type_hints(self.config_cls)
        defaults = self.config_cls()
        for section, section_cls in hints.items():
            lines.append("")
            lines.append(f"[{section}] {(inspect.getdoc(section_cls) or '').splitlines()[0]}")
            docs = _field_docs(section_cls)
            for f in dataclasses.fields(section_cls):
                default = getattr(getattr(defaults, section), f.name)
                tp = _type_name(_type_hints(section_cls)[f.name])
                lines.append(f"  --{section}.{f.name} {tp} (default: {default!r})")
                for wrapped in textwrap.wrap(docs.get(f.name, ""), 88):
                    lines.append(f"      {wrapped}")
        return "\n".join(lines)

    # -- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _suggest(name: str, options: list[str], prefix: str = "") -> str:
        close = difflib.get_close_matches(name, options, n=1)
        return f" (did you mean {prefix}{close[0]}?)" if close else ""

    def _split_overrides(self, argv: list[str]) -> dict[str, Any]:
        hints = _type_hints(self.config_cls)
        out: dict[str, Any] = {}
        i = 0
        while i < len(argv):
            arg = argv[i]
            if not arg.startswith("--"):
                raise ValueError(f"unexpected argument {arg!r}: options look like --section.field")
            key, eq, inline = arg[2:].partition("=")
            key = key.replace("-", "_")
            if key == "config":
                key = "job.config_file"
            elif key == "nproc":
                key = "job.nproc_per_node"
            if "." not in key:
                raise ValueError(
                    f"unknown option --{key}: options look like --section.field "
                    f"(sections: {', '.join(hints)}), --config or --nproc"
                )
            section, name = key.split(".", 1)
            field_tp: Any = None
            if section in hints:
                field_tp = _type_hints(hints[section]).get(name)
            if eq:
                value: Any = inline
                i += 1
            elif (
                field_tp is not None
                and _unwrap_optional(field_tp)[0] is bool
                and (i + 1 >= len(argv) or argv[i + 1].startswith("--"))
            ):
                value = True
                i += 1
            else:
                if i + 1 >= len(argv):
                    raise ValueError(f"option --{key} needs a value")
                value = argv[i + 1]
                i += 2
            out[key] = value
        return out


def parse_args(args: list[str] | None = None) -> JobConfig:
    """Parse command-line arguments into a :class:`JobConfig` (HyperParallel's entry name).

    Args:
        args: Arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The resolved configuration.

    See Also:
        :titan:`torchtitan.config.ConfigManager.parse_args`: TorchTitan's equivalent.
    """
    return ConfigManager().parse_args(args)
