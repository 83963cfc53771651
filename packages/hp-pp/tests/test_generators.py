"""Schedule generators: orders equal PyTorch 2.13's, sizes checked, names and placements."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from hp_pp.actions import Action, ActionType
from hp_pp.comm_lowering import add_communication, add_reduce_grad, add_unshard_reshard
from hp_pp.generators import (
    SCHEDULE_NAMES,
    STYLE,
    canonical_schedule_name,
    generate,
    rank_to_stages,
    stage_to_rank,
)


# Oracle: torch builds its orders in methods that need only a few attributes, so they are
# called on a namespace instead of on real stages and process groups.
def torch_compute_order(
    name: str, pp_size: int, num_stages: int, n_microbatches: int
) -> dict[int, list[str]]:
    """``{rank: [str(action) or "" for idle]}`` as torch 2.13 generates it."""
    local = num_stages // pp_size
    if name == "GPipe":
        ns = SimpleNamespace(_num_stages=pp_size, _n_microbatches=n_microbatches)
        order = torch_schedules.ScheduleGPipe._get_pipeline_order(ns)
    elif name == "LoopedBFS":
        ns = SimpleNamespace(
            _stages=[None] * local, pp_group_size=pp_size, _n_microbatches=n_microbatches
        )
        order = {
            r: torch_schedules.ScheduleLoopedBFS._calculate_single_rank_operations(ns, r)
            for r in range(pp_size)
        }
    elif name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n_microbatches // pp_size)
        ns = SimpleNamespace(
            n_local_stages=local,
            pp_group_size=pp_size,
            _n_microbatches=n_microbatches,
            number_of_rounds=rounds,
            microbatches_per_round=n_microbatches // rounds,
        )
        cls = getattr(torch_schedules, "Schedule" + name)
        ns.pipeline_order = {
            r: cls._calculate_single_rank_operations(ns, r) for r in range(pp_size)
        }
        order = ns.pipeline_order
        if name == "InterleavedZeroBubble":
            order = cls._add_bubbles_to_actions(ns, num_stages)
    elif name in ("ZBVZeroBubble", "DualPipeV"):
        ns = SimpleNamespace(
            pp_group_size=pp_size, _n_microbatches=n_microbatches, num_stages=num_stages
        )
        cls = getattr(torch_schedules, "Schedule" + name)
        order = {r: cls._calculate_single_rank_operations(ns, r) for r in range(pp_size)}
    else:
        raise KeyError(name)
    return {r: ["" if a is None else str(a) for a in acts] for r, acts in order.items()}


def _shapes(name: str) -> list[tuple[int, int, int]]:
    if name in ("GPipe", "1F1B"):
        return [(p, p, m) for p in (1, 2, 3, 4) for m in (p, p + 1, 2 * p, 8)]
    if name in ("ZBVZeroBubble", "DualPipeV"):
        return [(p, 2 * p, m) for p in (1, 2, 3, 4) for m in (2 * p, 2 * p + 1, 2 * p + 3, 12)]
    return [(p, p * k, m) for p in (1, 2, 3, 4) for k in (1, 2, 3) for m in (1, 2, 3, 4, 6, 8, 12)]


def _strings(table: dict, *, drop_idle: bool) -> dict[int, list[str]]:
    out = {r: ["" if a is None else str(a) for a in acts] for r, acts in table.items()}
    return {r: [a for a in acts if a] for r, acts in out.items()} if drop_idle else out


@pytest.mark.parametrize("name", [n for n in SCHEDULE_NAMES if n not in ("1F1B", "MPipe")])
def test_order_equals_torch(name: str) -> None:
    checked = 0
    for p, n, m in _shapes(name):
        try:
            ours = generate(name, pp_size=p, num_stages=n, n_microbatches=m)
        except ValueError:
            continue
        theirs = torch_compute_order(name, p, n, m)
        if name == "GPipe":
            # torch's GPipe picture drops idle slots and appends REDUCE_GRAD.
            theirs = {r: [a for a in acts if a and "REDUCE" not in a] for r, acts in theirs.items()}
            assert _strings(ours, drop_idle=True) == theirs, (p, n, m)
        else:
            assert _strings(ours, drop_idle=False) == theirs, (p, n, m)
        checked += 1
    assert checked >= 8


def test_1f1b_order_equals_torch_runtime_order() -> None:
    # torch's 1F1B *picture* mislabels the last rank's forwards (F1..Fm); its runtime runs
    # warm-up forwards, then F/B pairs, then backwards. Compare with that and with the picture
    # on every other rank.
    for p, n, m in _shapes("1F1B"):
        ours = _strings(generate("1F1B", pp_size=p, num_stages=n, n_microbatches=m), drop_idle=True)
        picture = torch_compute_order_1f1b(p, m)
        for rank in range(p):
            warmup = p - 1 - rank
            expected = [f"{rank}F{i}" for i in range(warmup)]
            for i in range(m - warmup):
                expected += [f"{rank}F{warmup + i}", f"{rank}B{i}"]
            expected += [f"{rank}B{i}" for i in range(m - warmup, m)]
            assert ours[rank] == expected
            if rank != p - 1:
                assert ours[rank] == picture[rank]


def torch_compute_order_1f1b(pp_size: int, n_microbatches: int) -> dict[int, list[str]]:
    ns = SimpleNamespace(_num_stages=pp_size, _n_microbatches=n_microbatches)
    order = torch_schedules.Schedule1F1B._get_pipeline_order(ns)
    return {
        r: [str(a) for a in acts if a is not None and "REDUCE" not in str(a)]
        for r, acts in order.items()
    }


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_forward_and_backward_once_on_its_rank(name: str) -> None:
    for p, n, m in _shapes(name)[::3]:
        try:
            table = generate(name, pp_size=p, num_stages=n, n_microbatches=m)
        except ValueError:
            continue
        seen: dict[tuple[int, str], list[int]] = {}
        for rank, acts in table.items():
            for action in acts:
                if action is None:
                    continue
                for leaf in action.sub_actions or (action,):
                    if leaf.type.is_preprocess:
                        continue
                    assert stage_to_rank(leaf.stage_index, p, STYLE[name]) == rank
                    kind = (
                        "B"
                        if leaf.type in (ActionType.FULL_BACKWARD, ActionType.BACKWARD_INPUT)
                        else leaf.type.value
                    )
                    seen.setdefault((leaf.stage_index, kind), []).append(leaf.microbatch_index)
        for stage in range(n):
            assert sorted(seen[(stage, "F")]) == list(range(m))
            assert sorted(seen[(stage, "B")]) == list(range(m))


def test_communication_lowering_equals_torch() -> None:
    cases = [
        ("GPipe", 3, 3, 4),
        ("1F1B", 4, 4, 8),
        ("Interleaved1F1B", 3, 6, 6),
        ("LoopedBFS", 2, 4, 3),
        ("InterleavedZeroBubble", 4, 8, 8),
        ("ZBVZeroBubble", 3, 6, 6),
        ("DualPipeV", 2, 4, 6),
    ]
    for name, p, n, m in cases:
        table = generate(name, pp_size=p, num_stages=n, n_microbatches=m)
        ours = add_communication(table, num_stages=n, style=STYLE[name])
        as_torch = {
            r: [None if a is None else torch_schedules._Action.from_str(str(a)) for a in acts]
            for r, acts in table.items()
        }
        theirs = torch_schedules._add_send_recv(
            as_torch, lambda s, p=p, name=name: stage_to_rank(s, p, STYLE[name]), n
        )
        assert {r: [str(a) for a in acts] for r, acts in ours.items()} == {
            r: [str(a) for a in acts] for r, acts in theirs.items()
        }, name


def test_lowering_skips_same_rank_transfers() -> None:
    table = generate("ZBV", pp_size=2, num_stages=4, n_microbatches=4)
    lowered = add_communication(table, num_stages=4, style="v")
    sends = [a for a in lowered[1] if a is not None and a.type is ActionType.SEND_F]
    # Rank 1 holds stages 1 and 2: stage 1's output goes to stage 2 without a transfer.
    assert {a.stage_index for a in sends} == {2}
    assert len(sends) == 4


def test_lowering_rejects_bad_tables() -> None:
    table = generate("GPipe", pp_size=2, num_stages=2, n_microbatches=2)
    with pytest.raises(ValueError, match="rank 0: 1F0 belongs to rank 1"):
        add_communication({0: table[1], 1: table[0]}, num_stages=2, style="loop")
    lowered = add_communication(table, num_stages=2, style="loop")
    with pytest.raises(ValueError, match="not a compute action"):
        add_communication(lowered, num_stages=2, style="loop")
    # Rank 1 wants micro-batch 1 first; rank 0 needs the backward of 0 before sending 1.
    rows = {0: ["0F0", "0B0", "0F1", "0B1"], 1: ["1F1", "1B1", "1F0", "1B0"]}
    stuck = {rank: [Action.parse(cell) for cell in row] for rank, row in rows.items()}
    with pytest.raises(ValueError, match="every rank waits"):
        add_communication(stuck, num_stages=2, style="loop")


def test_names_aliases_and_styles() -> None:
    assert canonical_schedule_name("ScheduleZBVZeroBubble") == "ZBVZeroBubble"
    assert canonical_schedule_name("zbv") == "ZBVZeroBubble"
    assert canonical_schedule_name("schedule1f1b") == "1F1B"
    assert canonical_schedule_name("GPIPE") == "GPipe"
    assert STYLE["DualPipeV"] == "v"
    assert STYLE["scheduleinterleaved1f1b"] == "loop"
    assert set(STYLE) == set(SCHEDULE_NAMES)
    with pytest.raises(ValueError, match=r"unknown schedule 'Nope'.*GPipe"):
        generate("Nope", pp_size=2, num_stages=2, n_microbatches=2)


def test_stage_to_rank_styles() -> None:
    assert [stage_to_rank(s, 3, "loop") for s in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [stage_to_rank(s, 3, "v") for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert rank_to_stages(1, 3, 6, "v") == [1, 4]
    with pytest.raises(ValueError, match="style must be 'loop' or 'v'"):
        stage_to_rank(0, 2, "zigzag")
    with pytest.raises(ValueError, match="stage 4 does not exist"):
        stage_to_rank(4, 2, "v")


@pytest.mark.parametrize(
    ("name", "sizes", "message"),
    [
        ("GPipe", (2, 4, 4), "num_stages must equal pp_size, got num_stages=4, pp_size=2"),
        ("1F1B", (4, 4, 3), "n_microbatches >= num_stages, got n_microbatches=3, num_stages=4"),
        ("Interleaved1F1B", (2, 5, 4), "multiple of pp_size, got num_stages=5, pp_size=2"),
        ("Interleaved1F1B", (2, 4, 5), "must be a multiple of 2, got n_microbatches=5"),
        ("InterleavedZeroBubble", (4, 8, 9), "must be a multiple of 2, got n_microbatches=9"),
        ("ZBVZeroBubble", (2, 2, 4), "2 \\* pp_size = 4, got num_stages=2"),
        ("DualPipeV", (2, 4, 3), "n_microbatches >= num_stages, got n_microbatches=3"),
        ("LoopedBFS", (2, 4, 0), "n_microbatches must be >= 1, got 0"),
    ],
)
def test_invalid_sizes_name_values_and_rule(
    name: str, sizes: tuple[int, int, int], message: str
) -> None:
    p, n, m = sizes
    with pytest.raises(ValueError, match=message):
        generate(name, pp_size=p, num_stages=n, n_microbatches=m)


def test_mpipe_is_interleaved_1f1b_with_a_transposed_preprocess() -> None:
    for p, n, m in [(2, 4, 4), (3, 6, 6), (4, 8, 8), (4, 8, 2), (3, 3, 3)]:
        body = generate("Interleaved1F1B", pp_size=p, num_stages=n, n_microbatches=m)
        table = generate("MPipe", pp_size=p, num_stages=n, n_microbatches=m)
        transposed = min(p, m)
        for rank in range(p):
            pre = [a for a in table[rank] if a is not None and a.type.is_preprocess]
            rest = [a for a in table[rank] if a is None or not a.type.is_preprocess]
            assert rest == body[rank]
            expected_pre = [f"0PRE_F{rank}"] if rank < transposed else []
            if rank == 0:
                expected_pre += [f"0PRE_B{mb}" for mb in range(transposed)]
            assert [str(a) for a in pre] == expected_pre
        # The preprocess forward of micro-batch r is rank r's first action (warm-up idle time),
        # and stage 0's rank runs each PRE_B right after stage 0's backward of that batch.
        assert [str(table[r][0]) for r in range(transposed)] == [
            f"0PRE_F{r}" for r in range(transposed)
        ]
        rank0 = [str(a) for a in table[0] if a is not None]
        for mb in range(transposed):
            assert rank0[rank0.index(f"0B{mb}") + 1] == f"0PRE_B{mb}"
    with pytest.raises(ValueError, match="MPipe places stage s on rank s % pp_size"):
        generate("MPipe", pp_size=2, num_stages=3, n_microbatches=4)


def test_mpipe_lowering_ships_the_preprocess_to_stage_zero() -> None:
    table = generate("ScheduleMPipeTranspose", pp_size=3, num_stages=6, n_microbatches=6)
    lowered = add_communication(table, num_stages=6, style=STYLE["MPipe"])
    for rank in (1, 2):
        cells = [str(a) for a in lowered[rank]]
        assert cells[:2] == [f"0PRE_F{rank}", f"0SEND_PRE{rank}"]
    rank0 = [str(a) for a in lowered[0]]
    assert "0SEND_PRE0" not in rank0
    # Stage 0's forward of a transposed micro-batch comes after its preprocess output arrived.
    for mb in (1, 2):
        assert rank0.index(f"0RECV_PRE{mb}") < rank0.index(f"0F{mb}")


@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"])
def test_fsdp_lowering_equals_torch(name: str) -> None:
    p = 3
    stages = p if name == "1F1B" else 2 * p
    m = 2 * p
    table = generate(name, pp_size=p, num_stages=stages, n_microbatches=m)
    ours = add_unshard_reshard(add_reduce_grad(table, n_microbatches=m))
    assert add_reduce_grad(add_unshard_reshard(table), n_microbatches=m) == ours
    for rank, acts in table.items():
        as_torch = [None if a is None else torch_schedules._Action.from_str(str(a)) for a in acts]
        theirs = torch_schedules._add_reduce_grad(torch_schedules._add_unshard_reshard(as_torch), m)
        assert [str(a) for a in ours[rank]] == [repr(a) for a in theirs], (name, rank)
