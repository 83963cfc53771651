"""Run once by the test session's fork server (``conftest.py`` gives this file to
``hp_dtensor.testing.preload_in_workers``).

It tokenizes the shipped corpus with the builtin tokenizer into hp-trainer's token-id cache
(``hp_trainer.components.data.token_cache``), keyed by content as a trainer's dataset keys it.
Every process forked from the server (pool workers, the ``hp-train`` runs ``_launch_fork``
forks) inherits the entry instead of tokenizing the corpus again: ~0.3 CPU s each, and the
fault-tolerance tests fork dozens. Nothing here touches a device.
"""

from __future__ import annotations

import os

from hp_trainer import load_documents
from hp_trainer.components.data.dataset import TokenizedDataset
from hp_trainer.components.tokenizer import build_tokenizer

_PARALLEL = "TOKENIZERS_PARALLELISM"


def _warm() -> None:
    # Without the tokenizers thread pool: a process forked after it ran would disable its own
    # parallelism with a warning on stderr.
    before = os.environ.get(_PARALLEL)
    os.environ[_PARALLEL] = "false"
    try:
        TokenizedDataset(load_documents("tiny_stories_synth"), build_tokenizer("builtin"), 8)
    finally:
        if before is None:
            del os.environ[_PARALLEL]
        else:
            os.environ[_PARALLEL] = before


_warm()
