"""NCCL's point-to-point rules as a model: replay what every rank posts and find what would hang.

CPU/gloo forgives what an accelerator does not. This module replays the point-to-point
operations that each rank posts (a *program* per rank) under the rules of NCCL (and HCCL):

1. **One FIFO channel per direction of a rank pair, tags ignored.** The k-th send from rank
   ``a`` to rank ``b`` is matched with the k-th receive that ``b`` posts from ``a``, whatever
   the tags say. When the two are not the same message (the same (stage, micro-batch, kind,
   part)), the receiver silently gets the wrong tensor: a *mismatch*.
2. **Rendezvous.** A send completes only once its receive is posted (and running); a receive
   completes once its send is.
3. **Batches progress together, single operations block.** Operations posted together (one
   ``batch_isend_irecv``, one group) form one unit that starts as a whole and whose operations
   progress together. A unit starts only when every earlier unit of the same rank that involves
   one of its peers has completed: an operation posted on its own blocks every later operation
   to or from the same peer (they share one stream per pair).
4. **Waits block the rank.** A wait on an operation waits for its whole unit; nothing the rank
   posts after the wait is posted before the unit completes.

A program is a list of :class:`Post` and :class:`Wait` events. :func:`replay` runs all ranks'
programs together and returns a :class:`P2PReport`: deadlocks (each blocked rank, the pair and
the two operations involved), mismatches (the rank, the pair, the receive and the send it would
get) and unmatched operations. The executor records the program it really posts
(``PipelineExecutor.trace``), and :func:`hp_pp.validate_schedule` builds the program the
executor would post for a table, so both a live run and a table read from a CSV file are checked
against these rules.

See Also:
    :pt:`torch.distributed.batch_isend_irecv`: posting operations together;
    :pt:`torch.distributed.pipelining.schedules._PipelineScheduleRuntime`: torch's executor,
    which batches each step's transfers for the same reason.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

__all__ = ["P2POp", "P2PReport", "Post", "Wait", "program_from_json", "program_to_json", "replay"]


@dataclass(frozen=True)
class P2POp:
    """One point-to-point operation as posted by one rank.

    Attributes:
        kind: ``"send"`` or ``"recv"``.
        peer: The other rank (global rank).
        ident: What the message is: ``(stage, micro-batch, kind, part)``, e.g.
            ``(0, 3, "F", "data0")`` for the first activation tensor that stage 0 sends for
            micro-batch 3, or ``(2, 1, "B", "data0")`` for a gradient stage 2 sends back. Both
            sides name a message by the *sending* stage.
        shape: The tensor's shape (``None`` when unknown, e.g. offline).
        dtype: The tensor's dtype as a string (``None`` when unknown).
    """

    kind: str
    peer: int
    ident: tuple[Any, ...]
    shape: tuple[int, ...] | None = None
    dtype: str | None = None

    def label(self) -> str:
        """Short text: ``send F(stage 0, mb 3, data0)``."""
        stage, mb, what, part = (*self.ident, "", "", "", "")[:4]
        return f"{self.kind} {what}(stage {stage}, mb {mb}, {part})"


@dataclass(frozen=True)
class Post:
    """A rank posts ``ops`` together (one batch); ``batch`` numbers the batch on that rank."""

    batch: int
    ops: tuple[P2POp, ...]


@dataclass(frozen=True)
class Wait:
    """A rank waits for its batch ``batch`` to complete (for any operation of it)."""

    batch: int


Event = Post | Wait


@dataclass(frozen=True)
class P2PReport:
    """What :func:`replay` found.

    Attributes:
        problems: One message per problem, each naming the rank, the pair and the operations.
        deadlocked: Whether some rank waits forever.
        matched: How many send/receive pairs were matched.
        batches: Per rank, how many batches it posted.
    """

    problems: tuple[str, ...]
    deadlocked: bool
    matched: int = 0
    batches: dict[int, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.problems


@dataclass
class _Unit:
    rank: int
    batch: int
    ops: list[int]  # op ids
    peers: frozenset[int]
    started: bool = False
    done: bool = False


@dataclass
class _OpState:
    op: P2POp
    rank: int
    unit: int  # unit id
    seq: int  # position on its channel
    done: bool = False


def replay(programs: dict[int, list[Event]]) -> P2PReport:
    """Replay every rank's program under NCCL's point-to-point rules.

    Args:
        programs: ``{rank: [Post | Wait, ...]}``: what each rank posts and waits for, in order.

    Returns:
        The :class:`P2PReport`.

    Raises:
        ValueError: a program waits for a batch it never posted, or a rank sends to itself.

    See Also:
        :pt:`torch.distributed.batch_isend_irecv`: what one :class:`Post` stands for.
    """
    ops: list[_OpState] = []
    units: list[_Unit] = []
    unit_of: dict[tuple[int, int], int] = {}
    # (src, dst) -> op ids of sends in posting order; (src, dst) -> receives on dst.
    sends: dict[tuple[int, int], list[int]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[int]] = defaultdict(list)
    # rank -> unit ids in posting order
    rank_units: dict[int, list[int]] = defaultdict(list)
    pc = dict.fromkeys(programs, 0)
    problems: list[str] = []
    mismatch_seen: set[tuple[int, int, int]] = set()
    matched = 0

    def post(rank: int, event: Post) -> None:
        uid = len(units)
        ids = []
        for op in event.ops:
            if op.peer == rank:
                raise ValueError(f"rank {rank} posts {op.label()} to itself")
            oid = len(ops)
            channel = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
            queue = sends[channel] if op.kind == "send" else recvs[channel]
            ops.append(_OpState(op, rank, uid, len(queue)))
            queue.append(oid)
            ids.append(oid)
        units.append(_Unit(rank, event.batch, ids, frozenset(o.peer for o in event.ops)))
        unit_of[(rank, event.batch)] = uid
        rank_units[rank].append(uid)
        if not ids:
            units[uid].started = units[uid].done = True

    def blocker(uid: int) -> int | None:
        """The earliest unfinished unit of the same rank sharing a peer, posted before ``uid``."""
        unit = units[uid]
        for other in rank_units[unit.rank]:
            if other == uid:
                return None
            if not units[other].done and units[other].peers & unit.peers:
                return other
        return None

    progress = True
    while progress:
        progress = False
        # 1. Advance every rank's program through posts and satisfied waits.
        for rank, program in programs.items():
            while pc[rank] < len(program):
                event = program[pc[rank]]
                if isinstance(event, Post):
                    post(rank, event)
                else:
                    key = (rank, event.batch)
                    if key not in unit_of:
                        raise ValueError(
                            f"rank {rank} waits for batch {event.batch}, which it never posted"
                        )
                    if not units[unit_of[key]].done:
                        break
                pc[rank] += 1
                progress = True
        # 2. Start units whose earlier same-peer units are done.
        for uid, unit in enumerate(units):
            if not unit.started and blocker(uid) is None:
                unit.started = True
                progress = True
        # 3. Match started sends and receives in channel order.
        for channel, send_ids in sends.items():
            recv_ids = recvs.get(channel, [])
            for k in range(min(len(send_ids), len(recv_ids))):
                s, r = ops[send_ids[k]], ops[recv_ids[k]]
                if s.done:
                    continue
                if not (units[s.unit].started and units[r.unit].started):
                    break
                s.done = r.done = True
                matched += 1
                progress = True
                if (channel[0], channel[1], k) not in mismatch_seen:
                    mismatch_seen.add((channel[0], channel[1], k))
                    problems += _compare(channel, s.op, r.op, k)
        # 4. Complete units whose operations are all done.
        for unit in units:
            if unit.started and not unit.done and all(ops[o].done for o in unit.ops):
                unit.done = True
                progress = True

    deadlocked = False
    stuck = [r for r, program in programs.items() if pc[r] < len(program)]
    if stuck:
        deadlocked = True
        problems.append(
            "NCCL deadlock: "
            + "; ".join(
                _why_blocked(r, programs[r][pc[r]], units, unit_of, ops, blocker, sends, recvs)
                for r in sorted(stuck)
            )
        )
    for (src, dst), send_ids in sorted(sends.items()):
        recv_ids = recvs.get((src, dst), [])
        for oid in send_ids[len(recv_ids) :]:
            problems.append(
                f"rank {src}, pair ({src}, {dst}): {ops[oid].op.label()} is never received by "
                f"rank {dst}"
            )
    for (src, dst), recv_ids in sorted(recvs.items()):
        send_ids = sends.get((src, dst), [])
        for oid in recv_ids[len(send_ids) :]:
            problems.append(
                f"rank {dst}, pair ({src}, {dst}): {ops[oid].op.label()} has no send from rank "
                f"{src}"
            )
    if not deadlocked:
        for unit in units:
            if not unit.done and not stuck:
                deadlocked = True
                first = next(ops[o] for o in unit.ops if not ops[o].done)
                problems.append(
                    f"NCCL deadlock: rank {unit.rank}'s batch {unit.batch} never completes "
                    f"({first.op.label()} with rank {first.op.peer})"
                )
                break
    return P2PReport(
        problems=tuple(problems),
        deadlocked=deadlocked,
        matched=matched,
        batches={r: len(rank_units[r]) for r in programs},
    )


def _compare(channel: tuple[int, int], send: P2POp, recv: P2POp, k: int) -> list[str]:
    src, dst = channel
    found: list[str] = []
    if tuple(send.ident) != tuple(recv.ident):
        found.append(
            f"rank {dst}, pair ({src}, {dst}): {recv.label()} would get rank {src}'s "
            f"{send.label()} (message {k} on the channel; tags are ignored, messages match in "
            "posting order)"
        )
    elif (
        send.shape is not None
        and recv.shape is not None
        and (tuple(send.shape) != tuple(recv.shape) or send.dtype != recv.dtype)
    ):
        found.append(
            f"rank {dst}, pair ({src}, {dst}): {recv.label()} expects shape {tuple(recv.shape)} "
            f"{recv.dtype} but rank {src}'s {send.label()} is {tuple(send.shape)} {send.dtype}"
        )
    return found


def _why_blocked(
    rank: int,
    event: Event,
    units: list[_Unit],
    unit_of: dict[tuple[int, int], int],
    ops: list[_OpState],
    blocker: Any,
    sends: dict[tuple[int, int], list[int]],
    recvs: dict[tuple[int, int], list[int]],
) -> str:
    assert isinstance(event, Wait)
    uid = unit_of[(rank, event.batch)]
    unit = units[uid]
    waiting = next(ops[o] for o in unit.ops if not ops[o].done)
    peer = waiting.op.peer
    pair = f"({min(rank, peer)}, {max(rank, peer)})"
    head = f"rank {rank}, pair {pair}, waits on {waiting.op.label()}"
    if not unit.started:
        before = blocker(uid)
        assert before is not None
        first = next(ops[o] for o in units[before].ops if not ops[o].done)
        return (
            f"{head}, posted behind its own {first.op.label()} with rank {first.op.peer}, which "
            "has not completed (an operation posted on its own blocks later ones with that peer)"
        )
    channel = (rank, peer) if waiting.op.kind == "send" else (peer, rank)
    partners = recvs[channel] if waiting.op.kind == "send" else sends[channel]
    if waiting.seq < len(partners):
        partner = ops[partners[waiting.seq]]
        return (
            f"{head}, whose partner on rank {peer} is {partner.op.label()}, not yet running "
            f"(rank {peer} posted it behind unfinished operations)"
        )
    verb = "receive" if waiting.op.kind == "send" else "send"
    return f"{head}, but rank {peer} has not posted the matching {verb}"


def program_to_json(program: list[Event]) -> list[dict[str, Any]]:
    """A program as JSON-able dicts (to store a recorded trace)."""
    out: list[dict[str, Any]] = []
    for event in program:
        if isinstance(event, Post):
            out.append(
                {
                    "post": event.batch,
                    "ops": [
                        {
                            "kind": op.kind,
                            "peer": op.peer,
                            "ident": list(op.ident),
                            "shape": None if op.shape is None else list(op.shape),
                            "dtype": op.dtype,
                        }
                        for op in event.ops
                    ],
                }
            )
        else:
            out.append({"wait": event.batch})
    return out


def program_from_json(data: list[dict[str, Any]]) -> list[Event]:
    """The inverse of :func:`program_to_json`."""
    out: list[Event] = []
    for entry in data:
        if "wait" in entry:
            out.append(Wait(int(entry["wait"])))
            continue
        out.append(
            Post(
                int(entry["post"]),
                tuple(
                    P2POp(
                        str(op["kind"]),
                        int(op["peer"]),
                        tuple(op["ident"]),
                        None if op["shape"] is None else tuple(op["shape"]),
                        op["dtype"],
                    )
                    for op in entry["ops"]
                ),
            )
        )
    return out
