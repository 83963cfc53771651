"""The process's token id cache: a corpus is tokenized once per content, never served stale."""

from __future__ import annotations

import itertools
import json
import multiprocessing
from pathlib import Path

import pytest
import torch

from hp_dtensor.testing import start_fork_server
from hp_trainer import (
    ConfigManager,
    HuggingFaceTokenizer,
    TokenizedDataset,
    Trainer,
    load_documents,
)
from hp_trainer.components.data import token_cache
from hp_trainer.components.data.token_cache import TokenIdCache


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch) -> TokenIdCache:
    """A fresh process cache for the test (the session's is put back afterwards)."""
    fresh = TokenIdCache()
    monkeypatch.setattr(token_cache, "_CACHE", fresh)
    assert token_cache.token_id_cache() is fresh
    return fresh


def _plain_ids(docs: list[str], tok: HuggingFaceTokenizer) -> torch.Tensor:
    return torch.tensor(list(itertools.chain.from_iterable(tok.encode_batch(docs))))


def test_a_second_dataset_of_a_corpus_shares_its_ids(cache: TokenIdCache) -> None:
    docs = load_documents("tiny_stories_synth")[:300]
    first = TokenizedDataset(docs, HuggingFaceTokenizer(), seq_len=16)
    assert (cache.misses, cache.hits) == (1, 0)
    # another tokenizer object of the same file, another sequence length: the same ids
    second = TokenizedDataset(list(docs), HuggingFaceTokenizer(), seq_len=32)
    assert (cache.misses, cache.hits) == (1, 1)
    assert second.tokens.data_ptr() == first.tokens.data_ptr()
    assert torch.equal(first.tokens, _plain_ids(docs, HuggingFaceTokenizer()))
    assert len(second) == (first.tokens.numel() - 1) // 32


def test_other_content_is_tokenized_again(cache: TokenIdCache, tmp_path: Path) -> None:
    docs = load_documents("tiny_stories_synth")[:50]
    base = TokenizedDataset(docs, HuggingFaceTokenizer(), seq_len=16)
    edited = [*docs[:-1], docs[-1] + "!"]
    TokenizedDataset(edited, HuggingFaceTokenizer(), seq_len=16)
    # the same text cut at another document boundary (BOS/EOS differ)
    TokenizedDataset([docs[0] + docs[1], *docs[2:]], HuggingFaceTokenizer(), seq_len=16)
    assert (cache.misses, cache.hits) == (3, 0)
    # BOS given as the EOS text: other ids, another key
    tok = HuggingFaceTokenizer()
    eos_text = tok._tok.id_to_token(tok.eos_id)
    swapped = TokenizedDataset(docs, HuggingFaceTokenizer(bos_token=eos_text), seq_len=16)
    assert (cache.misses, cache.hits) == (4, 0)
    assert not torch.equal(swapped.tokens, base.tokens)
    # a copy of the tokenizer's files elsewhere: the same content, the same ids
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tok.path.parent / name).read_bytes())
    copy = TokenizedDataset(docs, HuggingFaceTokenizer(str(folder)), seq_len=16)
    assert (cache.misses, cache.hits) == (4, 1)
    assert copy.tokens.data_ptr() == base.tokens.data_ptr()


def test_limit_evicts_least_recently_used_and_skips_large_corpora(cache: TokenIdCache) -> None:
    tok = HuggingFaceTokenizer()
    docs = load_documents("tiny_stories_synth")
    a, b, c = docs[:20], docs[20:40], docs[40:60]
    size_a = _plain_ids(a, tok).numel() * 8
    size_b, size_c = (_plain_ids(part, tok).numel() * 8 for part in (b, c))
    cache.limit_bytes = size_a + max(size_b, size_c)  # room for a and one of the others
    for part in (a, b, a, c):  # a used again: b is the least recently used when c comes
        TokenizedDataset(part, tok, seq_len=16)
    assert (cache.misses, cache.hits) == (3, 1)
    TokenizedDataset(a, tok, seq_len=16)
    TokenizedDataset(b, tok, seq_len=16)
    assert (cache.misses, cache.hits) == (4, 2)  # a kept, b evicted
    assert cache.nbytes <= cache.limit_bytes
    cache.clear()
    cache.limit_bytes = size_a - 8  # smaller than the corpus: tokenized, not kept
    TokenizedDataset(a, tok, seq_len=16)
    TokenizedDataset(a, tok, seq_len=16)
    assert cache.nbytes == 0
    assert (cache.misses, cache.hits) == (6, 2)
    with pytest.raises(ValueError, match="limit_bytes must be >= 0, got -1"):
        TokenIdCache(limit_bytes=-1)


def test_limit_zero_keeps_nothing(cache: TokenIdCache) -> None:
    docs = load_documents("tiny_stories_synth")[:30]
    TokenizedDataset(docs, HuggingFaceTokenizer(), seq_len=16)
    assert cache.nbytes > 0
    cache.limit_bytes = 0
    TokenizedDataset(docs, HuggingFaceTokenizer(), seq_len=16)
    assert cache.nbytes == 0
    assert cache.hits == 0


def test_two_trainers_of_one_corpus_tokenize_it_once(cache: TokenIdCache, tmp_path: Path) -> None:
    argv = [
        "--config", "debug", "--model.flavor", "tiny", "--training.steps", "1",
        "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree",
        "1", "--metrics.enable_plot", "false", "--job.dump_folder", str(tmp_path),
    ]  # fmt: skip
    losses = []
    for run in ("a", "b"):
        trainer = Trainer(ConfigManager().parse_args([*argv, "--job.run_name", run]))
        try:
            losses.append(trainer.train())
        finally:
            trainer.close()
    assert (cache.misses, cache.hits) == (1, 1)
    assert losses[0] == losses[1]


_PROBE = """
import json
from hp_trainer import HuggingFaceTokenizer, TokenizedDataset, load_documents
from hp_trainer.components.data import token_cache
cache = token_cache.token_id_cache()
before = [cache.misses, cache.hits]
TokenizedDataset(load_documents("tiny_stories_synth"), HuggingFaceTokenizer(), seq_len=32)
with open(OUT, "w") as f:
    json.dump([before, [cache.misses, cache.hits]], f)
"""


def test_processes_forked_from_the_server_inherit_the_shipped_corpus_tokenized(
    tmp_path: Path,
) -> None:
    """conftest.py has the test session's fork server tokenize the shipped corpus once (each
    pool worker and forked hp-train run would: ~0.3 CPU s each); a process forked from it finds
    the corpus in its cache: a hit, no tokenization."""
    start_fork_server()
    out = tmp_path / "probe.json"
    proc = multiprocessing.get_context("forkserver").Process(
        target=exec, args=(_PROBE, {"OUT": str(out)})
    )
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    before, after = json.loads(out.read_text())
    assert before[0] >= 1  # the server's own lookup tokenized it
    assert after == [before[0], before[1] + 1]  # a hit here
