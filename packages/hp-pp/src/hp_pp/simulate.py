"""The simulator: what a schedule costs, from per-stage compute costs and a transfer cost.

Every rank runs its actions in order. A compute action starts when its rank is free and its
input is there, and takes its stage's cost: forward ``F``, backward-input ``I``,
backward-weight ``W``, full backward ``B`` (``I + W`` unless given); ``OVERLAP_F_B`` runs its
sub-actions back to back (their transfers are what it overlaps). A transfer between two ranks
takes ``transfer`` time on the link, not on either rank: in a compute-only table each
cross-rank input arrives ``transfer`` after its producer ends; in a table with ``SEND`` /
``RECV`` the message leaves when the sender reaches its ``SEND`` and the consumer waits for it.
``UNSHARD`` / ``RESHARD`` / ``REDUCE_GRAD`` take their optional costs on the rank.

The result gives the step time, the bubble fraction (idle share of all ranks' time until the
step ends), the peak activation memory per rank (a stage's micro-batch activations are live
from its forward until its backward finishes: ``B``, or ``W`` when split), and the timed
actions for :mod:`hp_pp.timeline`. Costs are in milliseconds by convention (the Chrome trace
reads them so); any unit works for the ratios.

See Also:
    :pt:`torch.distributed.pipelining.schedules._simulate_comms_compute` (a lock-step
    dry run without costs).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hp_pp.actions import Action, ActionType, ScheduleTable
from hp_pp.comm_lowering import leaf_actions

__all__ = ["PipelineCosts", "SimulationResult", "StageCosts", "TimedAction", "simulate_schedule"]

_F = ActionType.FORWARD
_B = ActionType.FULL_BACKWARD
_I = ActionType.BACKWARD_INPUT
_W = ActionType.BACKWARD_WEIGHT
_PRE_F = ActionType.PREPROCESS_F
_PRE_B = ActionType.PREPROCESS_B
_SEND = (ActionType.SEND_F, ActionType.SEND_B, ActionType.SEND_PRE)
_RECV = (ActionType.RECV_F, ActionType.RECV_B, ActionType.RECV_PRE)


@dataclass(frozen=True)
class StageCosts:
    """Compute costs of one stage for one micro-batch.

    Attributes:
        forward: Cost of ``F``.
        backward_input: Cost of ``I`` (gradient of the stage input).
        backward_weight: Cost of ``W`` (gradient of the parameters).
        full_backward: Cost of ``B``; ``backward_input + backward_weight`` when ``None``.
        activation_memory: Memory one micro-batch's activations of this stage hold.

    See Also:
        :pt:`torch.distributed.pipelining.schedules._simulate_comms_compute` (a dry run without
        costs)
    """

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    full_backward: float | None = None
    activation_memory: float = 1.0

    def __post_init__(self) -> None:
        for name in ("forward", "backward_input", "backward_weight", "activation_memory"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"StageCosts.{name} must be a number >= 0, got {value!r}")
        if self.full_backward is not None and (
            not isinstance(self.full_backward, (int, float)) or self.full_backward < 0
        ):
            raise ValueError(
                f"StageCosts.full_backward must be >= 0 or None, got {self.full_backward!r}"
            )

    def cost(self, kind: ActionType) -> float:
        """The cost of one compute action of ``kind``."""
        if kind is _F:
            return self.forward
        if kind is _I:
            return self.backward_input
        if kind is _W:
            return self.backward_weight
        if kind is _B:
            if self.full_backward is not None:
                return self.full_backward
            return self.backward_input + self.backward_weight
        raise ValueError(f"{kind.name} is not a compute action")

    def scaled(self, factor: float) -> StageCosts:
        """These costs times ``factor`` (a stage ``factor`` times as large)."""
        full = None if self.full_backward is None else self.full_backward * factor
        return StageCosts(
            self.forward * factor,
            self.backward_input * factor,
            self.backward_weight * factor,
            full,
            self.activation_memory * factor,
        )


@dataclass(frozen=True)
class PipelineCosts:
    """Costs of every stage, of a transfer, and of the per-stage data-parallel actions.

    Attributes:
        default: Costs of a stage not listed in ``per_stage``.
        per_stage: Costs of particular stages, by stage index.
        transfer: Time of one point-to-point transfer between ranks.
        unshard: Rank time of ``UNSHARD``.
        reshard: Rank time of ``RESHARD``.
        reduce_grad: Rank time of ``REDUCE_GRAD``.
        preprocess_forward: The part of stage 0's forward spent in its preprocess block. MPipe
            moves it to ``PRE_F`` for the transposed micro-batches.
        preprocess_backward: The part of stage 0's backward spent in the preprocess block.
            MPipe's ``PRE_B`` costs ``preprocess_forward + preprocess_backward`` (recompute).

    See Also:
        :pt:`torch.distributed.pipelining.schedules._simulate_comms_compute` (a dry run without
        costs)
    """

    default: StageCosts = field(default_factory=StageCosts)
    per_stage: dict[int, StageCosts] = field(default_factory=dict)
    transfer: float = 0.0
    unshard: float = 0.0
    reshard: float = 0.0
    reduce_grad: float = 0.0
    preprocess_forward: float = 0.0
    preprocess_backward: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "transfer",
            "unshard",
            "reshard",
            "reduce_grad",
            "preprocess_forward",
            "preprocess_backward",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"PipelineCosts.{name} must be a number >= 0, got {value!r}")

    def stage(self, stage_index: int) -> StageCosts:
        """The costs of ``stage_index``."""
        return self.per_stage.get(stage_index, self.default)

    def split_evenly(self, num_stages: int, reference_stages: int) -> PipelineCosts:
        """Uniform costs given for ``reference_stages`` stages, re-cut into ``num_stages``.

        Comparing schedules with different stage counts on the same model: each of
        ``num_stages`` stages costs ``reference_stages / num_stages`` of a reference stage.

        Raises:
            ValueError: per-stage costs are set (they cannot be re-cut).
        """
        if self.per_stage:
            raise ValueError(
                "per-stage costs cannot be re-cut into a different number of stages "
                f"({reference_stages} -> {num_stages}); give uniform costs to compare"
            )
        return replace(self, default=self.default.scaled(reference_stages / num_stages))

    @classmethod
    def from_toml(cls, path: str | Path) -> PipelineCosts:
        """Read costs from a TOML file.

        Top-level keys ``forward``, ``backward_input``, ``backward_weight``, ``full_backward``,
        ``activation_memory`` set every stage; ``transfer``, ``unshard``, ``reshard``,
        ``reduce_grad``, ``preprocess_forward``, ``preprocess_backward`` the rest; a table
        ``[stage.N]`` overrides stage ``N``::

            forward = 1.0
            backward_input = 1.0
            backward_weight = 1.0
            transfer = 0.05
            [stage.3]
            forward = 1.5

        Raises:
            ValueError: unknown keys, bad values or a malformed file (the message names them).
        """
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            try:
                import tomli as tomllib
            except ImportError as error:
                raise ImportError(
                    "reading a costs TOML file on Python 3.10 needs 'tomli': pip install tomli"
                ) from error
        text = Path(path).read_text(encoding="utf-8")
        try:
            data: dict[str, Any] = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ValueError(f"{path}: not valid TOML: {error}") from None
        return cls.from_mapping(data, source=str(path))

    @classmethod
    def from_mapping(cls, data: dict[str, Any], *, source: str = "costs") -> PipelineCosts:
        """Build costs from a parsed mapping in the layout of :meth:`from_toml`."""
        stage_keys = {
            "forward",
            "backward_input",
            "backward_weight",
            "full_backward",
            "activation_memory",
        }
        rank_keys = {
            "transfer",
            "unshard",
            "reshard",
            "reduce_grad",
            "preprocess_forward",
            "preprocess_backward",
        }
        unknown = set(data) - stage_keys - rank_keys - {"stage"}
        if unknown:
            raise ValueError(
                f"{source}: unknown keys {sorted(unknown)}; expected "
                f"{sorted(stage_keys | rank_keys)} and [stage.N] tables"
            )
        default = StageCosts(**{k: data[k] for k in stage_keys if k in data})
        per_stage: dict[int, StageCosts] = {}
        for key, table in dict(data.get("stage", {})).items():
            if not str(key).isdigit() or not isinstance(table, dict):
                raise ValueError(f"{source}: [stage.{key}] must be a table named by a stage index")
            extra = set(table) - stage_keys
            if extra:
                raise ValueError(f"{source}: [stage.{key}] has unknown keys {sorted(extra)}")
            per_stage[int(key)] = replace(default, **table)
        return cls(
            default=default, per_stage=per_stage, **{k: data[k] for k in rank_keys if k in data}
        )


@dataclass(frozen=True)
class TimedAction:
    """One action of the simulated run: where and when it ran.

    See Also:
        :pt:`torch.distributed.pipelining.schedules._simulate_comms_compute`
    """

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate_schedule` computed.

    Attributes:
        step_time: When the last rank finishes.
        busy_time: Per rank, the time spent computing.
        bubble_fraction: ``1 - sum(busy) / (pp_size * step_time)``.
        peak_activation_memory: Per rank, the most activation memory live at once.
        timeline: Every action that takes time, with start and end.

    See Also:
        :pt:`torch.distributed.pipelining.schedules._simulate_comms_compute`
    """

    step_time: float
    busy_time: dict[int, float]
    bubble_fraction: float
    peak_activation_memory: dict[int, float]
    timeline: tuple[TimedAction, ...]


