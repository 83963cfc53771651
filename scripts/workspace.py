"""Facts about the workspace's packages, read from their pyproject files (shared by the scripts)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGES_DIR = ROOT / "packages"
_VERSION_RE = re.compile(r'^__version__\s*=\s*"([^"]+)"', re.MULTILINE)
_REQ_NAME_RE = re.compile(r"^\s*([A-Za-z0-9_.\-]+)")


@dataclass(frozen=True)
class Package:
    """One distribution of the workspace."""

    dist: str
    directory: Path
    import_name: str
    dependencies: tuple[str, ...]
    """Names (normalized, without versions or extras) of the distributions it requires."""

    @property
    def version_file(self) -> Path:
        return self.directory / "src" / self.import_name / "__about__.py"

    @property
    def changelog(self) -> Path:
        return self.directory / "CHANGELOG.md"

    def version(self) -> str:
        return read_version(self.version_file.read_text())


def read_version(text: str) -> str:
    """The ``__version__`` string assigned in an ``__about__.py`` text."""
    match = _VERSION_RE.search(text)
    if match is None:
        raise ValueError("no __version__ = '...' line found")
    return match.group(1)


def requirement_name(requirement: str) -> str:
    """``"hp-dtensor>=0.1,<0.2"`` -> ``"hp-dtensor"`` (normalized to lower case and dashes)."""
    match = _REQ_NAME_RE.match(requirement)
    if match is None:
        raise ValueError(f"cannot parse requirement {requirement!r}")
    return match.group(1).lower().replace("_", "-")


def load_packages(packages_dir: Path = PACKAGES_DIR) -> list[Package]:
    """Every ``packages/<dist>`` with a pyproject, sorted by name."""
    found = []
    for pyproject in sorted(packages_dir.glob("*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        project = data["project"]
        wheel_pkgs = data["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
        import_name = Path(wheel_pkgs[0]).name
        found.append(
            Package(
                dist=project["name"],
                directory=pyproject.parent,
                import_name=import_name,
                dependencies=tuple(requirement_name(r) for r in project.get("dependencies", [])),
            )
        )
    return found
