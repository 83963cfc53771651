"""Sphinx configuration: one site for every hyper-parallel package.

The build must pass offline with warnings as errors (``sphinx-build -n -W --keep-going``). With
``HP_DOCS_OFFLINE=1`` (CI: no access to docs.pytorch.org) intersphinx is off and references to
``torch.*`` and the standard library are not checked; online, they resolve through intersphinx.
"""

from __future__ import annotations

import importlib
import os
import sys

project = "hyper-parallel"
author = "hyper-parallel developers"
copyright = "2026, hyper-parallel developers"
release = importlib.import_module("hyper_parallel").__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
]

# hp-pp's schedule gallery: pictures its simulator draws at build time (docs/_ext).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ext"))
extensions.append("hp_pp_gallery")
# "See Also" links: :pt:`torch.x.y` and :titan:`torchtitan.x.Y` (docs/_ext/hp_see_also.py; the
# TorchTitan commits are pinned per file in docs/_ext/torchtitan_sources.toml).
extensions.append("hp_see_also")

OFFLINE = os.environ.get("HP_DOCS_OFFLINE", "0") == "1"

html_theme = "furo"
html_title = "hyper-parallel"
templates_path = ["_templates"]
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

autosummary_generate = True
autosummary_imported_members = True
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# Private bases and internal state classes are not documented by design.
nitpick_ignore_regex = [
    (r"py:.*", r"hp_\w+(\.\w+)*\._\w+(\.\w+)*"),
    (r"py:class", r"hp_fsdp\.state\.FSDPState"),
    # ``from hp_dtensor import device as hp_device`` in annotations (autodoc keeps the alias)
    (r"py:class", r"hp_device\.\w+"),
]

if OFFLINE:
    intersphinx_mapping: dict[str, tuple[str, str | None]] = {}
    # Offline the inventories of torch and Python cannot be fetched: do not check those targets.
    nitpick_ignore_regex += [
        (
            r"py:.*",
            r"(torch|typing|typing_extensions|collections|contextlib|pathlib|os|enum)(\..*)?",
        ),
        (r"py:.*", r"(dataclasses|concurrent|numpy|safetensors|multiprocessing|types|abc)(\..*)?"),
        (
            r"py:.*",
            r"(datetime|io|logging|argparse|threading|queue|weakref|functools|inspect)(\..*)?",
        ),
        (r"py:.*", r"(_?pytest|tokenizers|tqdm|matplotlib|yaml|json|signal|subprocess)(\..*)?"),
        (r"py:.*", r"(Tensor|Module|Parameter|DTensor|DeviceMesh|Placement|Shard|Replicate)"),
        (r"py:.*", r"(Partial|Callable|Iterator|Iterable|Sequence|Mapping|Any|Self|Generator)"),
        (r"py:.*", r"(int|float|str|bool|bytes|dict|list|tuple|set|None|object|type|Path)"),
        (r"py:.*", r"(ParamSpec|TypeVar|Future|Work|ProcessGroup|SerializationFormat)"),
        (r"py:.*", r"~?([\w.]+\.)?(P|R|T|P\.args|P\.kwargs)"),
        (r"py:.*", r"(nn\..*|dist\..*|optional|callable|dtype|device|Stream|Event|Optimizer)"),
    ]
else:
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "torch": ("https://docs.pytorch.org/docs/2.13/", None),
    }
