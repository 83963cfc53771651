"""The search: every valid layout of a model on a world size, pruned symbolically, ranked.

Enumeration runs over the divisors of the world size (pp, tp, cp, dp_replicate, dp_shard, and
ep among the divisors of ``dp_shard * cp * tp``). Pruned before any estimate: degrees that do
not divide the heads, the sequence or the experts; TP wider than a node (its collectives are
exposed, so a cross-node TP never wins); HSDP whose shard group does not fill whole nodes (the
replicas would share a node's links); more pipeline stages than the model has parts; layouts
whose parameters, gradients and optimizer state alone exceed the memory limit (a lower bound no
schedule or AC mode can reduce; they are kept as "closest" candidates for the report). Every
structure left is checked by the trainer's own ``validate_parallel_layout``
(the message of a refusal becomes the candidate's "why"), then expanded over the pipeline
schedules, micro-batch sizes, AC modes and offload (the optimizer; on one rank the parameters)
and estimated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hp_trainer.planner.cost import LayoutCandidate, LayoutEstimate, estimate_layout
from hp_trainer.planner.model_stats import ModelStats, model_stats
from hp_trainer.planner.profiles import DeviceProfile, load_device_profile

__all__ = ["PlanResult", "RejectedLayout", "plan_layouts"]

_GIB = 2**30
PP_SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
AC_MODES = ("none", "selective", "full")


def _offload_label(c: LayoutCandidate) -> str:
    return "params" if c.offload_params else "opt" if c.offload_optimizer else "-"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class RejectedLayout:
    """A layout that cannot run, and why.

    Attributes:
        candidate: The layout.
        why: The reason (the validation message, or the memory shortfall).
        shortfall: Bytes over the memory limit (0 for a divisibility refusal).
    """

    candidate: LayoutCandidate
    why: str
    shortfall: float = 0.0


@dataclass
class PlanResult:
    """What :func:`plan_layouts` found.

    Attributes:
        model: The model statistics.
        profile: The device profile.
        world_size: Ranks.
        memory_limit: Bytes per device.
        estimates: Every estimated layout, best first (those that fit first, then by
            tokens/s).
        rejected: Layouts refused before estimation (validation or memory lower bound).
        structures: Degree combinations enumerated (before pruning).
        seconds: Wall time of the search.
    """

    model: ModelStats
    profile: DeviceProfile
    world_size: int
    memory_limit: float
    estimates: list[LayoutEstimate] = field(default_factory=list)
    rejected: list[RejectedLayout] = field(default_factory=list)
    structures: int = 0
    seconds: float = 0.0

    @property
    def feasible(self) -> list[LayoutEstimate]:
        """The estimates that fit in memory, best first."""
        return [e for e in self.estimates if e.fits]

    @property
    def best(self) -> LayoutEstimate | None:
        """The fastest layout that fits, or None."""
        feasible = self.feasible
        return feasible[0] if feasible else None

    def closest(self, n: int = 10) -> list[tuple[LayoutCandidate, str, float]]:
        """When nothing fits: the ``n`` layouts nearest to fitting, with what each lacks."""
        near = [(e.candidate, e.why, e.peak_memory - self.memory_limit) for e in self.estimates]
        near += [(r.candidate, r.why, r.shortfall) for r in self.rejected if r.shortfall > 0]
        near.sort(key=lambda x: x[2])
        if len(near) < n:
            near += [(r.candidate, r.why, 0.0) for r in self.rejected if r.shortfall == 0]
        return near[:n]

    def table(self, top: int = 15) -> str:
        """The ranked table as text (or the closest candidates when nothing fits)."""
        head = (
            f"{'#':>3}  {'layout':<40} {'AC':<9} {'offload':<7} {'step s':>9} "
            f"{'tok/s/dev':>10} {'MFU':>6} {'peak GiB':>9}  fits  why"
        )
        lines = [head, "-" * len(head)]
        rows = self.estimates[:top] if self.feasible else []
        for i, e in enumerate(rows, 1):
            c = e.candidate
            lines.append(
                f"{i:>3}  {c.label():<40} {c.ac:<9} {_offload_label(c):<7} "
                f"{e.step_time:>9.3f} {e.tokens_per_second_per_device:>10.1f} "
                f"{100 * e.mfu:>5.1f}% {e.peak_memory / _GIB:>9.2f}  {'yes' if e.fits else 'no':<4}"
                f"  {e.why}"
            )
        if not self.feasible:
            lines.append(
                f"no layout of {self.model.name} fits {self.world_size} x "
                f"{self.profile.name} at {self.memory_limit / _GIB:.1f} GiB; the closest:"
            )
            for c, why, _ in self.closest():
                lines.append(f"     {c.label():<40} {c.ac:<9} {_offload_label(c):<7} {why}")
            # what the structures refused before any estimate lack (divisibility, the
            # trainer's validation), one line per distinct reason
            reasons: dict[str, LayoutCandidate] = {}
            for r in self.rejected:
                if r.shortfall == 0 and r.why not in reasons:
                    reasons[r.why] = r.candidate
            if reasons:
                lines.append(f"refused before estimation ({len(reasons)} distinct reasons):")
                for why, c in list(reasons.items())[:5]:
                    lines.append(f"     {c.label():<40} {why}")
        return "\n".join(lines)


def _fail_reason(config: Any, world_size: int, args: Any) -> str | None:
    from hp_trainer.distributed.layout_validation import validate_parallel_layout

    try:
        validate_parallel_layout(config, world_size, args)
    except ValueError as exc:
        return str(exc).removeprefix("invalid parallel layout: ")
    return None


def _base_job(model: str, flavor: str, seq_len: int) -> Any:
    from hp_trainer.config import JobConfig, ModelConfig, TrainingConfig

    return JobConfig(
        model=ModelConfig(name=model, flavor=flavor), training=TrainingConfig(seq_len=seq_len)
    )


def _job(base_job: Any, local_batch: int, mb: int, c: LayoutCandidate, schedule: str) -> Any:
    """``base_job`` with this layout (only the changed sections are rebuilt: a JobConfig with
    every section from its defaults costs a type-hint walk per section)."""
    from hp_trainer.config import ParallelismConfig

    return dataclasses.replace(
        base_job,
        training=dataclasses.replace(base_job.training, local_batch_size=local_batch),
        parallelism=ParallelismConfig(
            data_parallel_replicate_degree=c.dp_replicate,
            data_parallel_shard_degree=c.dp_shard,
            tensor_parallel_degree=c.tp,
            pipeline_parallel_degree=c.pp,
            context_parallel_degree=c.cp,
            expert_parallel_degree=c.ep,
            pipeline_parallel_schedule=schedule,
            pipeline_parallel_microbatch_size=mb,
        ),
    )


def plan_layouts(
    model: str,
    flavor: str,
    world_size: int,
    device: str | DeviceProfile,
    *,
    seq_len: int = 8192,
    global_batch_size: int | None = None,
    memory_limit: float | None = None,
    optimizer: str = "AdamW",
    ac_modes: Sequence[str] = AC_MODES,
    schedules: Sequence[str] = PP_SCHEDULES,
    offload: bool = True,
    max_cp: int = 8,
    compute_dtype_bytes: int = 2,
) -> PlanResult:
    """Enumerate, validate, estimate and rank the layouts of ``model`` on ``world_size`` ranks.

    Args:
        model: A registered model name.
        flavor: Its flavor.
        world_size: Ranks.
        device: A profile name (``h100``, ``h200``, ``ascend910b``, ``cpu``), a profile path,
            or a :class:`~hp_trainer.planner.DeviceProfile`.
        seq_len: Tokens per sample.
        global_batch_size: Samples per optimizer step over all ranks (default: 2 per rank);
            each layout's local batch is this over its data-parallel degree.
        memory_limit: Bytes per device (default: the profile's memory).
        optimizer: Optimizer name (its state size).
        ac_modes: Activation-checkpointing modes to consider.
        schedules: Pipeline schedules to consider.
        offload: Also consider optimizer offload, and on one rank parameter offload
            (``offload.params``, which runs without FSDP or any other parallelism).
        max_cp: Largest context-parallel degree considered.
        compute_dtype_bytes: 2 (bf16 mixed precision) or 4 (fp32).

    Returns:
        The ranked estimates and the refused layouts (never empty when nothing fits: see
        :meth:`~hp_trainer.planner.PlanResult.closest`).

    Raises:
        ValueError: An unknown device profile, model or flavor, or a non-positive size.

    See Also:
        :func:`hp_pp.simulate_schedule`: the pipeline simulator the estimates use.
    """
    import time

    from hp_trainer.protocols.model_spec import get_model_spec

    start = time.perf_counter()
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len!r}")
    profile = device if isinstance(device, DeviceProfile) else load_device_profile(device)
    limit = float(profile.memory_bytes if memory_limit is None else memory_limit)
    spec = get_model_spec(model)
    args = spec.model_args(flavor)
    stats = model_stats(model, flavor, seq_len)
    gbs = 2 * world_size if global_batch_size is None else global_batch_size
    if gbs < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {gbs!r}")
    result = PlanResult(stats, profile, world_size, limit)
    base_job = _base_job(model, flavor, seq_len)
    heads = (stats.n_heads, stats.n_kv_heads)
    for pp in _divisors(world_size):
        if pp > 1 and pp * 1 > stats.n_layers + 2:
            continue
        for tp in _divisors(world_size // pp):
            rest_tp = world_size // (pp * tp)
            for cp in _divisors(rest_tp):
                if cp > max_cp:
                    continue
                for rep in _divisors(rest_tp // cp):
                    shard = rest_tp // (cp * rep)
                    if rep > 1 and (shard * cp * tp) % profile.devices_per_node:
                        continue  # HSDP replicates across nodes: its shard group fills nodes
                    eps = [1]
                    if stats.is_moe:
                        eps = [e for e in _divisors(shard * cp * tp) if stats.num_experts % e == 0]
                    for ep in eps:
                        result.structures += 1
                        base = LayoutCandidate(
                            dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, cp=cp, ep=ep,
                            seq_len=seq_len, compute_dtype_bytes=compute_dtype_bytes,
                        )  # fmt: skip
                        _expand(result, base, base_job, args, gbs, heads, optimizer,
                                ac_modes, schedules, offload)  # fmt: skip
    result.estimates.sort(key=lambda e: (not e.fits, -e.tokens_per_second))
    result.seconds = time.perf_counter() - start
    return result


def _expand(result: PlanResult, base: LayoutCandidate, base_job: Any, args: Any,
            gbs: int, heads: tuple[int, int], optimizer: str, ac_modes: Sequence[str],
            schedules: Sequence[str], offload: bool) -> None:  # fmt: skip
    """Validate one degree structure, then estimate its options."""
    stats, profile, limit = result.model, result.profile, result.memory_limit
    dp = base.dp
    why = None
    if base.tp > profile.devices_per_node:
        return  # symbolic prune: a cross-node TP is never the best (its traffic is exposed)
    if any(h % base.tp for h in heads):
        why = f"tensor_parallel_degree {base.tp} does not divide the heads {heads}"
    elif gbs % dp:
        why = f"global batch {gbs} is not a multiple of the data-parallel degree {dp}"
    if why is not None:
        result.rejected.append(RejectedLayout(base, why))
        return
    local = gbs // dp
    # memory lower bound: the shard of parameters + gradients (+ optimizer, unless offloaded)
    shard = base.dp_shard * base.cp * base.tp
    layers = -(-stats.n_layers // base.pp)
    stage = layers * (max(stats.layer_dense_params) + max(stats.layer_expert_params))
    param_offload = offload and result.world_size == 1  # offload.params: one process only
    per_param = 8 if offload else 8 + 4 * {"SGD": 0, "Muon": 1}.get(optimizer, 2)
    # with parameter offload only the largest block is resident (its compute-dtype copy)
    bound = (
        (stage / layers * base.compute_dtype_bytes) if param_offload else per_param * stage / shard
    )
    if bound > limit:
        result.rejected.append(
            RejectedLayout(
                dataclasses.replace(base, local_batch_size=local),
                f"memory short by {(bound - limit) / _GIB:.2f} GiB before activations "
                "(parameters, gradients, optimizer state)",
                bound - limit,
            )
        )
        return
    pp_opts: list[tuple[str, int]] = [("1F1B", local)]
    if base.pp > 1:
        pp_opts = [(s, mb) for s in schedules for mb in _divisors(local) if mb <= 2]
    checked: dict[int, str | None] = {}
    for schedule, mb in pp_opts:
        from hp_trainer.distributed.pipeline import stages_per_rank_of

        key = int(stages_per_rank_of(schedule))
        if key not in checked:  # micro-batch size 1 here; its divisibility is ours below
            job = _job(base_job, local, 1, base, schedule)
            checked[key] = _fail_reason(job, result.world_size, args)
        reason = checked[key]
        cand = dataclasses.replace(base, schedule=schedule, microbatch_size=mb,
                                   local_batch_size=local)  # fmt: skip
        if reason is not None:
            result.rejected.append(RejectedLayout(cand, reason))
            continue
        if base.pp > 1 and local // mb < base.pp:
            continue  # fewer micro-batches than stages: the pipeline never fills
        # AC and offload never make a step faster in this model: a stronger option is
        # estimated only when the weaker ones do not fit
        done = False
        tiers = [(False, False)] + [(True, False)] * offload + [(False, True)] * param_offload
        for off_optimizer, off_params in tiers:
            for ac in ac_modes:
                if off_params and ac == "swap":
                    continue  # both hold a block's saved tensors through saved-tensor hooks
                c = dataclasses.replace(
                    cand,
                    ac=ac,  # type: ignore[arg-type]
                    offload_optimizer=off_optimizer,
                    offload_params=off_params,
                )
                e = estimate_layout(stats, c, profile, memory_limit=limit, optimizer=optimizer)
                result.estimates.append(e)
                if e.fits:
                    done = True
                    break
            if done:
                break
