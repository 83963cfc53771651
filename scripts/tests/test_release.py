"""Release tooling on a throw-away git repository with two packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import release


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


def _write_package(root: Path, dist: str, version: str) -> None:
    imp = dist.replace("-", "_")
    pkg = root / "packages" / dist
    (pkg / "src" / imp).mkdir(parents=True, exist_ok=True)
    (pkg / "pyproject.toml").write_text(
        f'[project]\nname = "{dist}"\ndependencies = ["torch>=2.13"]\n'
        f'[tool.hatch.build.targets.wheel]\npackages = ["src/{imp}"]\n'
    )
    (pkg / "src" / imp / "__about__.py").write_text(f'__version__ = "{version}"\n')
    (pkg / "CHANGELOG.md").write_text(f"# Changelog\n\n## {version}\n\n- something\n")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    _write_package(tmp_path, "hp-a", "0.1.0")
    _write_package(tmp_path, "hp-b", "0.1.0")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "init")
    _git(tmp_path, "tag", "hp-a-v0.1.0")
    _git(tmp_path, "tag", "hp-b-v0.1.0")
    return tmp_path


def _changed(root: Path) -> list[str]:
    packages = release.load_packages(root / "packages")
    return [p.dist for p, _ in release.changed_packages(root, packages)]


def test_nothing_changed_after_tags(repo: Path) -> None:
    assert _changed(repo) == []
    assert release.main(["check"], root=repo) == 0


def test_change_without_bump_fails_check(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (repo / "packages/hp-a/src/hp_a/core.py").write_text("x = 1\n")
    assert _changed(repo) == ["hp-a"]
    assert release.main(["check"], root=repo) == 1
    err = capsys.readouterr().err
    assert "hp-a: changed since hp-a-v0.1.0 but its version is still 0.1.0" in err
    assert "hp-b" not in err


def test_bump_without_changelog_fails_then_passes(repo: Path) -> None:
    (repo / "packages/hp-a/src/hp_a/core.py").write_text("x = 1\n")
    (repo / "packages/hp-a/src/hp_a/__about__.py").write_text('__version__ = "0.1.1"\n')
    packages = release.load_packages(repo / "packages")
    assert any("no '## 0.1.1' section" in p for p in release.problems(repo, packages))
    changelog = repo / "packages/hp-a/CHANGELOG.md"
    changelog.write_text(
        changelog.read_text().replace("# Changelog\n", "# Changelog\n\n## 0.1.1\n\n- fix\n")
    )
    assert release.main(["check"], root=repo) == 0


def test_newest_tag_by_version_order(repo: Path) -> None:
    _git(repo, "tag", "hp-a-v0.10.0")
    _git(repo, "tag", "hp-a-v0.9.0")
    package = next(p for p in release.load_packages(repo / "packages") if p.dist == "hp-a")
    assert release.last_tag(repo, package) == "hp-a-v0.10.0"


def test_plan_prints_tag_and_build(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert release.main(["plan", "hp-b"], root=repo) == 0
    out = capsys.readouterr().out
    assert "git tag -a hp-b-v0.1.0" in out
    assert "python -m build" in out
    assert "packages/hp-b" in out
    assert release.main(["plan", "nope"], root=repo) == 2
