"""BOS/EOS come from the tokenizer's config files (HF folder layout); no guessing by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from hp_trainer import HuggingFaceTokenizer
from hp_trainer.cli import main


def _tokenizer(folder: Path, special: list[str]) -> Path:
    """A word-level tokenizer.json with ``special`` as its first ids."""
    folder.mkdir(parents=True, exist_ok=True)
    words = [*special, "<unk>", "hello", "world", "again"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in special])
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_bos_eos_from_tokenizer_config_json(tmp_path: Path) -> None:
    folder = _tokenizer(tmp_path / "hf", ["<s>", "</s>"])
    added = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "special": True}
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": added, "eos_token": "</s>", "add_bos_token": True})
    )
    tok = HuggingFaceTokenizer(str(folder))
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.encode_batch(["hello world", "again"]) == [[0, 3, 4, 1], [0, 5, 1]]
    # the file path works too (config files next to it)
    assert HuggingFaceTokenizer(str(folder / "tokenizer.json")).eos_id == 1


def test_special_tokens_map_and_explicit_tokens(tmp_path: Path) -> None:
    folder = _tokenizer(tmp_path / "map", ["<s>", "</s>"])
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = HuggingFaceTokenizer(str(folder))
    assert (tok.bos_id, tok.eos_id) == (None, 1)  # Qwen-style: EOS only separates
    assert HuggingFaceTokenizer(str(folder), bos_token="<s>").bos_id == 0
    with pytest.raises(ValueError, match=r"eos_token '<eos>' of the tokenizer .* not in its voc"):
        HuggingFaceTokenizer(str(folder), eos_token="<eos>")


def test_no_declared_bos_eos_is_refused_whatever_the_token_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # names the old code guessed from: without a config file naming them they are not used
    folder = _tokenizer(tmp_path / "bare", ["<|begin_of_text|>", "<|end_of_text|>"])
    with pytest.raises(ValueError, match="names no BOS or EOS token") as exc:
        HuggingFaceTokenizer(str(folder))
    assert "--data.eos_token" in str(exc.value)
    assert "no tokenizer_config.json or special_tokens_map.json in" in str(exc.value)
    # the config can say how to separate
    assert HuggingFaceTokenizer(str(folder), eos_token="<|end_of_text|>").eos_id == 1
    # hp-train refuses before any rank starts
    assert main(["--data.tokenizer_path", str(folder)]) == 2
    assert "names no BOS or EOS token" in capsys.readouterr().err


def test_builtin_and_bad_files(tmp_path: Path) -> None:
    tok = HuggingFaceTokenizer()
    assert tok.bos_id == tok._tok.token_to_id("<|begin_of_text|>")
    assert tok.eos_id == tok._tok.token_to_id("<|end_of_text|>")
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match=r"tokenizer.json is not a tokenizers JSON file"):
        HuggingFaceTokenizer(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json at"):
        HuggingFaceTokenizer(str(tmp_path / "missing"))
