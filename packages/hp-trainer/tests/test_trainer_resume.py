"""Trainer + checkpoint manager: exact resume, other dp degree, corrupted latest, HF, faults."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

import hp_dcp
from hp_dtensor.testing import load_test_module, run_distributed
from hp_trainer import ConfigManager, JobConfig, Trainer
from hp_trainer.cli import EXIT_STOPPED_SAVED

STEPS = 8
STOP = 4


def _helpers() -> ModuleType:
    return load_test_module(
        Path(__file__).with_name("_parity_helpers.py"), "hp_trainer_tests_parity_helpers"
    )


def _corpus(folder: Path) -> str:
    return str(_helpers().corpus(folder))


def _config(folder: Path, run: str, local_bs: int, checkpoint: dict[str, Any]) -> JobConfig:
    """Tiny fp32 llama3, global batch 4 whatever the dp degree, deterministic ops."""
    return ConfigManager().from_dict(
        {
            "job": {"run_name": run, "dump_folder": str(folder)},
            "model": {"flavor": "tiny"},
            "training": {
                "local_batch_size": local_bs,
                "global_batch_size": 4,
                "seq_len": 32,
                "steps": STEPS,
                "seed": 0,
                "max_norm": 1.0,
                "deterministic": True,
                "mixed_precision_param": "float32",
                "mixed_precision_reduce": "float32",
            },
            "optimizer": {"lr": 5e-3},
            "lr_scheduler": {"warmup_steps": 2, "decay_type": "cosine"},
            "metrics": {"log_freq": 100, "enable_plot": False, "enable_progress_bar": False},
            "data": {"dataset": _corpus(folder)},
            "checkpoint": checkpoint,
        }
    )


def _train(cfg: JobConfig, stop_after: int | None = None) -> tuple[list[float], Trainer]:
    trainer = Trainer(cfg)
    if stop_after is not None:
        _helpers().stop_at(trainer, stop_after)
    try:
        return trainer.train(), trainer
    finally:
        trainer.close()
        torch.use_deterministic_algorithms(False)


_CKPT = {"enable": True, "interval": 2, "keep_latest_k": 0, "last_save_model_only": False}


def _dp2_runs(folder: str) -> tuple[list[float], list[float], list[float], int | None]:
    """On 2 ranks (dp 2, local batch 2): uninterrupted, stopped at STOP, resumed."""
    root = Path(folder)
    full, _ = _train(_config(root, "full", 2, {}))
    stopped, _ = _train(_config(root, "stop", 2, _CKPT), stop_after=STOP)
    dist.barrier()
    if dist.get_rank() == 0:  # the other-layout resumes start from copies of this folder
        shutil.copytree(root / "stop" / "checkpoint", root / "copy")
    dist.barrier()
    resumed, trainer = _train(_config(root, "stop", 2, _CKPT))
    return full, stopped, resumed, trainer.checkpointer.loaded_step


def _table(title: str, full: list[float], parts: list[tuple[int, list[float]]]) -> str:
    lines = [title, "step | uninterrupted        | stop/resume          | equal"]
    by_step = {first + i: v for first, losses in parts for i, v in enumerate(losses)}
    for i, ref in enumerate(full, start=1):
        got = by_step.get(i)
        lines.append(f"{i:4d} | {ref!r:20} | {got!r:20} | {got == ref}")
    return "\n".join(lines)


def test_stop_resume_exact_and_under_another_dp_degree(tmp_path: Path) -> None:
    results = run_distributed(_dp2_runs, 2, str(tmp_path), timeout=180)
    full, stopped, resumed, loaded = results[0]
    assert all(r[:3] == results[0][:3] for r in results)  # every rank reports the global loss
    assert loaded == STOP
    assert len(stopped) == STOP
    assert len(resumed) == STEPS - STOP
    steps = sorted(p.name for p in (tmp_path / "stop" / "checkpoint").iterdir())
    assert steps == ["step-2", "step-4", "step-6", "step-8"]
    print("\n" + _table("dp 2 -> dp 2 (bitwise)", full, [(1, stopped), (STOP + 1, resumed)]))
    assert stopped + resumed == full  # bitwise

    # the same checkpoint resumed on one process (dp 1, 2 micro-batches per step)
    shutil.copytree(tmp_path / "copy", tmp_path / "dp1" / "checkpoint")
    dp1, trainer = _train(_config(tmp_path, "dp1", 2, _CKPT))
    assert trainer.checkpointer.loaded_step == STOP
    assert trainer.gradient_accumulation_steps == 2
    print(_table("dp 2 -> dp 1 (rtol 1e-5)", full, [(1, stopped), (STOP + 1, dp1)]))
    torch.testing.assert_close(dp1, full[STOP:], rtol=1e-5, atol=0)

    # corrupted latest (step-4): step-2 is used, the corruption is reported, steps 3.. match
    shutil.copytree(tmp_path / "copy", tmp_path / "bad" / "checkpoint")
    latest = tmp_path / "bad" / "checkpoint" / "step-4"
    victim = max(latest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    after_bad, trainer = _train(_config(tmp_path, "bad", 2, _CKPT))
    assert trainer.checkpointer.loaded_step == 2
    assert [s for s, _ in trainer.checkpointer.skipped] == [4]
    assert victim.name in trainer.checkpointer.skipped[0][1]
    torch.testing.assert_close(after_bad, full[2:], rtol=1e-5, atol=0)


def test_hf_import_train_export_import_round_trip(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path)
    base = [
        "--config", "debug", "--model.flavor", "tiny",
        "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.mixed_precision_param", "float32",
        "--parallelism.data_parallel_shard_degree", "1",
        "--parallelism.tensor_parallel_degree", "1",
        "--metrics.enable_plot", "false", "--metrics.enable_progress_bar", "false",
        "--data.dataset", corpus, "--job.dump_folder", str(tmp_path),
    ]  # fmt: skip
    # a "downloaded" HuggingFace checkpoint: a seed-3 model exported by the adapter
    source = Trainer(ConfigManager().parse_args([*base, "--training.seed", "3"]))
    hf_in = tmp_path / "hf-in"
    source.checkpointer.export_hf(hf_in)
    source_weights = {k: v.clone() for k, v in source.model.state_dict().items()}
    source.close()
    assert (hf_in / "config.json").is_file()

    opts = [
        "--checkpoint.enable", "true",
        "--checkpoint.initial_load_path", str(hf_in),
        "--checkpoint.initial_load_in_hf", "true",
        "--checkpoint.last_save_in_hf", "true",
    ]  # fmt: skip
    cfg = ConfigManager().parse_args([*base, *opts, "--training.steps", "2", "--job.run_name", "a"])
    trainer = Trainer(cfg)
    assert trainer.checkpointer.load()  # the initial HF load, as train() does it
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, source_weights[k]), k
    trainer.train()
    trained = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.close()
    assert any(not torch.equal(trained[k], source_weights[k]) for k in trained)
    hf_out = tmp_path / "a" / "checkpoint" / "step-2-hf"
    assert (hf_out / "config.json").is_file()

    # import the export in a new run: exactly the trained weights
    cfg = ConfigManager().parse_args(
        [*base, *opts[:3], str(hf_out), *opts[4:6], "--job.run_name", "b"]
    )
    again = Trainer(cfg)
    assert again.checkpointer.load()
    for k, v in again.model.state_dict().items():
        assert torch.equal(v, trained[k]), k
    again.close()
    # and the raw safetensors hold the adapter's HF names
    names = set(hp_dcp.load_hf_safetensors(hf_out))
    assert "model.embed_tokens.weight" in names


# -- hp-train processes with 2 local ranks ----------------------------------------------------


# -- hp-train processes with 2 local ranks ---------------------------------------------------
class _Job:
    """An ``hp-train`` launcher in a process forked from the test process's forkserver (see
    ``_launch_fork``: no interpreter start; ``python -m hp_trainer.cli`` launchers are
    test_multinode's), with the ``Popen`` methods this test uses; its output goes to a log."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        fork = load_test_module(
            Path(__file__).with_name("_launch_fork.py"), "hp_trainer_tests_launch_fork"
        )
        self.proc = fork.ForkedHpTrain(argv, env, log)
        self.pid: int = self.proc.pid
        self.log = log
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = self.proc.poll()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.returncode = self.proc.wait(timeout)
        return self.log.read_text(), None

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        self.proc.kill()


