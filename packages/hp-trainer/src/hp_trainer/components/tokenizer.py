"""The HuggingFace ``tokenizers`` tokenizer the trainer uses (the shipped 2K BPE by default)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

__all__ = ["ASSETS", "HuggingFaceTokenizer", "build_tokenizer"]

ASSETS = Path(__file__).resolve().parents[1] / "assets"
"""The folder of hp-trainer's shipped corpus and tokenizer."""


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as exc:
        raise ImportError(
            "hp-trainer's tokenizer needs the 'tokenizers' package (a dependency of hp-trainer): "
            "pip install 'hp-trainer[tokenizers]'"
        ) from exc
    return tokenizers


_SPECIAL_TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def _token_text(value: Any) -> str | None:
    """A special token as HF writes it: a string, or an ``AddedToken`` dict with ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _declared_special_tokens(folder: Path) -> tuple[dict[str, str], list[Path]]:
    """``bos_token``/``eos_token`` from the tokenizer's config files in ``folder``.

    ``tokenizer_config.json`` wins over ``special_tokens_map.json``; returns the tokens found
    and the files read.
    """
    found: dict[str, str] = {}
    read: list[Path] = []
    for name in reversed(_SPECIAL_TOKEN_FILES):  # the later file overrides
        file = folder / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file} is not valid JSON: {exc}") from None
        read.append(file)
        for key in ("bos_token", "eos_token"):
            text = _token_text(data.get(key)) if isinstance(data, dict) else None
            if text is not None:
                found[key] = text
    return found, read


class HuggingFaceTokenizer:
    """A ``tokenizer.json`` (HF ``tokenizers``) with the BOS/EOS that separate documents.

    BOS/EOS are the ``bos_token``/``eos_token`` named by the tokenizer's
    ``tokenizer_config.json`` (or ``special_tokens_map.json``) next to ``tokenizer.json``, as in
    a HuggingFace tokenizer folder; ``bos_token``/``eos_token`` given here take precedence. A
    tokenizer with neither cannot separate the documents of a packed corpus, so it is refused.

    Args:
        tokenizer_path: A ``tokenizer.json`` file, a folder holding one, or ``"builtin"``.
        bos_token: Keyword-only; the BOS token's text (default: from the config files).
        eos_token: Keyword-only; the EOS token's text (default: from the config files).

    Raises:
        ImportError: If ``tokenizers`` is not installed.
        FileNotFoundError: If no ``tokenizer.json`` is found.
        ValueError: If the file is not a tokenizer, a named token is not in its vocabulary, or
            neither BOS nor EOS is known (the message names the files looked at).

    See Also:
        :titan:`torchtitan.components.tokenizer.HuggingFaceTokenizer`: TorchTitan's tokenizer.
    """

    def __init__(
        self,
        tokenizer_path: str = "builtin",
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        tokenizers = _import_tokenizers()
        path = ASSETS / "tokenizer.json" if tokenizer_path == "builtin" else Path(tokenizer_path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self.path = path
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own exception type
            raise ValueError(f"{path} is not a tokenizers JSON file: {exc}") from None
        if self._tok.get_vocab_size() == 0:
            raise ValueError(f"the tokenizer {path} has an empty vocabulary")
        declared, files = _declared_special_tokens(path.parent)
        chosen = {"bos_token": bos_token, "eos_token": eos_token}
        ids: dict[str, int | None] = {}
        for key, text in chosen.items():
            text = text if text is not None else declared.get(key)
            if text is None:
                ids[key] = None
                continue
            token_id = self._tok.token_to_id(text)
            if token_id is None:
                raise ValueError(f"{key} {text!r} of the tokenizer {path} is not in its vocabulary")
            ids[key] = int(token_id)
        self.bos_id: int | None = ids["bos_token"]
        self.eos_id: int | None = ids["eos_token"]
        digest = hashlib.blake2b(path.read_bytes(), digest_size=20)
        self.fingerprint: tuple[bytes, int | None, int | None] = (
            digest.digest(),
            self.bos_id,
            self.eos_id,
        )
        """The tokenizer file's BLAKE2b digest, the BOS id and the EOS id (what ids depend on)."""
        if self.bos_id is None and self.eos_id is None:
            looked = ", ".join(str(f) for f in files) or (
                f"no {' or '.join(_SPECIAL_TOKEN_FILES)} in {path.parent}"
            )
            raise ValueError(
                f"the tokenizer {path} names no BOS or EOS token to separate documents "
                f"(looked at: {looked}); add a tokenizer_config.json with bos_token/eos_token, "
                "or set --data.bos_token / --data.eos_token"
            )

    @property
    def vocab_size(self) -> int:
        """Number of token ids (including special tokens).

        See Also:
            :titan:`torchtitan.components.tokenizer.HuggingFaceTokenizer.get_vocab_size`.
        """
        return int(self._tok.get_vocab_size())

    def get_vocab_size(self) -> int:
        """Number of token ids (TorchTitan's method name).

        Returns:
            The vocabulary size.

        See Also:
            :titan:`torchtitan.components.tokenizer.HuggingFaceTokenizer.get_vocab_size`.
        """
        return self.vocab_size

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Encode one text.

        Args:
            text: The text.
            add_bos: Prepend the BOS id (when the tokenizer has one).
            add_eos: Append the EOS id (when the tokenizer has one).

        Returns:
            Token ids.

        See Also:
            :titan:`torchtitan.components.tokenizer.HuggingFaceTokenizer.encode`.
        """
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts, each framed by BOS/EOS.

        Args:
            texts: The texts.

        Returns:
            One id list per text.

        See Also:
            ``tokenizers.Tokenizer.encode_batch``: the HF batch encoder used.
        """
        head = [self.bos_id] if self.bos_id is not None else []
        tail = [self.eos_id] if self.eos_id is not None else []
        encoded = self._tok.encode_batch(texts, add_special_tokens=False)
        return [head + list(e.ids) + tail for e in encoded]

    def decode(self, ids: list[int]) -> str:
        """Decode ids back to text.

        Args:
            ids: Token ids.

        Returns:
            The text.

        See Also:
            :titan:`torchtitan.components.tokenizer.HuggingFaceTokenizer.decode`.
        """
        return str(self._tok.decode(ids))


def build_tokenizer(
    tokenizer_path: str = "builtin", *, bos_token: str | None = None, eos_token: str | None = None
) -> HuggingFaceTokenizer:
    """Load a tokenizer (``"builtin"``: the shipped 2K BPE).

    Args:
        tokenizer_path: A ``tokenizer.json`` file, a folder holding one, or ``"builtin"``.
        bos_token: Keyword-only; BOS text overriding the tokenizer's config files.
        eos_token: Keyword-only; EOS text overriding the tokenizer's config files.

    Returns:
        The tokenizer.

    See Also:
        :titan:`torchtitan.components.tokenizer.build_hf_tokenizer`.
    """
    return HuggingFaceTokenizer(tokenizer_path, bos_token=bos_token, eos_token=eos_token)
