"""TorchTitan-style training orchestration and the ``hp-train`` command.

Config (TOML/YAML + ``--section.field`` overrides), ``ParallelDims``, the ``ModelSpec``
registry with Llama 3 and Qwen 3, the parallelize helpers (TP -> AC -> compile -> FSDP), the
training loop, metrics, data and the ``hp-train`` launcher.

See Also:
    :titan:`torchtitan.train.Trainer`: TorchTitan's trainer.
"""

from hp_trainer.__about__ import __version__
from hp_trainer.callbacks import Callback, MetricsCallback, ProfilerCallback
from hp_trainer.components.checkpoint import (
    CheckpointManager,
    LRSchedulersState,
    ModelWrapper,
    OptimizersWrapper,
    RNGState,
)
from hp_trainer.components.converters import (
    ModelConverter,
    ModelConvertersContainer,
    build_model_converters,
    register_model_converter,
)
from hp_trainer.components.converters.float8 import Float8Converter
from hp_trainer.components.converters.lora import LoRAConverter
from hp_trainer.components.converters.mx import MXConverter
from hp_trainer.components.data.dataset import (
    ParallelAwareDataloader,
    TokenizedDataset,
    load_documents,
)
from hp_trainer.components.data.streaming import StreamingTextLoader
from hp_trainer.components.expert_load import ExpertLoadTracker
from hp_trainer.components.ft import FTManager
from hp_trainer.components.hf_io.adapters import DecoderStateDictAdapter, StateDictAdapter
from hp_trainer.components.lr import LRSchedulersContainer, build_lr_schedulers, lr_factor
from hp_trainer.components.metrics import MetricsProcessor, get_peak_flops
from hp_trainer.components.optimizer import (
    Muon,
    OptimizersContainer,
    build_optimizers,
    get_hyper_optimizer,
)
from hp_trainer.components.tokenizer import HuggingFaceTokenizer, build_tokenizer
from hp_trainer.config import (
    ActivationCheckpointConfig,
    CheckpointConfig,
    CompileConfig,
    ConfigManager,
    DataConfig,
    DSAConfig,
    FaultToleranceConfig,
    JobConfig,
    JobSection,
    LoRAConfig,
    LRSchedulerConfig,
    MetricsConfig,
    ModelConfig,
    MoEConfig,
    OffloadConfig,
    OptimizerConfig,
    ParallelismConfig,
    ProfilingConfig,
    TrainingConfig,
    ValidationConfig,
    builtin_config_names,
    parse_args,
)
from hp_trainer.distributed.activation_checkpoint import (
    apply_ac,
    checkpoint,
    checkpoint_wrapper,
    swap,
    swap_wrapper,
)
from hp_trainer.distributed.compile import apply_compile
from hp_trainer.distributed.context_parallel import create_context_parallel_ctx
from hp_trainer.distributed.fsdp import (
    apply_fsdp_to_decoder,
    disable_fsdp_gradient_division,
    enable_fsdp_symm_mem,
    get_fsdp_reshard_after_forward_policy,
)
from hp_trainer.distributed.offload import OffloadedOptimizersContainer, offload_optimizers
from hp_trainer.distributed.parallel_dims import ParallelDims
from hp_trainer.distributed.sharding import apply_sharding
from hp_trainer.distributed.swap import CheckpointPolicy, HostBufferPool, SwapManager
from hp_trainer.models.common.attention import AttentionMasks, MaskSpec
from hp_trainer.models.common.decoder import Decoder, DecoderArgs
from hp_trainer.models.common.expert_parallel import apply_moe_ep_tp
from hp_trainer.models.common.moe_decoder import MoEDecoderArgs
from hp_trainer.models.common.tensor_parallel import apply_tp
from hp_trainer.models.deepseek_v3 import (
    DeepSeekV3,
    DeepSeekV3Args,
    DeepSeekV3StateDictAdapter,
    parallelize_deepseek_v3,
)
from hp_trainer.models.deepseek_v32 import (
    DeepSeekV32,
    DeepSeekV32Args,
    DeepSeekV32StateDictAdapter,
    parallelize_deepseek_v32,
)
from hp_trainer.models.gpt_oss import (
    GptOss,
    GptOssArgs,
    GptOssStateDictAdapter,
    parallelize_gpt_oss,
)
from hp_trainer.models.llama3 import Llama3StateDictAdapter, parallelize_llama
from hp_trainer.models.llama4 import Llama4, Llama4Args, Llama4StateDictAdapter, parallelize_llama4
from hp_trainer.models.qwen3 import Qwen3StateDictAdapter, parallelize_qwen3
from hp_trainer.models.qwen3_5 import (
    Qwen35,
    Qwen35Moe,
    Qwen35MoeStateDictAdapter,
    Qwen35StateDictAdapter,
    parallelize_qwen3_5,
)
from hp_trainer.models.qwen3_moe import Qwen3MoE, Qwen3MoeStateDictAdapter, parallelize_qwen3_moe
from hp_trainer.planner import (
    DeviceProfile,
    LayoutCandidate,
    LayoutEstimate,
    estimate_layout,
    load_device_profile,
    plan_layouts,
)
from hp_trainer.protocols.model_spec import (
    ModelSpec,
    get_model_spec,
    list_model_specs,
    register_model_spec,
    register_spec,
)
from hp_trainer.protocols.sharding import ShardingConfig, ShardingRule
from hp_trainer.trainer import BaseTrainer, LLMTrainer, Trainer, clip_grad_norm_