def _hp_train(tmp_path: Path, run: str, tp: int, extra: list[str], *, idle_after: int = 0) -> _Job:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")
    }
    env["HP_TEST_IDLE_AFTER"] = str(idle_after)  # read by _launch_ranks.RankPid
    argv = [
        "--config", "debug", "--model.flavor", "tiny",
        "--training.steps", "100000", "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32",
        "--parallelism.data_parallel_shard_degree", str(2 // tp),
        "--parallelism.tensor_parallel_degree", str(tp),
        "--metrics.log_freq", "1", "--metrics.enable_progress_bar", "false",
        "--data.dataset", _corpus(tmp_path),
        "--job.dump_folder", str(tmp_path), "--job.run_name", run,
        "--job.callbacks", "_launch_ranks:RankPid", *extra,
    ]  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return _Job(argv, env, tmp_path / f"{run}.log")


def _launch_helpers() -> ModuleType:
    return load_test_module(Path(__file__).with_name("_launch_ranks.py"), "hp_trainer_tests_ranks")


def _workers(tmp_path: Path, run: str, launcher: int) -> dict[int, int]:
    """rank -> pid of the 2 ranks of job ``run`` (processes under ``launcher``)."""
    ranks = _launch_helpers().rank_pids(tmp_path / run, launcher)
    assert sorted(ranks) == [0, 1], ranks
    return ranks


def _wait_for_step(metrics: Path, step: int, proc: _Job) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        if metrics.exists() and len(metrics.read_text().splitlines()) >= step:
            return
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no step {step} within 120 s: {proc.communicate()[0][-4000:]}")


@pytest.mark.slow
def test_hp_train_end_to_end_sigterm_save_and_dead_rank(tmp_path: Path) -> None:
    """Three overlapping ``hp-train`` jobs of 2 ranks: SIGTERM to the ranks, a killed rank,
    SIGTERM to the launcher.

    The second job starts once the first has trained 3 steps: its start-up overlaps the first
    job's SIGTERM, checkpoint and checks, and neither trains unobserved while the other starts
    (both run an unbounded number of steps until a signal; started together, the second one
    trained through the whole of the first one's run: 78 of this test's CPU seconds, then 37).
    The third starts with the second, and idles after its second step until its signal
    (``HP_TEST_IDLE_AFTER``): its start-up overlaps the first job's stop and the second one's
    start-up and failure instead of following them.
    """
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "1000"]
    term = _hp_train(tmp_path, "term", 2, ckpt)
    procs = [term]
    try:
        # SIGTERM to every rank (what a scheduler does): a full checkpoint, exit status 75
        _wait_for_step(tmp_path / "term" / "metrics.jsonl", 3, term)
        dies = _hp_train(tmp_path, "dies", 1, ["--metrics.enable_plot", "false"])
        procs.append(dies)
        stop = _hp_train(
            tmp_path, "stop", 1, [*ckpt, "--metrics.enable_plot", "false"], idle_after=2
        )
        procs.append(stop)
        for pid in _workers(tmp_path, "term", term.pid).values():
            os.kill(pid, signal.SIGTERM)
        out, _ = term.communicate(timeout=60)
        assert term.returncode == EXIT_STOPPED_SAVED == 75, out[-4000:]
        assert json.loads((tmp_path / "term" / "stopped.json").read_text())["status"] == "saved"
        assert "starting 2 local ranks" in out
        assert "SIGTERM received" in out
        # the outputs of a run: metrics per step, loss curve, resolved config
        run = tmp_path / "term"
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(1, len(records) + 1))
        assert all(r["loss"] > 0 and r["mfu_percent"] is None for r in records)
        assert (run / "loss.png").stat().st_size > 1000
        assert (
            json.loads((run / "config.json").read_text())["parallelism"]["tensor_parallel_degree"]
            == 2
        )
        assert "step     3  loss" in out
        saved = sorted((tmp_path / "term" / "checkpoint").iterdir())
        assert len(saved) == 1, saved
        meta = hp_dcp.FileSystemReader(saved[0]).read_metadata().state_dict_metadata
        assert any(k.startswith("optimizer.") for k in meta)
        assert meta.keys() >= {"train_state.step", "dataloader.samples_consumed"}
        step = int(saved[0].name.removeprefix("step-"))
        assert records[-1]["step"] == step

        # rank 1 killed: the job fails fast and the error names the rank
        _wait_for_step(tmp_path / "dies" / "metrics.jsonl", 2, dies)
        workers = _workers(tmp_path, "dies", dies.pid)
        os.kill(workers[1], signal.SIGKILL)
        # ends by itself instead of hanging (communicate raises TimeoutExpired otherwise); no
        # wall-clock assertion beyond that bound, which a loaded machine could break
        out, _ = dies.communicate(timeout=120)
        assert dies.returncode == 1, out[-4000:]
        assert f"rank 1 (pid {workers[1]}) failed: killed by signal SIGKILL" in out, out[-4000:]

        # SIGTERM to the launcher (a scheduler stopping the job): the agent passes it to the
        # ranks, they save and leave, the launcher exits 75; the agent never has to SIGKILL a
        # rank that already stopped (its 30 s fallback)
        _wait_for_step(tmp_path / "stop" / "metrics.jsonl", 2, stop)
        stop.send_signal(signal.SIGTERM)
        out, _ = stop.communicate(timeout=120)
        assert stop.returncode == EXIT_STOPPED_SAVED, out[-4000:]
        assert json.loads((tmp_path / "stop" / "stopped.json").read_text())["status"] == "saved"
        assert "SIGTERM received" in out
        assert "forcefully exiting" not in out, out[-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                # its ranks and their forkserver, else they outlive it, holding the pipe
                for pid in _launch_helpers().descendants(proc.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                proc.kill()
                proc.communicate()
