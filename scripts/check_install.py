"""Install checks: each package installs alone from a wheelhouse with exactly its dependencies.

Builds wheels of all nine packages into ``wheelhouse/``, creates a fresh virtual environment that
holds only torch, then:

1. ``pip install --no-index --find-links wheelhouse hp-fsdp`` must install exactly hp-fsdp and
   its declared siblings, and ``import hp_fsdp`` must work;
2. ``pip install --no-index --find-links wheelhouse hyper-parallel`` must install all nine, and
   ``import hyper_parallel`` must work.

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
    _run(
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--dest",
        wheelhouse,
        *third_party_requirements(),
    )


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
    return problems


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
        print("install checks passed: hp-fsdp alone, and hyper-parallel with all nine packages")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
