"""The offline validator: built-ins pass, hand-made broken schedules are caught and named."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.pipelining import schedules as torch_schedules

from hp_pp.actions import Action, ScheduleTable
from hp_pp.comm_lowering import add_communication, add_reduce_grad, add_unshard_reshard
from hp_pp.generators import SCHEDULE_NAMES, STYLE, generate, stage_to_rank
from hp_pp.simulate import PipelineCosts, StageCosts, simulate_schedule
from hp_pp.validate import check_schedule, validate_schedule


def _table(rows: dict[int, str]) -> ScheduleTable:
    """``{0: "0F0 0SEND_F0 - 0B0"}``: space-separated cells, ``-`` for idle."""
    return {
        rank: [None if cell == "-" else Action.parse(cell) for cell in row.split()]
        for rank, row in rows.items()
    }


def _sizes(name: str) -> list[tuple[int, int, int]]:
    if name in ("GPipe", "1F1B"):
        return [(2, 2, 2), (2, 2, 5), (3, 3, 3), (3, 3, 7), (4, 4, 8)]
    if name in ("ZBVZeroBubble", "DualPipeV"):
        return [(1, 2, 2), (2, 4, 4), (2, 4, 7), (3, 6, 6), (3, 6, 9), (4, 8, 8)]
    return [(2, 4, 2), (2, 4, 4), (3, 6, 3), (3, 6, 6), (4, 8, 8), (2, 6, 4), (3, 3, 6), (4, 8, 5)]


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_builtin_schedule_is_valid(name: str) -> None:
    for p, n, m in _sizes(name):
        try:
            compute = generate(name, pp_size=p, num_stages=n, n_microbatches=m)
        except ValueError:
            continue
        lowered = add_communication(compute, num_stages=n, style=STYLE[name])
        with_fsdp = add_unshard_reshard(add_reduce_grad(lowered, n_microbatches=m))
        for table in (compute, lowered, with_fsdp):
            report = check_schedule(table, num_stages=n, n_microbatches=m, style=STYLE[name])
            assert report.ok
            assert not report.deadlocked
            assert report.pp_size == p
            assert report.num_stages == n


def test_peak_in_flight_closed_forms() -> None:
    p, m = 4, 8
    gpipe = validate_schedule(generate("GPipe", pp_size=p, num_stages=p, n_microbatches=m))
    assert gpipe.peak_in_flight == dict.fromkeys(range(p), m)
    one_f_one_b = validate_schedule(generate("1F1B", pp_size=p, num_stages=p, n_microbatches=m))
    assert one_f_one_b.peak_in_flight == {r: p - r for r in range(p)}


def test_deadlock_is_caught_with_rank_and_action() -> None:
    # Rank 0 waits for the gradient of micro-batch 0 before sending micro-batch 1's
    # activation, which rank 1 needs before it runs (and sends) that gradient.
    table = _table(
        {
            0: "0F0 0SEND_F0 0F1 0RECV_B0 0SEND_F1 0B0 0RECV_B1 0B1",
            1: "1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1",
        }
    )
    report = validate_schedule(table)
    assert report.deadlocked
    (deadlock,) = [p for p in report.problems if p.startswith("deadlock")]
    assert "rank 0 at position 3 (0RECV_B0) waits for a send from rank 1" in deadlock
    assert "rank 1 at position 1 (1RECV_F1) waits for a send from rank 0" in deadlock
    with pytest.raises(ValueError, match=r"deadlock: rank 0 at position 3 \(0RECV_B0\)"):
        check_schedule(table)


def test_compute_only_deadlock_names_the_waiting_actions() -> None:
    table = _table({0: "0F0 0B0 0F1 0B1", 1: "1F1 1B1 1F0 1B0"})
    report = validate_schedule(table)
    assert report.deadlocked
    assert any(
        "rank 0 at position 1 (0B0) waits for the output of stage 1, micro-batch 0" in p
        and "rank 1 at position 0 (1F1) waits for the output of stage 0, micro-batch 1" in p
        for p in report.problems
    )


def test_receives_out_of_posting_order_are_mismatched() -> None:
    table = _table(
        {
            0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
            1: "1RECV_F1 1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1",
        }
    )
    report = validate_schedule(table)
    assert not report.deadlocked
    assert (
        "rank 1, position 0: 1RECV_F1 would receive 0SEND_F0 (rank 0, position 1): "
        "messages between two ranks match in posting order" in report.problems
    )


def test_unmatched_send_and_missing_receive() -> None:
    table = _table(
        {
            0: "0F0 0SEND_F0 0SEND_F0 0RECV_B0 0B0",
            1: "1RECV_F0 1F0 1B0 1SEND_B0",
        }
    )
    report = validate_schedule(table)
    assert "rank 0, position 2: 0SEND_F0 is never received by rank 1" in report.problems
    missing_recv = _table({0: "0F0 0SEND_F0 0RECV_B0 0B0", 1: "1F0 1B0 1SEND_B0"})
    report = validate_schedule(missing_recv)
    assert report.deadlocked
    assert any("rank 1 at position 0 (1F0) waits for 1RECV_F0" in p for p in report.problems)


def test_order_duplicates_and_missing_work() -> None:
    backward_first = _table({0: "0B0 0F0"})
    assert (
        "rank 0, position 0: 0B0 runs before its forward 0F0"
        in validate_schedule(backward_first).problems
    )
    weight_first = _table({0: "0F0 0W0 0I0"})
    assert (
        "rank 0, position 1: 0W0 runs before its input backward 0I0"
        in validate_schedule(weight_first).problems
    )
    duplicate = _table({0: "0F0 0F0 0B0"})
    assert any("duplicate 0F0" in p for p in validate_schedule(duplicate).problems)
    missing = _table({0: "0F0 0B0 0F1"})
    assert (
        "stage 0, micro-batch 1: no backward (0B1 or 0I1 + 0W1)"
        in validate_schedule(missing).problems
    )
    no_weight = _table({0: "0F0 0I0"})
    assert "rank 0: 0I0 has no 0W0" in validate_schedule(no_weight).problems
    short = validate_schedule(_table({0: "0F0 0B0"}), n_microbatches=2)
    assert "stage 0, micro-batch 1: no forward 0F1" in short.problems


def test_placement_problems() -> None:
    table = generate("ZBV", pp_size=2, num_stages=4, n_microbatches=4)
    report = validate_schedule(table, style="loop")
    assert any("belongs to rank 0 under the 'loop' placement" in p for p in report.problems)
    two_ranks = _table({0: "0F0 0B0", 1: "0F1 0B1"})
    assert any(
        "runs stage 0, which rank 0 also runs" in p for p in validate_schedule(two_ranks).problems
    )


def test_bad_input_types() -> None:
    with pytest.raises(TypeError, match="expected an Action or None, got '0F0'"):
        validate_schedule({0: ["0F0"]})  # type: ignore[list-item]
    with pytest.raises(TypeError, match="table must be a dict"):
        validate_schedule([[Action.parse("0F0")]])  # type: ignore[arg-type]


def test_mpipe_preprocess_checks() -> None:
    # Trainable preprocess: a PRE_B for every transposed micro-batch, after stage 0's backward.
    good = _table(
        {
            0: "0PRE_F0 0RECV_PRE1 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0PRE_B0 0RECV_B1 0B1 "
            "0PRE_B1",
            1: "0PRE_F1 0SEND_PRE1 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
        }
    )
    assert validate_schedule(good).ok
    frozen = {
        r: [a for a in acts if a is None or a.type.name != "PREPROCESS_B"]
        for r, acts in good.items()
    }
    assert validate_schedule(frozen).ok
    one_missing = {0: [a for a in good[0] if str(a) != "0PRE_B1"], 1: good[1]}
    assert any("0PRE_F1 has no 0PRE_B1" in p for p in validate_schedule(one_missing).problems)
    early = _table({0: "0PRE_F0 0PRE_B0 0F0 0B0"})
    report = validate_schedule(early)
    assert report.deadlocked
    assert any(
        "0PRE_B0 runs before stage 0's backward of micro-batch 0" in p for p in report.problems
    )
    no_recv = {0: [a for a in good[0] if str(a) != "0RECV_PRE1"], 1: good[1]}
    report = validate_schedule(no_recv)
    assert any("0F1) waits for 0RECV_PRE1" in p for p in report.problems)
    assert any("0SEND_PRE1 is never received by rank 0" in p for p in report.problems)
    wrong_rank = _table({0: "0F0 0B0", 1: "0PRE_F0 0PRE_B0"})
    assert any(
        "0PRE_B0 must run on stage 0's rank 0" in p for p in validate_schedule(wrong_rank).problems
    )


@st.composite
def _random_orders(draw: st.DrawFn) -> tuple[ScheduleTable, int]:
    """One stage per rank; each rank runs its forwards and backwards in a random order
    (each backward after its own forward), so some tables deadlock and some do not."""
    p = draw(st.integers(2, 3))
    m = draw(st.integers(1, 3))
    table: ScheduleTable = {}
    for rank in range(p):
        cells = draw(
            st.permutations([f"{rank}F{i}" for i in range(m)] + [f"{rank}B{i}" for i in range(m)])
        )
        order = list(cells)
        for i in range(m):
            f, b = order.index(f"{rank}F{i}"), order.index(f"{rank}B{i}")
            if b < f:
                order[f], order[b] = order[b], order[f]
        table[rank] = [Action.parse(c) for c in order]
    return table, p


@settings(max_examples=60, deadline=None)
@given(_random_orders())
def test_validator_lowering_and_simulator_agree(case: tuple[ScheduleTable, int]) -> None:
    table, p = case
    report = validate_schedule(table)
    costs = PipelineCosts(default=StageCosts(1.0, 1.5, 0.5), transfer=0.25)
    if report.deadlocked:
        with pytest.raises(ValueError, match="every rank waits"):
            add_communication(table, num_stages=p, style="loop")
        with pytest.raises(ValueError, match="every rank waits"):
            simulate_schedule(table, costs)
        return
    assert report.ok, report.problems
    lowered = add_communication(table, num_stages=p, style="loop")
    assert validate_schedule(lowered).ok
    assert simulate_schedule(lowered, costs).step_time == pytest.approx(
        simulate_schedule(table, costs).step_time
    )


def test_verdicts_agree_with_torchs_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    def torch_runs(table: ScheduleTable, style: str, num_stages: int) -> bool:
        order = {
            r: [torch_schedules._Action.from_str(str(a)) for a in acts if a is not None]
            for r, acts in table.items()
        }
        try:
            torch_schedules._simulate_comms_compute(
                order, lambda s: stage_to_rank(s, len(table), style), num_stages
            )
        except ValueError:
            return False
        return True

    # torch's dry run knows neither OVERLAP_F_B nor MPipe's actions.
    for name in (
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "LoopedBFS",
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
    ):
        for p in (2, 3):
            stages = p if name in ("GPipe", "1F1B") else 2 * p
            table = generate(name, pp_size=p, num_stages=stages, n_microbatches=2 * p)
            lowered = add_communication(table, num_stages=stages, style=STYLE[name])
            assert torch_runs(lowered, STYLE[name], stages)
            assert validate_schedule(lowered).ok
    deadlock = _table(
        {
            0: "0F0 0SEND_F0 0F1 0RECV_B0 0SEND_F1 0B0 0RECV_B1 0B1",
            1: "1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1",
        }
    )
    assert not torch_runs(deadlock, "loop", 2)
    assert validate_schedule(deadlock).deadlocked
    capsys.readouterr()  # torch prints its stuck schedule