def simulate_schedule(table: ScheduleTable, costs: PipelineCosts | None = None) -> SimulationResult:
    """Run ``table`` in simulated time with ``costs`` and measure it.

    Args:
        table: ``{rank: [Action | None]}``, compute-only or with sends and receives (validate
            it first with :func:`hp_pp.check_schedule` for clear messages).
        costs: Stage and transfer costs; unit costs (``F = I = W = 1``, no transfer time)
            when ``None``.

    Raises:
        ValueError: the table cannot run (a deadlock); the message names the waiting ranks.

    See Also:
        :pt:`torch.distributed.pipelining.schedules._simulate_comms_compute`
    """
    run = _TimedRun(table, costs if costs is not None else PipelineCosts())
    run.execute()
    step = max((t.end for t in run.timeline), default=0.0)
    busy = {rank: 0.0 for rank in table}
    for timed in run.timeline:
        kind = timed.action.type
        if kind.is_compute or kind.is_preprocess or kind is ActionType.OVERLAP_F_B:
            busy[timed.rank] += timed.end - timed.start
    bubble = 0.0 if step == 0 else 1.0 - sum(busy.values()) / (len(table) * step)
    return SimulationResult(
        step_time=step,
        busy_time=busy,
        bubble_fraction=bubble,
        peak_activation_memory=run.peak_memory,
        timeline=tuple(sorted(run.timeline, key=lambda t: (t.start, t.rank))),
    )


