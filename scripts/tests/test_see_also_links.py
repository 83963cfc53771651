"""Every "See Also" reference to PyTorch or TorchTitan in the packages' docstrings is a link.

(a) A See Also section may not name a PyTorch object (a ``torch.``/``nn.``/``dist.``/``F.``
literal, or "PyTorch's ``X``") or a TorchTitan object (a ``torchtitan`` literal, or
"TorchTitan's ``X``") as plain text: it uses the ``pt``/``titan`` roles (docs/_ext/hp_see_also.py).
(b) Every ``:pt:`` target imports from the installed torch; every ``:titan:`` target is in the
checked-in map docs/_ext/torchtitan_sources.toml. The docs build checks the same through the same
code (docs/_ext/hp_see_also_targets.py), so a typo fails here in seconds, not after a full build.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "docs" / "_ext"))

from hp_see_also_targets import (
    TorchSourceLinks,
    TorchTitanSources,
    UnknownTargetError,
    split_title,
)

ROOT = Path(__file__).resolve().parents[2]
ROLE = re.compile(r":(pt|titan):`([^`]+)`")
# A plain literal that is a PyTorch or TorchTitan dotted name.
FOREIGN_LITERAL = re.compile(r"``((?:torch|torchtitan|nn|dist|F)(?:\.[\w.]*)?)(?:\(.*?\))?``")
# "PyTorch's ``X``" / "TorchTitan's ``X``" and the literals listed right after it.
OWNED_LITERAL = re.compile(r"\b(?:PyTorch|TorchTitan)(?:'s)?\s+``[\w.]+``")


@dataclass(frozen=True)
class SeeAlso:
    """One See Also section: where it is, and its text joined into one line."""

    where: str
    text: str


def see_also_sections(source: str, where: str) -> list[SeeAlso]:
    """The See Also sections of every docstring of a module's source (Google style)."""
    sections = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        docstring = ast.get_docstring(node, clean=False)
        if docstring is None:
            continue
        first = node.body[0].lineno
        lines = docstring.splitlines()
        for index, line in enumerate(lines):
            if line.strip() != "See Also:":
                continue
            indent = len(line) - len(line.lstrip())
            body = []
            for following in lines[index + 1 :]:
                if following.strip() and len(following) - len(following.lstrip()) <= indent:
                    break
                if not following.strip():
                    break
                body.append(following.strip())
            sections.append(SeeAlso(f"{where}:{first + index}", " ".join(body)))
    return sections


def unlinked_references(text: str) -> list[str]:
    """Plain-text PyTorch/TorchTitan object names in a See Also section's text."""
    plain = ROLE.sub("LINK", text)  # "TorchTitan's :titan:`MoE` ``x``" names MoE, linked
    found = [m.group(0) for m in FOREIGN_LITERAL.finditer(plain)]
    found += [m.group(0) for m in OWNED_LITERAL.finditer(plain)]
    return found


def all_sections() -> list[SeeAlso]:
    sections = []
    for path in sorted(ROOT.glob("packages/*/src/**/*.py")):
        where = str(path.relative_to(ROOT))
        sections += see_also_sections(path.read_text(encoding="utf-8"), where)
    return sections


SECTIONS = all_sections()


def test_the_packages_have_see_also_sections() -> None:
    # The docstring standard asks for one per public object: hundreds, not a parsing accident.
    assert len(SECTIONS) > 400


def test_checker_flags_plain_names_and_accepts_roles() -> None:
    source = '''def f():
    """Doc.

    See Also:
        ``torch.distributed.fsdp.fully_shard``; TorchTitan's ``ExpertParallel``;
        :pt:`torch.save` and PyTorch's :pt:`x <torch.load>`; TorchTitan's :titan:`MoE` ``x``.
    """
'''
    (section,) = see_also_sections(source, "m.py")
    assert section.where == "m.py:4"
    assert unlinked_references(section.text) == [
        "``torch.distributed.fsdp.fully_shard``",
        "TorchTitan's ``ExpertParallel``",
    ]
    assert ROLE.findall(section.text) == [
        ("pt", "torch.save"),
        ("pt", "x <torch.load>"),
        ("titan", "MoE"),
    ]


def test_see_also_names_pytorch_and_torchtitan_through_the_roles() -> None:
    bad = [f"{s.where}: {ref}" for s in SECTIONS for ref in unlinked_references(s.text)]
    assert not bad, "plain-text PyTorch/TorchTitan names (use :pt:/:titan:):\n" + "\n".join(bad)


def test_every_role_target_resolves() -> None:
    torch_links = TorchSourceLinks()
    titan = TorchTitanSources.load()
    broken = []
    for section in SECTIONS:
        for role, text in ROLE.findall(section.text):
            _, target = split_title(text)
            try:
                torch_links.url(target) if role == "pt" else titan.url(target)
            except UnknownTargetError as exc:
                broken.append(f"{section.where}: {exc}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize(
    ("role", "target"),
    [("pt", "torch.distributed.fsdp.fully_shrad"), ("pt", "nn.Linear"), ("titan", "NoSuchThing")],
)
def test_unknown_targets_are_errors(role: str, target: str) -> None:
    resolve = TorchSourceLinks().url if role == "pt" else TorchTitanSources.load().url
    with pytest.raises(UnknownTargetError):
        resolve(target)


def test_pytorch_links_point_at_the_source_of_the_installed_version() -> None:
    import torch

    version = torch.__version__.split("+")[0]
    url = TorchSourceLinks().url("torch.distributed.fsdp.fully_shard")
    assert url.startswith(f"https://github.com/pytorch/pytorch/blob/v{version}/torch/")
    path, _, line = url.split(f"v{version}/", 1)[1].partition("#L")
    lines = (Path(torch.__file__).parent.parent / path).read_text(encoding="utf-8").splitlines()
    assert "def fully_shard(" in "\n".join(lines[int(line) - 1 : int(line) + 20])


def test_an_object_may_pin_its_own_commit_of_a_file() -> None:
    pinned, older = "1" * 40, "2" * 40
    titan = TorchTitanSources(
        files={"torchtitan/x.py": pinned},
        objects={
            "torchtitan.x.New": "torchtitan/x.py",
            "torchtitan.x.Old": f"torchtitan/x.py@{older}",
        },
    )
    blob = "https://github.com/pytorch/torchtitan/blob"
    assert titan.url("torchtitan.x.New") == f"{blob}/{pinned}/torchtitan/x.py"
    assert titan.url("torchtitan.x.Old") == f"{blob}/{older}/torchtitan/x.py"
    assert titan.url("torchtitan/x.py") == f"{blob}/{pinned}/torchtitan/x.py"
    with pytest.raises(UnknownTargetError):
        titan.url("torchtitan.x.Missing")


def test_every_mapped_file_is_pinned() -> None:
    titan = TorchTitanSources.load()
    for name, value in titan.objects.items():
        path, _, commit = value.partition("@")
        assert path in titan.files, name
        assert commit == "" or re.fullmatch(r"[0-9a-f]{40}", commit), name
    assert all(re.fullmatch(r"[0-9a-f]{40}", sha) for sha in titan.files.values())
