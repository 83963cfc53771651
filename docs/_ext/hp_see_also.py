"""Roles ``pt`` and ``titan``: "See Also" references to PyTorch and TorchTitan that you can click.

- ``:pt:`torch.distributed.fsdp.fully_shard``` (or ``:pt:`fully_shard <torch...>```): online,
  the torch intersphinx inventory's page when it lists the name; otherwise (offline builds,
  private names) the object's source at the installed version's tag. A page of PyTorch's docs
  is written with its file name, ``:pt:`distributed.pipelining.html```.
- ``:titan:`torchtitan.models.moe.MoE``` or a file ``:titan:`torchtitan/train.py```: the
  source on GitHub at the commit pinned in ``docs/_ext/torchtitan_sources.toml``.

A target that does not resolve (a name the installed torch lacks, a TorchTitan object missing
from the map) is a build warning, hence an error under ``-W``.
"""

from __future__ import annotations

from typing import Any

from docutils import nodes
from docutils.nodes import Node, system_message
from hp_see_also_targets import (
    TorchSourceLinks,
    TorchTitanSources,
    UnknownTargetError,
    split_title,
)
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxRole

logger = logging.getLogger(__name__)


class _LinkRole(SphinxRole):
    """Renders ``title <target>`` as a code-styled external link, or warns."""

    def run(self) -> tuple[list[Node], list[system_message]]:
        title, target = split_title(self.text)
        literal = nodes.literal(title, title)
        try:
            url = self.url(target)
        except UnknownTargetError as exc:
            logger.warning("%s", exc, location=self.get_location(), type="hp", subtype=self.name)
            return [literal], []
        return [nodes.reference("", "", literal, refuri=url, internal=False)], []

    def url(self, target: str) -> str:
        raise NotImplementedError


class PyTorchRole(_LinkRole):
    """``:pt:``: a torch object (intersphinx online, its source offline) or a docs page."""

    def __init__(self, links: TorchSourceLinks) -> None:
        self.links = links

    def url(self, target: str) -> str:
        if target.endswith(".html") or "#" in target:
            return self.links.page(target)
        source = self.links.url(target)  # imports it: an unknown name fails online too
        return self._inventory_uri(target) or source

    def _inventory_uri(self, name: str) -> str | None:
        from sphinx.ext.intersphinx import InventoryAdapter

        inventory = InventoryAdapter(self.env).named_inventory.get("torch", {})
        for objtype, entries in inventory.items():
            if objtype.startswith("py:") and name in entries:
                entry: Any = entries[name]
                return str(getattr(entry, "uri", None) or entry[2])
        return None


class TorchTitanRole(_LinkRole):
    """``:titan:``: a TorchTitan object or file, at its pinned commit."""

    def __init__(self, sources: TorchTitanSources) -> None:
        self.sources = sources

    def url(self, target: str) -> str:
        return self.sources.url(target)


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_role("pt", PyTorchRole(TorchSourceLinks()))
    app.add_role("titan", TorchTitanRole(TorchTitanSources.load()))
    return {"parallel_read_safe": True, "parallel_write_safe": True}