class _TimedRun:
    """Each rank's clock, when outputs became available, messages in flight, live memory."""

    def __init__(self, table: ScheduleTable, costs: PipelineCosts) -> None:
        self.table = table
        self.costs = costs
        self.explicit = any(
            a is not None and (a.type in _SEND or a.type in _RECV)
            for acts in table.values()
            for a in acts
        )
        self.rank_of: dict[int, int] = {}
        # MPipe: micro-batch -> the rank running its transposed preprocess forward.
        self.preprocess_rank: dict[int, int] = {}
        for rank, actions in table.items():
            for action in actions:
                if action is None:
                    continue
                for leaf in leaf_actions(action):
                    if leaf.type.is_compute:
                        self.rank_of.setdefault(leaf.stage_index, rank)
                    elif leaf.type is _PRE_F and leaf.microbatch_index is not None:
                        self.preprocess_rank.setdefault(leaf.microbatch_index, rank)
        self.num_stages = max(self.rank_of, default=-1) + 1
        self.clock = dict.fromkeys(table, 0.0)
        self.cursor = dict.fromkeys(table, 0)
        self.finished: dict[tuple[int, ActionType, int], float] = {}
        self.messages: dict[tuple[int, int], list[tuple[Action, float]]] = defaultdict(list)
        self.arrived: dict[tuple[int, ActionType, int], float] = {}
        self.live_memory = dict.fromkeys(table, 0.0)
        self.peak_memory = dict.fromkeys(table, 0.0)
        self.timeline: list[TimedAction] = []

    def _input_time(self, rank: int, leaf: Action) -> float | None:
        """When ``leaf``'s input is available on ``rank``; None when not yet known."""
        stage, mb = leaf.stage_index, leaf.microbatch_index
        assert mb is not None
        kinds: tuple[ActionType, ...]
        if leaf.type is _PRE_F:
            return 0.0
        if leaf.type is _PRE_B:
            return self.finished.get((0, _B, mb), self.finished.get((0, _I, mb)))
        if leaf.type is _F and stage == 0 and mb in self.preprocess_rank:
            produced = self.finished.get((0, _PRE_F, mb))
            if self.preprocess_rank[mb] == rank:
                return produced
            if self.explicit:
                return self.arrived.get((0, ActionType.RECV_PRE, mb))
            return None if produced is None else produced + self.costs.transfer
        if leaf.type is _F:
            if stage == 0:
                return 0.0
            source, kinds, recv = stage - 1, (_F,), ActionType.RECV_F
        elif leaf.type in (_B, _I):
            if stage == self.num_stages - 1:
                return self.finished.get((stage, _F, mb))
            source, kinds, recv = stage + 1, (_B, _I), ActionType.RECV_B
        elif leaf.type is _W:
            return self.finished.get((stage, _I, mb))
        else:
            return 0.0
        if self.rank_of.get(source) == rank:
            return next(
                (self.finished[(source, k, mb)] for k in kinds if (source, k, mb) in self.finished),
                None,
            )
        if self.explicit:
            return self.arrived.get((stage, recv, mb))
        produced = next(
            (self.finished[(source, k, mb)] for k in kinds if (source, k, mb) in self.finished),
            None,
        )
        return None if produced is None else produced + self.costs.transfer

    def _peer(self, action: Action) -> int | None:
        if action.type is ActionType.SEND_PRE:
            return self.rank_of.get(0)
        if action.type is ActionType.RECV_PRE:
            assert action.microbatch_index is not None
            return self.preprocess_rank.get(action.microbatch_index)
        if action.type is ActionType.SEND_F or action.type is ActionType.RECV_B:
            return self.rank_of.get(action.stage_index + 1)
        return self.rank_of.get(action.stage_index - 1)

    def _step(self, rank: int) -> bool:
        action = self.table[rank][self.cursor[rank]]
        if action is None:
            self.cursor[rank] += 1
            return True
        if action.type in _SEND:
            peer = self._peer(action)
            if peer is not None:
                self.messages[(rank, peer)].append((action, self.clock[rank] + self.costs.transfer))
        elif action.type in _RECV:
            peer = self._peer(action)
            queue = self.messages[(peer, rank)] if peer is not None else []
            if not queue:
                return False
            _, arrival = queue.pop(0)
            assert action.microbatch_index is not None
            self.arrived[(action.stage_index, action.type, action.microbatch_index)] = arrival
        elif (
            action.type.is_compute
            or action.type.is_preprocess
            or action.type is ActionType.OVERLAP_F_B
        ):
            leaves = leaf_actions(action)
            ready = [self._input_time(rank, leaf) for leaf in leaves]
            if any(t is None for t in ready):
                return False
            start = max([self.clock[rank], *(t for t in ready if t is not None)])
            end = start
            for leaf in leaves:
                end += self._cost(leaf)
                self._account(rank, leaf, end)
            self.timeline.append(TimedAction(rank, action, start, end))
            self.clock[rank] = end
        else:
            cost = {
                ActionType.UNSHARD: self.costs.unshard,
                ActionType.RESHARD: self.costs.reshard,
                ActionType.REDUCE_GRAD: self.costs.reduce_grad,
            }[action.type]
            if cost:
                start = self.clock[rank]
                self.timeline.append(TimedAction(rank, action, start, start + cost))
                self.clock[rank] = start + cost
        self.cursor[rank] += 1
        return True

    def _cost(self, leaf: Action) -> float:
        """A compute action's cost; MPipe moves the preprocess part of stage 0 to PRE_F/PRE_B."""
        pre_f, pre_b = self.costs.preprocess_forward, self.costs.preprocess_backward
        if leaf.type is _PRE_F:
            return pre_f
        if leaf.type is _PRE_B:
            return pre_f + pre_b
        cost = self.costs.stage(leaf.stage_index).cost(leaf.type)
        if leaf.stage_index == 0 and leaf.microbatch_index in self.preprocess_rank:
            part = pre_f if leaf.type is _F else pre_b if leaf.type in (_B, _I) else 0.0
            if part > cost:
                raise ValueError(
                    f"{leaf}: the preprocess part of stage 0 ({part:g}) exceeds the stage's "
                    f"{leaf.type.name} cost ({cost:g})"
                )
            cost -= part
        return cost

    def _account(self, rank: int, leaf: Action, end: float) -> None:
        assert leaf.microbatch_index is not None
        self.finished[(leaf.stage_index, leaf.type, leaf.microbatch_index)] = end
        if leaf.type.is_preprocess:
            return
        memory = self.costs.stage(leaf.stage_index).activation_memory
        if leaf.type is _F:
            self.live_memory[rank] += memory
            self.peak_memory[rank] = max(self.peak_memory[rank], self.live_memory[rank])
        elif leaf.type in (_B, _W):
            self.live_memory[rank] -= memory

    def execute(self) -> None:
        ranks = sorted(self.table)
        while True:
            progressed = False
            for rank in ranks:
                while self.cursor[rank] < len(self.table[rank]) and self._step(rank):
                    progressed = True
            pending = [r for r in ranks if self.cursor[r] < len(self.table[r])]
            if not pending:
                return
            if not progressed:
                stuck = ", ".join(f"rank {r} at {self.table[r][self.cursor[r]]}" for r in pending)
                raise ValueError(
                    f"the schedule cannot run, every rank waits ({stuck}); "
                    "hp_pp.validate.check_schedule names the cause"
                )
