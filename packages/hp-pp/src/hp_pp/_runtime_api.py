"""Public names of the runtime side: stages, micro-batching, executor, schedule classes, split."""

from hp_pp.executor import PipelineExecutor, TransposedPreprocess
from hp_pp.microbatch import TensorChunkSpec, merge_chunks, split_args_kwargs_into_chunks
from hp_pp.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleRuntime,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleMPipe,
    ScheduleZBVZeroBubble,
    get_schedule_class,
)
from hp_pp.split import (
    generate_llm_fqn_per_model_part,
    pipeline_llm,
    pipeline_module_split,
    split_module_by_fqns,
)
from hp_pp.stage import PipelineStage
from hp_pp.traced import Pipe, SplitPoint, build_stage, pipe_split, pipeline

__all__ = [
    "Pipe",
    "PipelineExecutor",
    "PipelineScheduleMulti",
    "PipelineScheduleRuntime",
    "PipelineScheduleSingle",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleMPipe",
    "ScheduleZBVZeroBubble",
    "SplitPoint",
    "TensorChunkSpec",
    "TransposedPreprocess",
    "build_stage",
    "generate_llm_fqn_per_model_part",
    "get_schedule_class",
    "merge_chunks",
    "pipe_split",
    "pipeline",
    "pipeline_llm",
    "pipeline_module_split",
    "split_args_kwargs_into_chunks",
    "split_module_by_fqns",
]
