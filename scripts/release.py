"""Per-package release tooling.

Each distribution is released on its own, tagged ``<dist>-v<version>``. Commands:

``changed [--ref REF]``
    List the packages whose files changed since their last release tag (every package that was
    never released counts as changed).
``check``
    Fail when a changed package has no version bump since its last tag, or its CHANGELOG.md has
    no section for the current version.
``plan DIST``
    Print the commands that build and tag one package's release.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workspace import ROOT, Package, load_packages


def _git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=root, check=True, capture_output=True, text=True
    ).stdout.strip()


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def last_tag(root: Path, package: Package) -> str | None:
    """The newest ``<dist>-v<version>`` tag of ``package``, by version order, or None."""
    tags = _git(root, "tag", "--list", f"{package.dist}-v*").split()
    if not tags:
        return None
    return max(tags, key=lambda tag: _version_key(tag.rsplit("-v", 1)[1]))


def changed_since(root: Path, package: Package, ref: str | None) -> bool:
    """Whether any file of ``package`` differs between ``ref`` and the working tree."""
    if ref is None:
        return True
    rel = package.directory.relative_to(root).as_posix()
    diff = _git(root, "diff", "--name-only", ref, "--", rel)
    untracked = _git(root, "ls-files", "--others", "--exclude-standard", "--", rel)
    return bool(diff or untracked)


def changed_packages(root: Path, packages: list[Package]) -> list[tuple[Package, str | None]]:
    """Packages changed since their own last tag, with that tag (None: never released)."""
    result = []
    for package in packages:
        tag = last_tag(root, package)
        if changed_since(root, package, tag):
            result.append((package, tag))
    return result


def problems(root: Path, packages: list[Package]) -> list[str]:
    """What blocks a release: a changed package without a version bump or changelog entry."""
    found = []
    for package, tag in changed_packages(root, packages):
        version = package.version()
        if tag is not None:
            tagged_version = tag.rsplit("-v", 1)[1]
            if _version_key(version) <= _version_key(tagged_version):
                found.append(
                    f"{package.dist}: changed since {tag} but its version is still {version}; "
                    f"bump it (cd {package.directory.relative_to(root)} && hatch version patch)"
                )
        changelog = package.changelog.read_text() if package.changelog.exists() else ""
        if f"## {version}" not in changelog:
            found.append(f"{package.dist}: CHANGELOG.md has no '## {version}' section")
    return found


def plan(root: Path, package: Package) -> list[str]:
    """Shell commands that build one package and tag its release."""
    rel = package.directory.relative_to(root).as_posix()
    version = package.version()
    return [
        f"python -m build --wheel --sdist --outdir dist/{package.dist} {rel}",
        f"git tag -a {package.dist}-v{version} -m '{package.dist} {version}'",
        f"git push origin {package.dist}-v{version}",
        f"twine upload dist/{package.dist}/*",
    ]


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    parser = argparse.ArgumentParser(prog="release", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("changed", help="list packages changed since their last release tag")
    sub.add_parser("check", help="fail on a changed package without version bump or changelog")
    plan_parser = sub.add_parser("plan", help="print the release commands for one package")
    plan_parser.add_argument("dist")
    args = parser.parse_args(argv)
    packages = load_packages(root / "packages")
    if args.command == "changed":
        for package, tag in changed_packages(root, packages):
            since = f"since {tag}" if tag else "never released"
            print(f"{package.dist} {package.version()} ({since})")
        return 0
    if args.command == "check":
        found = problems(root, packages)
        for line in found:
            print(line, file=sys.stderr)
        if not found:
            print("release check: every changed package has a version bump and changelog entry")
        return 1 if found else 0
    by_name = {p.dist: p for p in packages}
    if args.dist not in by_name:
        print(f"unknown package {args.dist!r}; expected one of {sorted(by_name)}", file=sys.stderr)
        return 2
    for line in plan(root, by_name[args.dist]):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
