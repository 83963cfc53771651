"""The ``hp-pp`` command: simulate and compare, validate files, clear errors with exit code 2."""

from __future__ import annotations

import json
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from hp_pp.cli import main
from hp_pp.comm_lowering import add_communication
from hp_pp.csv_io import write_csv
from hp_pp.generators import generate


def test_simulate_compares_schedules_and_writes_pictures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "simulate",
        "--schedule",
        "ZBV",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--no-png",
        "--out",
    ]
    code = main([*argv, str(tmp_path)])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {
        line.split()[1] if line.startswith("*") else line.split()[0]: line for line in lines[2:-1]
    }
    assert lines[0] == "8 micro-batches; step time relative to ZBVZeroBubble (*)"
    assert rows["ZBVZeroBubble"].startswith("* ZBVZeroBubble")
    assert set(rows) == {
        "ZBVZeroBubble",
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "LoopedBFS",
        "InterleavedZeroBubble",
        "DualPipeV",
        "MPipe",
    }
    # Same 2 ranks and the same model: 1F1B's bubble is (p-1)/(m+p-1) = 1/9.
    assert rows["1F1B"].split()[1:5] == ["2", "2", "54.000", "11.1%"]
    assert float(rows["1F1B"].split()[-1]) > 1.0
    assert "wrote Chrome traces to" in lines[-1]
    assert not list(tmp_path.glob("*.png"))
    for name in rows:
        assert json.loads((tmp_path / f"{name}.trace.json").read_text())["traceEvents"]


def test_simulate_with_costs_file_and_no_compare(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    costs = tmp_path / "costs.toml"
    costs.write_text("forward = 2.0\nbackward_input = 2.0\nbackward_weight = 1.0\ntransfer = 0.5\n")
    args = [
        "simulate",
        "--schedule",
        "gpipe",
        "--stages",
        "3",
        "--microbatches",
        "6",
        "--costs",
        str(costs),
    ]
    assert main([*args, "--no-compare", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4
    assert (tmp_path / "GPipe.png").read_bytes()[:4] == b"\x89PNG"
    # (m + p - 1) * (F + B) plus 2 * (p - 1) hops on the critical path.
    assert out[2].split()[4] == "42.000"


def test_simulate_reports_schedules_that_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--schedule", "GPipe", "--stages", "4", "--microbatches", "3"]) == 0
    out = capsys.readouterr().out
    assert "1F1B" in out
    assert "n/a: 1F1B needs n_microbatches >= num_stages, got n_microbatches=3, num_stages=4" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["simulate", "--schedule", "Nope", "--stages", "4", "--microbatches", "8"],
            "unknown schedule 'Nope'",
        ),
        (
            [
                "simulate",
                "--schedule",
                "ZBV",
                "--stages",
                "3",
                "--microbatches",
                "8",
                "--ranks",
                "2",
            ],
            "2 * pp_size",
        ),
        (
            ["simulate", "--schedule", "GPipe", "--stages", "2", "--microbatches", "0"],
            "n_microbatches must be >= 1",
        ),
        (
            [
                "simulate",
                "--schedule",
                "GPipe",
                "--stages",
                "2",
                "--microbatches",
                "2",
                "--costs",
                "/no/costs.toml",
            ],
            "No such file",
        ),
        (["validate", "/no/such.csv"], "no such file"),
    ],
)
def test_bad_input_exits_2_with_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_argparse_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--schedule", "ZBV"])
    assert exit_info.value.code == 2
    assert "--stages" in capsys.readouterr().err


def test_validate_good_bad_and_malformed_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.csv"
    table = generate("Interleaved1F1B", pp_size=2, num_stages=4, n_microbatches=4)
    write_csv(add_communication(table, num_stages=4, style="loop"), good)
    assert main(["validate", str(good), "--style", "loop"]) == 0
    out = capsys.readouterr().out
    assert "2 ranks, 4 stages, 4 micro-batches" in out
    assert "OK: no deadlock" in out
    # 2 ranks x 2 looped stages, F = I = W = 1, 4 micro-batches: (p-1)/(v*m+p-1) = 1/9.
    assert "unit-cost simulation: step 27, bubble 11.1%" in out
    costs = tmp_path / "costs.toml"
    costs.write_text("forward = 2.0\n")
    assert (
        main(["validate", str(good), "--costs", str(costs), "--out", str(tmp_path), "--no-png"])
        == 0
    )
    assert "simulation: step 36," in capsys.readouterr().out
    assert json.loads((tmp_path / "good.trace.json").read_text())["traceEvents"]
    bad = tmp_path / "bad.csv"
    bad.write_text(
        "0F0,0SEND_F0,0F1,0RECV_B0,0SEND_F1,0B0,0RECV_B1,0B1\n1RECV_F0,1RECV_F1,1F0,1F1,1B0,1SEND_B0,1B1,1SEND_B1\n"
    )
    assert main(["validate", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "INVALID" in out
    assert "deadlock: rank 0 at position 3 (0RECV_B0) waits for a send from rank 1" in out
    malformed = tmp_path / "malformed.csv"
    malformed.write_text("0F0,0Q0\n")
    assert main(["validate", str(malformed)]) == 2
    assert "rank 0 (row 1), column 2: '0Q0' is not an action" in capsys.readouterr().err


def test_console_script_is_declared() -> None:
    # Running it in a subprocess costs a torch import; the declaration is what can break.
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "hp-pp"]
    assert script.value == "hp_pp.cli:main"
    assert script.load() is main


def test_pictures_without_matplotlib_exit_2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    argv = ["simulate", "--schedule", "1F1B", "--stages", "2", "--microbatches", "2"]
    assert main([*argv, "--no-compare", "--out", str(tmp_path)]) == 2
    assert "pip install 'hp-pp[plot]'" in capsys.readouterr().err
