"""Install checks: each package installs alone from a wheelhouse with exactly its dependencies.

Builds wheels of all nine packages into ``wheelhouse/``, creates a fresh virtual environment that
holds only torch, then:

1. ``pip install --no-index --find-links wheelhouse hp-fsdp`` must install exactly hp-fsdp and
   its declared siblings, and ``import hp_fsdp`` must work;
2. ``pip install --no-index --find-links wheelhouse hyper-parallel`` must install all nine, and
   ``import hyper_parallel`` must work;
3. the shipped default job, ``hp-train --config debug``, must run (2 steps) in that environment
   exactly as a user meets it: no extra installed, no error, nothing but notes about optional
   features switched off.

``--no-index`` makes sure nothing of ours can come from a package index by accident.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workspace import ROOT, load_packages, requirement_name

TORCH_PIN = "torch==2.13.0"


def _run(*cmd: str | Path) -> str:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"command failed with exit code {proc.returncode}")
    return proc.stdout


def build_wheelhouse(wheelhouse: Path) -> None:
    """Wheels of every workspace package plus their third-party dependencies."""
    if wheelhouse.exists():
        shutil.rmtree(wheelhouse)
    wheelhouse.mkdir(parents=True)
    for package in load_packages():
        _run(
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--outdir",
            wheelhouse,
            package.directory,
        )
    # with their own dependencies (tokenizers needs huggingface-hub), but never torch
    _run(
        sys.executable,
        "-m",
        "pip",
        "download",
        "--dest",
        wheelhouse,
        *third_party_requirements(),
        TORCH_PIN,
    )
    for wheel in wheelhouse.glob("torch-*.whl"):
        wheel.unlink()


def third_party_requirements() -> list[str]:
    """Runtime requirements of our packages that are neither siblings nor torch."""
    packages = load_packages()
    ours = {p.dist for p in packages}
    found: set[str] = set()
    for package in packages:
        data = tomllib.loads((package.directory / "pyproject.toml").read_text())
        for requirement in data["project"].get("dependencies", []):
            name = requirement_name(requirement)
            if name not in ours and name != "torch":
                found.add(requirement)
    return sorted(found)


def _installed(python: Path) -> set[str]:
    out = _run(python, "-m", "pip", "list", "--format", "json")
    return {entry["name"].lower() for entry in json.loads(out)}


def check(wheelhouse: Path, venv: Path) -> list[str]:
    """Run both install checks; return the problems found."""
    problems = []
    by_dist = {p.dist: p for p in load_packages()}
    _run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    _run(python, "-m", "pip", "install", "--quiet", TORCH_PIN)
    base = _installed(python)

    def closure(dist: str) -> set[str]:
        """The distribution and everything it requires (third-party ones have no further deps)."""
        seen = {dist}
        for dep in by_dist[dist].dependencies:
            if dep == "torch" or dep in seen:
                continue
            seen |= closure(dep) if dep in by_dist else {dep}
        return seen

    _run(python, "-m", "pip", "install", "--no-index", "--find-links", wheelhouse, "hp-fsdp")
    added = _installed(python) - base
    if added != closure("hp-fsdp"):
        problems.append(f"hp-fsdp installed {sorted(added)}, expected {sorted(closure('hp-fsdp'))}")
    _run(python, "-c", "import hp_fsdp; print('hp_fsdp', hp_fsdp.__version__)")

    _run(python, "-m", "pip", "install", "--no-index", "--find-links", wheelhouse, "hyper-parallel")
    ours = {d for d in _installed(python) if d in by_dist}
    if ours != set(by_dist):
        problems.append(f"hyper-parallel installed {sorted(ours)}, expected all {sorted(by_dist)}")
    _run(
        python, "-c", "import hyper_parallel; print('hyper_parallel', len(hyper_parallel.__all__))"
    )
    problems += check_default_job(venv)
    return problems


def check_default_job(venv: Path) -> list[str]:
    """Run ``hp-train --config debug`` for 2 steps in the fresh environment."""
    with tempfile.TemporaryDirectory(prefix="hp-install-job-") as outputs:
        cmd = [
            str(venv / "bin" / "hp-train"),
            "--config",
            "debug",
            "--training.steps",
            "2",
            "--job.dump_folder",
            outputs,
        ]
        print("+", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=outputs)
        text = proc.stdout + proc.stderr
        metrics = Path(outputs) / "llama3_debug" / "metrics.jsonl"
        steps = (
            [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
            if (metrics.is_file())
            else []
        )
    print("\n".join(line for line in text.splitlines() if "hp-train" in line), flush=True)
    if proc.returncode != 0 or steps != [1, 2]:
        return [
            f"hp-train --config debug exited {proc.returncode} with logged steps {steps}; "
            f"output tail:\n{text[-3000:]}"
        ]
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheelhouse", type=Path, default=ROOT / "wheelhouse")
    args = parser.parse_args()
    build_wheelhouse(args.wheelhouse)
    with tempfile.TemporaryDirectory(prefix="hp-install-check-") as tmp:
        problems = check(args.wheelhouse, Path(tmp) / "venv")
    for problem in problems:
        print("install check FAILED:", problem, file=sys.stderr)
    if not problems:
        print(
            "install checks passed: hp-fsdp alone, hyper-parallel with all nine packages, "
            "and the default job"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
