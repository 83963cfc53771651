"""The simulator: closed-form bubbles, zero-bubble beats 1F1B, memory, transfers, pictures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hp_pp.actions import Action
from hp_pp.comm_lowering import add_communication, add_reduce_grad, add_unshard_reshard
from hp_pp.generators import SCHEDULE_NAMES, STYLE, generate
from hp_pp.simulate import PipelineCosts, StageCosts, simulate_schedule
from hp_pp.timeline import write_chrome_trace, write_timeline_png


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 8), (3, 5), (4, 8), (4, 13)])
def test_bubble_equals_closed_form(name: str, p: int, m: int) -> None:
    costs = PipelineCosts(default=StageCosts(forward=1.0, backward_input=1.3, backward_weight=0.7))
    table = generate(name, pp_size=p, num_stages=p, n_microbatches=m)
    for run in (table, add_communication(table, num_stages=p, style="loop")):
        result = simulate_schedule(run, costs)
        assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert result.step_time == pytest.approx((m + p - 1) * 3.0)
        assert result.busy_time == pytest.approx(dict.fromkeys(range(p), 3.0 * m))


def test_zero_bubble_schedules_beat_1f1b() -> None:
    p, m = 4, 8
    model = PipelineCosts()  # F = I = W = 1 per stage of a 4-stage cut
    baseline = simulate_schedule(generate("1F1B", pp_size=p, num_stages=p, n_microbatches=m), model)
    for name, stages in (
        ("InterleavedZeroBubble", p),
        ("InterleavedZeroBubble", 2 * p),
        ("ZBVZeroBubble", 2 * p),
    ):
        table = generate(name, pp_size=p, num_stages=stages, n_microbatches=m)
        result = simulate_schedule(table, model.split_evenly(stages, p))
        assert result.bubble_fraction < baseline.bubble_fraction / 2, name
        assert result.step_time < baseline.step_time, name


def test_interleaving_closed_form_and_memory() -> None:
    p, m, v = 4, 8, 2
    table = generate("Interleaved1F1B", pp_size=p, num_stages=v * p, n_microbatches=m)
    result = simulate_schedule(table, PipelineCosts().split_evenly(v * p, p))
    # Megatron's interleaved bubble: (p - 1) / (v * m + p - 1).
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    gpipe = simulate_schedule(generate("GPipe", pp_size=p, num_stages=p, n_microbatches=m))
    one_f_one_b = simulate_schedule(generate("1F1B", pp_size=p, num_stages=p, n_microbatches=m))
    assert gpipe.peak_activation_memory == dict.fromkeys(range(p), float(m))
    assert one_f_one_b.peak_activation_memory == {r: float(p - r) for r in range(p)}


def test_transfer_cost_adds_to_the_critical_path() -> None:
    p, m, hop = 3, 4, 0.25
    table = generate("GPipe", pp_size=p, num_stages=p, n_microbatches=m)
    free = simulate_schedule(table)
    costly = simulate_schedule(table, PipelineCosts(transfer=hop))
    # GPipe's critical path crosses p - 1 hops forward and p - 1 back.
    assert costly.step_time == pytest.approx(free.step_time + 2 * (p - 1) * hop)
    lowered = add_communication(table, num_stages=p, style="loop")
    assert simulate_schedule(lowered, PipelineCosts(transfer=hop)).step_time == pytest.approx(
        costly.step_time
    )


def test_uneven_stages_and_full_backward_override() -> None:
    costs = PipelineCosts(
        default=StageCosts(forward=1, backward_input=1, backward_weight=1, full_backward=1.5),
        per_stage={1: StageCosts(forward=3, backward_input=2, backward_weight=2)},
    )
    table = generate("GPipe", pp_size=2, num_stages=2, n_microbatches=1)
    result = simulate_schedule(table, costs)
    # 0F0 [0,1], 1F0 [1,4], 1B0 [4,8], 0B0 [8,9.5]
    assert result.step_time == pytest.approx(9.5)
    starts = {str(t.action): (t.start, t.end) for t in result.timeline}
    assert starts["1B0"] == pytest.approx((4.0, 8.0))


def test_fsdp_action_costs_are_charged() -> None:
    table = add_unshard_reshard(
        add_reduce_grad(
            generate("GPipe", pp_size=2, num_stages=2, n_microbatches=2), n_microbatches=2
        )
    )
    plain = simulate_schedule(table)
    charged = simulate_schedule(table, PipelineCosts(unshard=0.5, reduce_grad=0.25))
    assert charged.step_time > plain.step_time
    kinds = {t.action.type.value for t in charged.timeline}
    assert {"UNSHARD", "REDUCE_GRAD"} <= kinds


def test_deadlock_raises() -> None:
    table = {
        0: [Action.parse(a) for a in ("0F0", "0B0", "0F1", "0B1")],
        1: [Action.parse(a) for a in ("1F1", "1B1", "1F0", "1B0")],
    }
    with pytest.raises(ValueError, match=r"every rank waits.*check_schedule"):
        simulate_schedule(table)


def test_costs_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "costs.toml"
    path.write_text(
        "forward = 2.0\nbackward_input = 1.5\ntransfer = 0.1\n[stage.1]\nforward = 4.0\n"
    )
    costs = PipelineCosts.from_toml(path)
    assert costs.transfer == pytest.approx(0.1)
    assert costs.stage(0).forward == pytest.approx(2.0)
    assert costs.stage(1).forward == pytest.approx(4.0)
    assert costs.stage(1).backward_input == pytest.approx(1.5)
    path.write_text("fwd = 1\n")
    with pytest.raises(ValueError, match=r"unknown keys \['fwd'\]"):
        PipelineCosts.from_toml(path)
    path.write_text("forward = -1\n")
    with pytest.raises(ValueError, match="forward must be a number >= 0, got -1"):
        PipelineCosts.from_toml(path)
    path.write_text("forward = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        PipelineCosts.from_toml(path)


def test_pictures(tmp_path: Path) -> None:
    table = generate("DualPipeV", pp_size=2, num_stages=4, n_microbatches=4)
    result = simulate_schedule(table)
    trace = tmp_path / "trace.json"
    write_chrome_trace(result, trace, name="DualPipeV")
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(result.timeline)
    assert {e["tid"] for e in spans} == {0, 1}
    assert any(e["name"].endswith("OVERLAP_F_B") for e in spans)
    png = tmp_path / "timeline.png"
    write_timeline_png(result, png, title="DualPipeV")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_builtin_simulates_the_same_with_explicit_transfers() -> None:
    # Lowered tables send right after the producer, so their step time equals the
    # compute-only table's with the same link cost: the two simulation paths check each other.
    costs = PipelineCosts(default=StageCosts(1.0, 1.2, 0.7), transfer=0.3)
    for name in SCHEDULE_NAMES:
        for p in (2, 3):
            stages = p if name in ("GPipe", "1F1B") else 2 * p
            table = generate(name, pp_size=p, num_stages=stages, n_microbatches=2 * p)
            lowered = add_communication(table, num_stages=stages, style=STYLE[name])
            compute_only = simulate_schedule(table, costs)
            explicit = simulate_schedule(lowered, costs)
            assert explicit.step_time == pytest.approx(compute_only.step_time), (name, p)
            assert 0.0 <= explicit.bubble_fraction < 0.5


def test_mpipe_moves_the_preprocess_off_stage_zero() -> None:
    from hp_pp.generators.mpipe import mpipe

    p, n, m, pre = 4, 8, 8, 0.5
    # Stage 0 = preprocess (0.5) + its share of the body (0.5); all other stages 0.5.
    costs = PipelineCosts(
        default=StageCosts(0.5, 0.25, 0.25),
        per_stage={0: StageCosts(0.5 + pre, 0.25 + pre / 2, 0.25 + pre / 2)},
        preprocess_forward=pre,
        preprocess_backward=pre,
    )
    interleaved = simulate_schedule(
        generate("Interleaved1F1B", pp_size=p, num_stages=n, n_microbatches=m), costs
    )
    frozen_costs = PipelineCosts(
        default=costs.default,
        per_stage={0: StageCosts(0.5 + pre, 0.25, 0.25)},
        preprocess_forward=pre,
    )
    frozen_body = simulate_schedule(
        generate("Interleaved1F1B", pp_size=p, num_stages=n, n_microbatches=m), frozen_costs
    )
    frozen = simulate_schedule(
        mpipe(pp_size=p, num_stages=n, n_microbatches=m, trainable_preprocess=False), frozen_costs
    )
    # A frozen preprocess leaves stage 0's rank for the first p micro-batches: a shorter step.
    assert frozen.step_time < frozen_body.step_time
    timed = {str(t.action): t for t in frozen.timeline}
    for rank in range(1, p):
        assert timed[f"0PRE_F{rank}"].rank == rank
        assert timed[f"0PRE_F{rank}"].start == 0.0
    assert timed["0F1"].end - timed["0F1"].start == pytest.approx(0.5)  # body part only
    assert timed["0F5"].end - timed["0F5"].start == pytest.approx(1.0)  # preprocess inline
    # A trainable one recomputes on stage 0's rank: PRE_B costs forward + backward of the block.
    trainable = simulate_schedule(
        generate("MPipe", pp_size=p, num_stages=n, n_microbatches=m), costs
    )
    timed = {str(t.action): t for t in trainable.timeline}
    assert timed["0PRE_B2"].end - timed["0PRE_B2"].start == pytest.approx(2 * pre)
    assert timed["0PRE_B2"].rank == 0
    # Rank 0 recomputes p preprocess forwards and hands p - 1 to other ranks: one more.
    assert trainable.busy_time[0] == pytest.approx(interleaved.busy_time[0] + pre)
    too_big = PipelineCosts(preprocess_forward=5.0)
    with pytest.raises(ValueError, match="preprocess part of stage 0"):
        simulate_schedule(generate("MPipe", pp_size=2, num_stages=4, n_microbatches=4), too_big)


def test_missing_matplotlib_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = simulate_schedule(generate("GPipe", pp_size=2, num_stages=2, n_microbatches=2))
    with pytest.raises(ImportError, match=r"pip install 'hp-pp\[plot\]'"):
        write_timeline_png(result, tmp_path / "x.png")
    write_chrome_trace(result, tmp_path / "x.json")  # needs nothing
