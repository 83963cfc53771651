"""The offline validator: run every rank's actions in a simulation and report what breaks.

No processes are started. Two checks run. First the table's own logic: a receive waits until
its peer has posted the matching send, messages between two ranks match in the order they were
posted, and a compute-only table (no ``SEND``/``RECV``) is checked as if each cross-rank input
were delivered as soon as its producer ran. Then, when that passes, what the executor would
really post for the table (a compute-only table lowered as the schedules lower it, transfers
that follow each other posted as one batch, see :mod:`hp_pp.transport`) is replayed under
NCCL's point-to-point rules (:mod:`hp_pp.p2p_model`): a send blocks until its receive is
posted, one FIFO channel per direction of a rank pair, tags ignored. Problems found there name
the rank, the pair and the operations, e.g. ``NCCL deadlock: rank 0, pair (0, 1), waits on recv
B(stage 3, mb 1, data), posted behind its own send B(stage 2, mb 0, data) with rank 1, ...``.

The report lists every problem with the rank and the action: a deadlock (each waiting rank
and what it waits for), unmatched or mismatched transfers, a backward before its forward, a
weight backward before its input backward, duplicate or missing work, a stage on two ranks.
It also gives the peak number of in-flight activations per rank: a micro-batch's activations
of a stage are live from its forward until its backward finishes (``B``, or ``W`` when the
backward is split).

See Also:
    :pt:`torch.distributed.pipelining.schedules._simulate_comms_compute` and HyperParallel's
    ``validate_pipeline_execution`` (the same idea, here with a report instead of a hang).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from hp_pp.actions import Action, ActionType, ScheduleTable
from hp_pp.comm_lowering import leaf_actions, lower_with_placement
from hp_pp.generators.mapping import stage_to_rank
from hp_pp.p2p_model import replay
from hp_pp.transport import plan_programs

__all__ = ["ValidationReport", "check_schedule", "validate_schedule"]

_F = ActionType.FORWARD
_B = ActionType.FULL_BACKWARD
_I = ActionType.BACKWARD_INPUT
_W = ActionType.BACKWARD_WEIGHT
_PRE_F = ActionType.PREPROCESS_F
_PRE_B = ActionType.PREPROCESS_B
_SEND = (ActionType.SEND_F, ActionType.SEND_B, ActionType.SEND_PRE)
_RECV = (ActionType.RECV_F, ActionType.RECV_B, ActionType.RECV_PRE)


@dataclass(frozen=True)
class ValidationReport:
    """What :func:`validate_schedule` found.

    Attributes:
        pp_size: Number of ranks in the table.
        num_stages: Stages checked (given or inferred).
        n_microbatches: Micro-batches checked (given or inferred).
        stage_to_rank: The placement found in the table.
        problems: One message per problem, each naming the rank and the action.
        deadlocked: Whether the simulation stopped with ranks waiting forever.
        peak_in_flight: Per rank, the most micro-batch activations alive at once.

    See Also:
        :pt:`torch.distributed.pipelining.schedules._validate_schedule`
    """

    pp_size: int
    num_stages: int
    n_microbatches: int
    stage_to_rank: dict[int, int]
    problems: tuple[str, ...]
    deadlocked: bool
    peak_in_flight: dict[int, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.problems

    def raise_if_invalid(self) -> None:
        """Raise ValueError listing every problem, if there is any."""
        if self.problems:
            listed = "\n  ".join(self.problems)
            raise ValueError(
                f"invalid pipeline schedule ({len(self.problems)} problems):\n  {listed}"
            )


def check_schedule(
    table: ScheduleTable,
    *,
    num_stages: int | None = None,
    n_microbatches: int | None = None,
    style: str | None = None,
) -> ValidationReport:
    """Validate ``table`` and raise ValueError naming every problem; return the report if none.

    See :func:`validate_schedule` for the arguments.

    See Also:
        :pt:`torch.distributed.pipelining.schedules._validate_schedule`
    """
    report = validate_schedule(
        table, num_stages=num_stages, n_microbatches=n_microbatches, style=style
    )
    report.raise_if_invalid()
    return report


def validate_schedule(
    table: ScheduleTable,
    *,
    num_stages: int | None = None,
    n_microbatches: int | None = None,
    style: str | None = None,
) -> ValidationReport:
    """Simulate ``table`` on all ranks and report deadlocks, bad transfers and bad work.

    Args:
        table: ``{rank: [Action | None]}``, compute-only or with sends and receives.
        num_stages: Expected number of stages; inferred (highest stage + 1) when ``None``.
        n_microbatches: Expected micro-batches per step; inferred when ``None``.
        style: ``"loop"`` or ``"v"`` to also check the placement of stages on ranks.

    Returns:
        A :class:`ValidationReport`; ``report.ok`` is true when nothing is wrong.

    Raises:
        TypeError: ``table`` is not a mapping from rank to a list of actions.

    See Also:
        :pt:`torch.distributed.pipelining.schedules._validate_schedule`
    """
    _check_shape(table)
    leaves = [
        (rank, pos, leaf)
        for rank, actions in table.items()
        for pos, action in enumerate(actions)
        if action is not None
        for leaf in leaf_actions(action)
    ]
    stages_seen = {leaf.stage_index for _, _, leaf in leaves}
    mbs_seen = {leaf.microbatch_index for _, _, leaf in leaves if leaf.microbatch_index is not None}
    n_stages = num_stages if num_stages is not None else max(stages_seen, default=-1) + 1
    n_mbs = n_microbatches if n_microbatches is not None else max(mbs_seen, default=-1) + 1
    problems: list[str] = []
    placement = _placement(table, leaves, n_stages, style, problems)
    _check_work(table, n_stages, n_mbs, problems)
    run = _Run(table, n_stages, placement)
    run.execute()
    problems += run.problems
    deadlocked = run.deadlocked
    if not run.deadlocked and not problems:
        nccl = _nccl_problems(table, n_stages, placement)
        problems += nccl
        deadlocked = any(p.startswith("NCCL deadlock") for p in nccl)
    return ValidationReport(
        pp_size=len(table),
        num_stages=n_stages,
        n_microbatches=n_mbs,
        stage_to_rank=placement,
        problems=tuple(problems),
        deadlocked=deadlocked,
        peak_in_flight=run.peak_in_flight,
    )


def _nccl_problems(table: ScheduleTable, n_stages: int, placement: dict[int, int]) -> list[str]:
    """Replay what the executor would post for ``table`` under NCCL's rules
    (:mod:`hp_pp.p2p_model`); a compute-only table is lowered first, as the schedules do."""
    explicit = any(a is not None and a.type.is_communication for row in table.values() for a in row)
    runs = table
    if not explicit:
        if sorted(table) != list(range(len(table))) or set(placement) != set(range(n_stages)):
            return []
        try:
            runs = lower_with_placement(table, num_stages=n_stages, rank_of=placement.__getitem__)
        except ValueError as err:
            return [str(err)]
    report = replay(plan_programs(runs, num_stages=n_stages))
    return list(report.problems)


def _check_shape(table: ScheduleTable) -> None:
    if not isinstance(table, dict):
        raise TypeError(f"table must be a dict rank -> list of actions, got {type(table).__name__}")
    for rank, actions in table.items():
        if not isinstance(actions, list):
            raise TypeError(
                f"rank {rank}: expected a list of actions, got {type(actions).__name__}"
            )
        for pos, action in enumerate(actions):
            if action is not None and not isinstance(action, Action):
                raise TypeError(
                    f"rank {rank}, position {pos}: expected an Action or None, got {action!r}"
                )


def _placement(
    table: ScheduleTable,
    leaves: list[tuple[int, int, Action]],
    n_stages: int,
    style: str | None,
    problems: list[str],
) -> dict[int, int]:
    placement: dict[int, int] = {}
    for rank, pos, leaf in leaves:
        if leaf.type.is_preprocess and leaf.stage_index != 0:
            problems.append(
                f"rank {rank}, position {pos}: {leaf}: MPipe's preprocess belongs to stage 0"
            )
        if not leaf.type.is_compute:
            continue
        stage = leaf.stage_index
        if stage >= n_stages:
            problems.append(
                f"rank {rank}, position {pos}: {leaf} names stage {stage}, "
                f"but there are {n_stages} stages"
            )
            continue
        owner = placement.setdefault(stage, rank)
        if owner != rank:
            problems.append(
                f"rank {rank}, position {pos}: {leaf} runs stage {stage}, "
                f"which rank {owner} also runs"
            )
        if style is not None:
            expected = stage_to_rank(stage, len(table), style)
            if expected != rank:
                problems.append(
                    f"rank {rank}, position {pos}: {leaf} belongs to rank {expected} "
                    f"under the {style!r} placement"
                )
    first_rank = placement.get(0)
    for rank, pos, leaf in leaves:
        if leaf.type is _PRE_B and first_rank is not None and first_rank != rank:
            problems.append(
                f"rank {rank}, position {pos}: {leaf} must run on stage 0's rank {first_rank}"
            )
    return placement


def _work_key(leaf: Action) -> tuple[int, str, int]:
    assert leaf.microbatch_index is not None
    return leaf.stage_index, leaf.type.value, leaf.microbatch_index


def _check_work(table: ScheduleTable, n_stages: int, n_mbs: int, problems: list[str]) -> None:
    """Every (stage, micro-batch) has one forward and one backward (B, or I then W), in order."""
    where: dict[tuple[int, str, int], tuple[int, int]] = {}
    for rank, actions in table.items():
        for pos, action in enumerate(actions):
            if action is None:
                continue
            for leaf in leaf_actions(action):
                if not (leaf.type.is_compute or leaf.type.is_preprocess):
                    continue
                key = _work_key(leaf)
                if key[2] >= n_mbs:
                    problems.append(
                        f"rank {rank}, position {pos}: {leaf} names micro-batch {key[2]}, "
                        f"but there are {n_mbs}"
                    )
                    continue
                if key in where:
                    first = where[key]
                    problems.append(
                        f"rank {rank}, position {pos}: duplicate {leaf} "
                        f"(already at rank {first[0]}, position {first[1]})"
                    )
                    continue
                where[key] = (rank, pos)
    _check_preprocess(where, problems)
    for stage in range(n_stages):
        for mb in range(n_mbs):
            fwd = where.get((stage, "F", mb))
            full = where.get((stage, "B", mb))
            inp = where.get((stage, "I", mb))
            wgt = where.get((stage, "W", mb))
            label = f"stage {stage}, micro-batch {mb}"
            if fwd is None:
                problems.append(f"{label}: no forward {stage}F{mb}")
            if full is not None and (inp is not None or wgt is not None):
                problems.append(f"{label}: both a full backward and a split backward")
            elif full is None and inp is None:
                problems.append(
                    f"{label}: no backward ({stage}B{mb} or {stage}I{mb} + {stage}W{mb})"
                )
            elif full is None and wgt is None:
                problems.append(f"rank {inp[0] if inp else '?'}: {stage}I{mb} has no {stage}W{mb}")
            backward = full or inp
            if (
                fwd is not None
                and backward is not None
                and backward[0] == fwd[0]
                and backward[1] < fwd[1]
            ):
                kind = "B" if full else "I"
                problems.append(
                    f"rank {fwd[0]}, position {backward[1]}: {stage}{kind}{mb} "
                    f"runs before its forward {stage}F{mb}"
                )
            if inp is not None and wgt is not None and wgt[0] == inp[0] and wgt[1] < inp[1]:
                problems.append(
                    f"rank {wgt[0]}, position {wgt[1]}: {stage}W{mb} "
                    f"runs before its input backward {stage}I{mb}"
                )


def _check_preprocess(
    where: dict[tuple[int, str, int], tuple[int, int]], problems: list[str]
) -> None:
    """MPipe: transposed preprocess forwards have backwards (all, or none when frozen) after B."""
    forwards = {mb for (_, kind, mb) in where if kind == "PRE_F"}
    backwards = {mb for (_, kind, mb) in where if kind == "PRE_B"}
    # A frozen preprocess has no PRE_B at all; a trainable one has one per transposed batch.
    for mb in sorted(forwards - backwards) if backwards else []:
        problems.append(
            f"rank {where[(0, 'PRE_F', mb)][0]}: 0PRE_F{mb} has no 0PRE_B{mb} "
            "(stage 0's rank must recompute and backward every transposed preprocess, or none "
            "when the preprocess is frozen)"
        )
    for mb in sorted(backwards - forwards):
        problems.append(f"rank {where[(0, 'PRE_B', mb)][0]}: 0PRE_B{mb} has no 0PRE_F{mb}")
    for mb in sorted(backwards):
        rank, pos = where[(0, "PRE_B", mb)]
        body = where.get((0, "B", mb)) or where.get((0, "I", mb))
        if body is not None and body[0] == rank and body[1] > pos:
            problems.append(
                f"rank {rank}, position {pos}: 0PRE_B{mb} runs before stage 0's backward of "
                f"micro-batch {mb}"
            )


class _Run:
    """A simulated execution of all ranks: pointers, posted messages, finished work."""

    def __init__(self, table: ScheduleTable, n_stages: int, placement: dict[int, int]) -> None:
        self.table = table
        self.n_stages = n_stages
        self.placement = placement
        self.explicit = any(
            a is not None and (a.type in _SEND or a.type in _RECV)
            for acts in table.values()
            for a in acts
        )
        # MPipe: micro-batch -> the rank running its transposed preprocess forward.
        self.preprocess_rank: dict[int, int] = {}
        for rank, actions in table.items():
            for action in actions:
                if action is not None and action.type is _PRE_F:
                    assert action.microbatch_index is not None
                    self.preprocess_rank.setdefault(action.microbatch_index, rank)
        self.cursor = dict.fromkeys(table, 0)
        self.done: set[tuple[int, str, int]] = set()
        self.received: dict[int, set[tuple[int, str, int]]] = defaultdict(set)
        # Posted, not yet received messages per (sender, receiver): (send action, sender position).
        self.channels: dict[tuple[int, int], deque[tuple[Action, int]]] = defaultdict(deque)
        self.live: dict[int, set[tuple[int, int]]] = defaultdict(set)
        self.peak_in_flight: dict[int, int] = dict.fromkeys(table, 0)
        self.problems: list[str] = []
        self.deadlocked = False

    def _producer_missing(self, rank: int, leaf: Action) -> str | None:
        """What ``leaf`` still waits for, or None when its input is there."""
        stage, mb = leaf.stage_index, leaf.microbatch_index
        assert mb is not None
        kinds: tuple[str, ...]
        if leaf.type is _PRE_B:
            if (0, "B", mb) in self.done or (0, "I", mb) in self.done:
                return None
            return f"stage 0's backward of micro-batch {mb}"
        if leaf.type is _F and stage == 0 and mb in self.preprocess_rank:
            if self.preprocess_rank[mb] == rank or not self.explicit:
                if (0, "PRE_F", mb) in self.done:
                    return None
                return f"the transposed preprocess 0PRE_F{mb}"
            if (0, "RECV_PRE", mb) in self.received[rank]:
                return None
            return f"0RECV_PRE{mb} (no receive for it ran before)"
        if leaf.type is _F:
            if stage == 0:
                return None
            source, kinds, recv = stage - 1, ("F",), "RECV_F"
        elif leaf.type in (_B, _I):
            if stage == self.n_stages - 1:
                return None if (stage, "F", mb) in self.done else f"its forward {stage}F{mb}"
            source, kinds, recv = stage + 1, ("B", "I"), "RECV_B"
        else:
            return None
        if self.placement.get(source) == rank or not self.explicit:
            if any((source, kind, mb) in self.done for kind in kinds):
                return None
            return f"the output of stage {source}, micro-batch {mb}"
        if (stage, recv, mb) in self.received[rank]:
            return None
        return f"{stage}{recv}{mb} (no receive for it ran before)"

    def _expected_peer(self, action: Action) -> int | None:
        """The rank a send goes to, or the rank a receive comes from."""
        kind, stage = action.type, action.stage_index
        if kind is ActionType.SEND_PRE:
            return self.placement.get(0)
        if kind is ActionType.RECV_PRE:
            assert action.microbatch_index is not None
            return self.preprocess_rank.get(action.microbatch_index)
        if kind in (ActionType.SEND_F, ActionType.RECV_B):
            return self.placement.get(stage + 1)
        return self.placement.get(stage - 1)

    @staticmethod
    def _matching_send(action: Action) -> Action:
        """The send a receive must get."""
        stage, mb = action.stage_index, action.microbatch_index
        if action.type is ActionType.RECV_F:
            return Action(stage - 1, ActionType.SEND_F, mb)
        if action.type is ActionType.RECV_B:
            return Action(stage + 1, ActionType.SEND_B, mb)
        return Action(stage, ActionType.SEND_PRE, mb)

    def _step(self, rank: int) -> bool:
        """Run ``rank``'s next action if it can run now; False when it must wait."""
        pos = self.cursor[rank]
        action = self.table[rank][pos]
        if action is None:
            self.cursor[rank] += 1
            return True
        if action.type in _SEND:
            return self._send(rank, pos, action)
        if action.type in _RECV:
            return self._recv(rank, pos, action)
        if not (
            action.type.is_compute
            or action.type.is_preprocess
            or action.type is ActionType.OVERLAP_F_B
        ):
            self.cursor[rank] += 1  # UNSHARD / RESHARD / REDUCE_GRAD: local, never wait.
            return True
        leaves = leaf_actions(action)
        if any(self._producer_missing(rank, leaf) for leaf in leaves):
            return False
        for leaf in leaves:
            self._finish_compute(rank, leaf)
        self.cursor[rank] += 1
        return True

    def _finish_compute(self, rank: int, leaf: Action) -> None:
        key = _work_key(leaf)
        self.done.add(key)
        stage, mb = key[0], key[2]
        if leaf.type is _F:
            self.live[rank].add((stage, mb))
            self.peak_in_flight[rank] = max(self.peak_in_flight[rank], len(self.live[rank]))
        elif leaf.type in (_B, _W):
            self.live[rank].discard((stage, mb))

    def _send(self, rank: int, pos: int, action: Action) -> bool:
        mb = action.microbatch_index
        assert mb is not None
        producers = {
            ActionType.SEND_F: ("F",),
            ActionType.SEND_B: ("B", "I"),
            ActionType.SEND_PRE: ("PRE_F",),
        }[action.type]
        if not any((action.stage_index, k, mb) in self.done for k in producers):
            what = {"F": "forward", "B": "backward", "PRE_F": "preprocess forward"}[producers[0]]
            self.problems.append(
                f"rank {rank}, position {pos}: {action} sends before "
                f"the {what} that produces it ran"
            )
        peer = self._expected_peer(action)
        if peer is None or peer == rank:
            self.problems.append(
                f"rank {rank}, position {pos}: {action} has no peer rank (the receiving stage "
                f"is {'on this rank' if peer == rank else 'not in the table'})"
            )
        else:
            self.channels[(rank, peer)].append((action, pos))
        self.cursor[rank] += 1
        return True

    def _recv(self, rank: int, pos: int, action: Action) -> bool:
        peer = self._expected_peer(action)
        if peer is None or peer == rank:
            self.problems.append(
                f"rank {rank}, position {pos}: {action} has no peer rank to receive from"
            )
            self.cursor[rank] += 1
            return True
        queue = self.channels[(peer, rank)]
        if not queue:
            return False
        send, send_pos = queue.popleft()
        if send != self._matching_send(action):
            self.problems.append(
                f"rank {rank}, position {pos}: {action} would receive {send} (rank {peer}, "
                f"position {send_pos}): messages between two ranks match in posting order"
            )
        assert action.microbatch_index is not None
        self.received[rank].add((action.stage_index, action.type.value, action.microbatch_index))
        self.cursor[rank] += 1
        return True

    def execute(self) -> None:
        ranks = sorted(self.table)
        while True:
            progressed = False
            for rank in ranks:
                while self.cursor[rank] < len(self.table[rank]) and self._step(rank):
                    progressed = True
            if all(self.cursor[r] >= len(self.table[r]) for r in ranks):
                break
            if not progressed:
                self._report_deadlock(ranks)
                break
        for (sender, receiver), queue in sorted(self.channels.items()):
            for send, pos in queue:
                self.problems.append(
                    f"rank {sender}, position {pos}: {send} is never received by rank {receiver}"
                )

    def _report_deadlock(self, ranks: list[int]) -> None:
        self.deadlocked = True
        waits = []
        for rank in ranks:
            pos = self.cursor[rank]
            if pos >= len(self.table[rank]):
                continue
            action = self.table[rank][pos]
            assert action is not None
            if action.type in _RECV:
                reason = f"a send from rank {self._expected_peer(action)}"
            else:
                reason = next(
                    m
                    for m in (self._producer_missing(rank, leaf) for leaf in leaf_actions(action))
                    if m
                )
            waits.append(f"rank {rank} at position {pos} ({action}) waits for {reason}")
        self.problems.append("deadlock: " + "; ".join(waits))
