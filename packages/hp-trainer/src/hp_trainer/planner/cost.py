"""The cost model: predicted step time and peak memory per rank of one layout.

Time. Compute is the model's training FLOPs on this rank's share (tokens / cp, layers / pp,
matmuls / tp, plus the forward again for recomputed blocks) at the profile's sustained FLOP rate,
plus a fixed launch cost per operator (and DTensor's host cost per operator under TP). Each
collective costs ``alpha + bytes / bus bandwidth``
(ring all-gather / reduce-scatter move ``(n - 1) / n`` of the gathered bytes, all-reduce twice
that, all-to-all ``(n - 1) / n`` of the exchanged bytes), on the intra-node link when its group
fits in a node and on the network otherwise (mesh order, innermost first: tp, cp, dp_shard,
dp_replicate, pp; EP groups are the innermost ranks). Overlap rules: FSDP/HSDP gathers and
gradient reductions run behind compute except one block's worth at each end of the pass; TP,
CP and EP collectives are exposed (they sit between the operators that need them); pipeline
transfers and bubbles come from hp-pp's simulator (:func:`hp_pp.simulate_schedule`) run on
the schedule's own action table with the stage costs; swapped activations and offloaded
optimizer states move over the host link, swap behind compute, offload exposed.

Memory (bytes per rank, the worst pipeline stage): parameters, gradients and optimizer state of
this rank's shard (fp32 master weights; AdamW keeps two fp32 moments); gathered parameters
(FSDP: two blocks in the compute dtype, all of the stage when pipeline parallel keeps them);
autocast's weight casts without FSDP; activations per micro-batch per block
(``ModelStats.layer_act_bytes``: elements in the compute dtype plus a MoE router's float32 and
int64 bytes, per token), times the micro-batches the schedule keeps in flight (the simulator's
peak), with AC keeping only block inputs and one block in full; the loss's backward (logits and
float32 tensors); the TP / CP / EP communication buffers (EP's in a block's backward); the
optimizer step's temporaries. Without pipeline parallelism the peak is the largest of three
moments: the loss, a block's backward, the optimizer step. With it, a micro-batch's loss and
backward overlap the other micro-batches in flight, so the terms add up; gradients persist
across micro-batches. ``docs/planner.rst`` states each term and how it is checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

from hp_trainer.planner.model_stats import ModelStats
from hp_trainer.planner.profiles import DeviceProfile

__all__ = ["LayoutCandidate", "LayoutEstimate", "estimate_layout"]

_GIB = 2**30
ACMode = Literal["none", "selective", "full", "swap"]


@dataclass(frozen=True, kw_only=True)
class LayoutCandidate:
    """One point of the search space: degrees, schedule, batch split, AC and offload.

    Attributes:
        dp_replicate: HSDP replicas.
        dp_shard: FSDP shard degree.
        tp: Tensor-parallel degree.
        pp: Pipeline-parallel degree.
        cp: Context-parallel degree.
        ep: Expert-parallel degree (borrowed from ``dp_shard * cp * tp``).
        schedule: Pipeline schedule (ignored when ``pp == 1``).
        microbatch_size: Samples per pipeline micro-batch.
        local_batch_size: Samples per data-parallel rank per step.
        seq_len: Tokens per sample.
        ac: Activation checkpointing: ``none``, ``selective`` (every second block), ``full``
            or ``swap`` (activations to host memory).
        offload_optimizer: Optimizer state on the host, the step run there.
        offload_params: Parameters and gradients on the host, copied in per block for forward
            and backward (about two blocks and the embedding or head on the device); the
            optimizer then steps on the host.
        compute_dtype_bytes: Bytes per element of the compute dtype (2: bf16, 4: fp32).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    schedule: str = "1F1B"
    microbatch_size: int = 1
    local_batch_size: int = 1
    seq_len: int = 2048
    ac: ACMode = "none"
    offload_optimizer: bool = False
    compute_dtype_bytes: int = 2
    offload_params: bool = False

    @property
    def world_size(self) -> int:
        """Ranks of the layout."""
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel degree."""
        return self.dp_replicate * self.dp_shard

    def label(self) -> str:
        """A short description, e.g. ``fsdp8 tp8 pp4 Interleaved1F1B mb1``."""
        parts = []
        for name, value in (
            ("hsdp", self.dp_replicate),
            ("fsdp", self.dp_shard),
            ("tp", self.tp),
            ("cp", self.cp),
            ("ep", self.ep),
            ("pp", self.pp),
        ):
            if value > 1:
                parts.append(f"{name}{value}")
        if self.pp > 1:
            parts.append(f"{self.schedule} mb{self.microbatch_size}")
        return " ".join(parts) or "single"  # fmt: skip


@dataclass(frozen=True)
class LayoutEstimate:
    """The prediction for one :class:`LayoutCandidate`.

    Attributes:
        candidate: The layout.
        step_time: Predicted seconds per optimizer step.
        tokens_per_second: Global tokens per second.
        tokens_per_second_per_device: ``tokens_per_second / world_size``.
        mfu: Model FLOPs utilisation (the trainer's formula, peak of the profile).
        peak_memory: Predicted peak bytes on the worst rank.
        memory: Peak memory by part, bytes.
        time: Step time by part, seconds.
        fits: ``peak_memory <= memory limit``.
        why: Empty when it fits, else what it lacks.
        host_memory: Host bytes per device (offloaded state, swapped activations).
    """

    candidate: LayoutCandidate
    step_time: float
    tokens_per_second: float
    tokens_per_second_per_device: float
    mfu: float
    peak_memory: float
    memory: dict[str, float] = field(default_factory=dict)
    time: dict[str, float] = field(default_factory=dict)
    fits: bool = True
    why: str = ""
    host_memory: float = 0.0


@lru_cache(maxsize=64)
def _stages_per_rank(schedule: str) -> int:
    from hp_trainer.distributed.pipeline import stages_per_rank_of

    return int(stages_per_rank_of(schedule))


def _link(profile: DeviceProfile, span: int) -> tuple[float, float]:
    """(latency, bus bandwidth) of a group whose ranks span ``span`` consecutive ranks."""
    if span <= profile.devices_per_node:
        return profile.intra_node_latency, (
            profile.intra_node_bandwidth * profile.intra_node_efficiency
        )
    return profile.inter_node_latency, profile.inter_node_bandwidth * profile.inter_node_efficiency


def _ring(n: int, nbytes: float, alpha: float, beta: float) -> float:
    """All-gather or reduce-scatter of ``nbytes`` gathered bytes over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return (n - 1) * alpha + nbytes * (n - 1) / n / beta


@lru_cache(maxsize=4096)
def _pipeline_unit(
    schedule: str, pp: int, n_mb: int, backward: float, transfer: float
) -> tuple[float, float]:
    """(step time, peak in-flight micro-batch activations of the busiest rank in stage units)
    of ``schedule`` with a unit forward per stage; the result scales with the forward cost."""
    import hp_pp

    v = _stages_per_rank(schedule)
    table = hp_pp.generate_schedule(schedule, pp_size=pp, num_stages=pp * v, n_microbatches=n_mb)
    costs = hp_pp.PipelineCosts(
        default=hp_pp.StageCosts(1.0, backward / 2, backward / 2, backward, 1.0),
        transfer=transfer,
    )
    result = hp_pp.simulate_schedule(table, costs)
    return result.step_time, max(result.peak_activation_memory.values())


def _pipeline(
    schedule: str, pp: int, n_mb: int, forward: float, backward: float, transfer: float
) -> tuple[float, float]:
    """The simulator's step time and peak for these stage costs (cached in relative units).

    Beyond ``2 * pp`` micro-batches the schedule is in its steady state: the step grows by one
    micro-batch's work per extra micro-batch and the in-flight count stays (GPipe's grows), so
    the simulator runs ``2 * pp`` and the rest is extrapolated.
    """
    if forward <= 0:
        return 0.0, float(n_mb)
    ratio = float(f"{transfer / forward:.2g}")
    rel_b = round(backward / forward, 3)
    n0 = n_mb
    if n_mb > 2 * pp and n_mb % pp == 0:
        n0 = 2 * pp
    step, peak = _pipeline_unit(schedule, pp, n0, rel_b, ratio)
    if n0 != n_mb:
        v = _stages_per_rank(schedule)
        step += (n_mb - n0) * v * (1.0 + rel_b)
        if peak >= 0.99 * n0 * v:  # everything in flight (GPipe-like)
            peak *= n_mb / n0
    return step * forward, peak


def estimate_layout(
    stats: ModelStats,
    candidate: LayoutCandidate,
    profile: DeviceProfile,
    *,
    memory_limit: float | None = None,
    optimizer: str = "AdamW",
) -> LayoutEstimate:
    """Predict the step time and peak memory of ``candidate``.

    Args:
        stats: The model (:func:`~hp_trainer.planner.model_stats`).
        candidate: The layout.
        profile: The device and network profile.
        memory_limit: Bytes available per device (default: the profile's memory).
        optimizer: ``AdamW``/``Adam`` (two fp32 moments), ``Muon`` (one), ``SGD`` (none).

    Returns:
        The estimate; ``fits`` is False, with the shortfall in ``why``, above the limit.

    See Also:
        :func:`hp_pp.simulate_schedule`: the pipeline part of the prediction.
    """
    c = candidate
    s = stats
    limit = profile.memory_bytes if memory_limit is None else memory_limit
    cb = c.compute_dtype_bytes
    fs = c.dp_shard * c.cp  # FSDP shards over dp_shard x cp
    shard = fs * c.tp  # every parameter is split this many ways (experts: ep x efsdp)
    v = _stages_per_rank(c.schedule) if c.pp > 1 else 1
    # the worst stage: its share of the blocks plus the embedding or the head
    layers = math.ceil(s.n_layers / c.pp) if c.pp > 1 else s.n_layers
    dense_layer = max(s.layer_dense_params)
    expert_layer = max(s.layer_expert_params)
    layer_params = dense_layer + expert_layer
    edge = max(s.embed_params, s.head_params) if c.pp > 1 else s.embed_params + s.head_params
    stage_params = layers * layer_params + edge
    rank_params = stage_params / shard
    opt_states = {"SGD": 0, "Muon": 1}.get(optimizer, 2)

    mem: dict[str, float] = {}
    host = 0.0
    mem["parameters"] = 4 * rank_params
    grads = 4 * rank_params
    opt = 4 * opt_states * rank_params
    if c.offload_optimizer:
        # moments, the fp32 master copy the host step updates, the gradients' host buffers
        host += opt + 8 * rank_params
        opt = 0.0
    if c.offload_params:  # host: parameters + gradient buffers (+ the state, stepped there)
        host += 8 * rank_params + (0.0 if c.offload_optimizer else opt)
        opt = 0.0
        # resident: two blocks (the current one and the prefetched one), or the embedding or
        # the head with its neighbour block
        edge_max = max(s.embed_params, s.head_params)
        mem["parameters"] = 4 * max(2 * layer_params, edge_max + layer_params) / shard
    mem["optimizer"] = opt
    # gathered parameters / autocast copies in the compute dtype
    if fs > 1:
        keep_all = c.pp > 1  # default policy: no reshard after forward with PP
        gathered = (stage_params if keep_all else 2 * layer_params) / c.tp * cb
        gathered += layer_params / c.tp * 4  # one block's unsharded fp32 gradient for the RS
    else:
        gathered = stage_params / c.tp * cb if cb < 4 else 0.0
    mem["gathered_parameters"] = gathered

    mb_samples = c.microbatch_size if c.pp > 1 else c.local_batch_size
    tokens_mb = mb_samples * c.seq_len / c.cp
    act_layer = s.layer_act_bytes(cb) / c.tp * tokens_mb
    if s.is_moe and c.ep > 1:  # the received rows' order by local expert: dispatch, combine
        act_layer += 2 * 8 * s.top_k / c.tp * tokens_mb
    block_input = s.dim / c.tp * tokens_mb * cb
    layers_rank = layers
    if c.ac == "none":
        act_mb = layers_rank * act_layer
    elif c.ac == "selective":
        act_mb = math.ceil(layers_rank / 2) * act_layer + layers_rank // 2 * block_input
        act_mb += act_layer
    elif c.ac == "full":
        act_mb = layers_rank * block_input + act_layer
    else:  # swap: two blocks on the device, the rest on the host
        act_mb = min(layers_rank, 2) * act_layer + layers_rank * block_input
        host += layers_rank * act_layer
    n_mb = c.local_batch_size // c.microbatch_size if c.pp > 1 else 1

    # ---- time -----------------------------------------------------------------------------
    tokens_rank = c.local_batch_size * c.seq_len / c.cp  # this rank's tokens per step
    model_flops = s.flops_per_token_at(c.seq_len) * tokens_rank / (c.tp * c.pp)
    recompute = {"none": 0.0, "selective": 0.5, "full": 1.0, "swap": 0.0}[c.ac]
    flops = model_flops * (1 + recompute / 3)
    t: dict[str, float] = {}
    kernels = s.kernels_per_layer * layers * (3 + recompute) * (n_mb if c.pp > 1 else 1)
    per_op = profile.kernel_overhead + (profile.dtensor_overhead if c.tp > 1 else 0.0)
    t["compute"] = flops / profile.sustained_flops + kernels * per_op

    tp_a, tp_b = _link(profile, c.tp)
    cp_a, cp_b = _link(profile, c.tp * c.cp)
    ep_a, ep_b = _link(profile, c.ep)
    fs_a, fs_b = _link(profile, c.tp * c.cp * c.dp_shard)
    rep_a, rep_b = _link(profile, c.tp * c.cp * c.dp_shard * c.dp_replicate)
    pp_a, pp_b = _link(profile, c.world_size)
    # per micro-batch per block
    act_bytes = tokens_mb * s.dim * cb
    tp_fwd = 4 * _ring(c.tp, act_bytes, tp_a, tp_b)  # 2 all-gathers + 2 reduce-scatters
    kv_bytes = mb_samples * c.seq_len * 2 * s.n_kv_heads * (s.dim // s.n_heads) / c.tp * cb
    cp_fwd = _ring(c.cp, kv_bytes, cp_a, cp_b)
    ep_fwd = 0.0
    if s.is_moe and c.ep > 1:
        a2a = tokens_mb / c.tp * s.top_k * s.dim * cb * (c.ep - 1) / c.ep
        ep_fwd = 2 * ((c.ep - 1) * ep_a + a2a / ep_b)
    moe_layers = sum(1 for e in s.layer_expert_params if e) / max(c.pp, 1)
    comm_fwd_mb = layers * (tp_fwd + cp_fwd) + moe_layers * ep_fwd
    comm_mb = comm_fwd_mb * (3 + recompute) / 1.0 / 1.5  # backward twice forward's traffic
    t["tp_cp_ep_comm"] = comm_mb * (n_mb if c.pp > 1 else 1)

    # FSDP / HSDP, overlapped except one block at each end
    fsdp = 0.0
    if fs > 1:
        gathers = 1 if c.pp > 1 else 2
        per_layer_ag = _ring(fs, layer_params / c.tp * cb, fs_a, fs_b)
        per_layer_rs = _ring(fs, layer_params / c.tp * 4, fs_a, fs_b)
        fsdp = layers * (gathers * per_layer_ag + per_layer_rs)
        fsdp += _ring(fs, edge / c.tp * (cb + 4), fs_a, fs_b)
    if c.dp_replicate > 1:
        fsdp += 2 * _ring(c.dp_replicate, 4 * rank_params, rep_a, rep_b)
    t["fsdp_comm_total"] = fsdp

    if c.pp > 1:
        fwd_mb = (t["compute"] / (3 + recompute) + comm_fwd_mb * (n_mb and 1)) / n_mb
        fwd_stage = fwd_mb / v
        bwd_stage = fwd_stage * (2 + recompute)
        transfer = pp_a + act_bytes / c.tp / pp_b
        pipe_time, in_flight = _pipeline(c.schedule, c.pp, n_mb, fwd_stage, bwd_stage, transfer)
        t["pipeline"] = pipe_time
        t["bubble"] = max(0.0, pipe_time - n_mb * v * (fwd_stage + bwd_stage))
        busy = pipe_time
        act_total = in_flight * act_mb / v
    else:
        busy = t["compute"] + t["tp_cp_ep_comm"]
        act_total = act_mb
    exposed = max(0.0, fsdp - busy) + (fsdp / max(layers, 1) if fs > 1 or c.dp_replicate > 1 else 0)
    t["fsdp_exposed"] = exposed
    # optimizer step: memory bound (param, grad, moments read; param, moments written)
    touched = 4 * (3 + 2 * opt_states) * rank_params
    if c.offload_params:  # each unit in twice, each gradient out once, behind the compute
        t["param_offload"] = max(0.0, 12 * rank_params / profile.host_bandwidth - busy)
    if c.offload_optimizer or c.offload_params:
        t["optimizer"] = touched / profile.host_memory_bandwidth + 8 * rank_params / (
            profile.host_bandwidth
        )
    else:
        t["optimizer"] = touched / profile.memory_bandwidth
    if c.ac == "swap":
        t["swap"] = max(0.0, 2 * host / profile.host_bandwidth - busy)
    step = busy + exposed + sum(t.get(k, 0.0) for k in ("optimizer", "swap", "param_offload"))

    # ---- memory ---------------------------------------------------------------------------
    last_stage = True
    # the peak of the loss is in its backward. Without TP, log-softmax's: the logits (held by
    # the step), the float32 log-softmax output, its gradient, and the float32 logits' gradient
    # being made (under mixed precision the logits' float32 copy is freed once log-softmax has
    # run). Under TP, loss parallel's fused backward on the vocabulary shard: the logits, the
    # saved float32 log-probabilities, the negative one-hot, the probabilities, their sum and
    # its product with the incoming gradient (five float32 tensors)
    per_logit = cb + (20 if c.tp > 1 else 12)
    logits = tokens_mb * s.vocab_size / c.tp * per_logit if last_stage else 0.0
    comm_buf = 0.0
    if c.tp > 1:
        comm_buf += 2 * act_bytes
    if c.cp > 1:
        comm_buf += 2 * kv_bytes
    # EP: the all-to-alls' received rows are the experts' saved input and the combine's saved
    # output (counted in the activations); what is extra is the backward's pair, the gradient
    # rows sent and received (one row per token and choice each way), live in a MoE block's
    # backward, not at the loss
    ep_buf = 2 * tokens_mb / c.tp * s.top_k * s.dim * cb if s.is_moe and c.ep > 1 else 0.0
    comm_buf += ep_buf
    mem["activations"] = act_total
    mem["logits"] = logits
    mem["comm_buffers"] = comm_buf
    # gradients persist across micro-batches; else the LM head's (the first computed) is live
    # while the activations are
    grads_live = grads if (c.pp > 1 or n_mb > 1) else 4 * s.head_params / shard
    if c.offload_params:  # moved to the host as each unit's are accumulated
        grads_live = 0.0
        grads = 0.0
    # offloaded parameters: the peak is at the loss, where no unit is resident (the head's copy
    # and gradient come in for its backward once the logits' float32 copy is freed)
    resident = 0.0 if c.offload_params else mem["parameters"]
    fb_peak = resident + opt + gathered + act_total + logits + comm_buf + grads_live
    if c.pp == 1 and not c.offload_params:
        # one micro-batch: the loss and a block's backward are two moments. At the loss: every
        # kept activation but no recomputed block yet, the logits' peak, no gradient yet, and
        # of FSDP's units only the LM head's gathered (not resharded after the forward); in a
        # block's backward: the recomputed block, the gathered block and the one prefetched,
        # its float32 gradient, the head's gradient, the logits gone
        recomputed = act_layer if c.ac in ("selective", "full") else 0.0
        at_loss = gathered if fs == 1 else s.head_params / c.tp * cb
        loss_peak = resident + opt + at_loss + act_total - recomputed + logits + comm_buf
        loss_peak -= ep_buf
        in_backward = gathered
        if fs > 1:  # the previous block's reduce-scatter input, still in flight
            in_backward += layer_params / c.tp * 4
        held_logits = tokens_mb * s.vocab_size / c.tp * cb  # the step holds them to its end
        # the block's input gradients its backward holds beside the saved tensors
        bwd_temp = max(s.layer_bwd_temp_elems, default=0.0) / c.tp * tokens_mb * cb
        mem["backward_temporaries"] = bwd_temp
        bwd_peak = resident + opt + in_backward + act_total + held_logits + comm_buf + grads_live
        bwd_peak += bwd_temp
        fb_peak = max(loss_peak, bwd_peak)
    # the multi-tensor step's largest temporary: sqrt(v) for every parameter (AdamW)
    opt_temp = (
        0.0 if c.offload_optimizer or c.offload_params or opt_states == 0 else 4 * rank_params
    )
    opt_peak = mem["parameters"] + opt + grads + opt_temp
    mem["gradients"] = grads
    mem["optimizer_temporaries"] = opt_temp
    peak = max(fb_peak, opt_peak)

    global_tokens = c.local_batch_size * c.dp * c.seq_len
    tps = global_tokens / step
    per_device = tps / c.world_size
    mfu = s.flops_per_token_at(c.seq_len) * per_device / profile.peak_flops
    fits = peak <= limit
    why = "" if fits else f"memory short by {(peak - limit) / _GIB:.2f} GiB"
    t["step"] = step
    return LayoutEstimate(c, step, tps, per_device, mfu, peak, mem, t, fits, why, host)