HyperTrainerConfig = JobConfig
"""HyperParallel's name for :class:`~hp_trainer.config.JobConfig`."""

__all__ = [
    "ActivationCheckpointConfig",
    "AttentionMasks",
    "BaseTrainer",
    "Callback",
    "CheckpointConfig",
    "CheckpointManager",
    "CheckpointPolicy",
    "CompileConfig",
    "ConfigManager",
    "DSAConfig",
    "DataConfig",
    "Decoder",
    "DecoderArgs",
    "DecoderStateDictAdapter",
    "DeepSeekV3",
    "DeepSeekV3Args",
    "DeepSeekV3StateDictAdapter",
    "DeepSeekV32",
    "DeepSeekV32Args",
    "DeepSeekV32StateDictAdapter",
    "DeviceProfile",
    "ExpertLoadTracker",
    "FTManager",
    "FaultToleranceConfig",
    "Float8Converter",
    "GptOss",
    "GptOssArgs",
    "GptOssStateDictAdapter",
    "HostBufferPool",
    "HuggingFaceTokenizer",
    "HyperTrainerConfig",
    "JobConfig",
    "JobSection",
    "LLMTrainer",
    "LRSchedulerConfig",
    "LRSchedulersContainer",
    "LRSchedulersState",
    "LayoutCandidate",
    "LayoutEstimate",
    "Llama3StateDictAdapter",
    "Llama4",
    "Llama4Args",
    "Llama4StateDictAdapter",
    "LoRAConfig",
    "LoRAConverter",
    "MXConverter",
    "MaskSpec",
    "MetricsCallback",
    "MetricsConfig",
    "MetricsProcessor",
    "MoEConfig",
    "MoEDecoderArgs",
    "ModelConfig",
    "ModelConverter",
    "ModelConvertersContainer",
    "ModelSpec",
    "ModelWrapper",
    "Muon",
    "OffloadConfig",
    "OffloadedOptimizersContainer",
    "OptimizerConfig",
    "OptimizersContainer",
    "OptimizersWrapper",
    "ParallelAwareDataloader",
    "ParallelDims",
    "ParallelismConfig",
    "ProfilerCallback",
    "ProfilingConfig",
    "Qwen3MoE",
    "Qwen3MoeStateDictAdapter",
    "Qwen3StateDictAdapter",
    "Qwen35",
    "Qwen35Moe",
    "Qwen35MoeStateDictAdapter",
    "Qwen35StateDictAdapter",
    "RNGState",
    "ShardingConfig",
    "ShardingRule",
    "StateDictAdapter",
    "StreamingTextLoader",
    "SwapManager",
    "TokenizedDataset",
    "Trainer",
    "TrainingConfig",
    "ValidationConfig",
    "__version__",
    "apply_ac",
    "apply_compile",
    "apply_fsdp_to_decoder",
    "apply_moe_ep_tp",
    "apply_sharding",
    "apply_tp",
    "build_lr_schedulers",
    "build_model_converters",
    "build_optimizers",
    "build_tokenizer",
    "builtin_config_names",
    "checkpoint",
    "checkpoint_wrapper",
    "clip_grad_norm_",
    "create_context_parallel_ctx",
    "disable_fsdp_gradient_division",
    "enable_fsdp_symm_mem",
    "estimate_layout",
    "get_fsdp_reshard_after_forward_policy",
    "get_hyper_optimizer",
    "get_model_spec",
    "get_peak_flops",
    "list_model_specs",
    "load_device_profile",
    "load_documents",
    "lr_factor",
    "offload_optimizers",
    "parallelize_deepseek_v3",
    "parallelize_deepseek_v32",
    "parallelize_gpt_oss",
    "parallelize_llama",
    "parallelize_llama4",
    "parallelize_qwen3",
    "parallelize_qwen3_5",
    "parallelize_qwen3_moe",
    "parse_args",
    "plan_layouts",
    "register_model_converter",
    "register_model_spec",
    "register_spec",
    "swap",
    "swap_wrapper",
]
