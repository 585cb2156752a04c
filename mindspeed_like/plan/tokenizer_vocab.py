"""The vocabulary Megatron-LM's tokenizer reports, before padding, read without building it.

Megatron-LM pads ``tokenizer.vocab_size`` (``build_tokenizer`` in
megatron/training/tokenizer/tokenizer.py), not ``--vocab-size``: the two differ by tokenizer.

- NullTokenizer (what ``--mock-data`` runs and the examples use): ``--vocab-size`` + 1, its EOD
  token. ``--vocab-size 32000`` is a 32,128-row embedding at ``--make-vocab-size-divisible-by 128``,
  not 32,000.
- GPT2BPETokenizer: the entries of ``--vocab-file`` (GPT-2's own file: 50,257).
- HuggingFaceTokenizer: ``len(tokenizer)``, the model's vocabulary and the added tokens, read from
  the ``tokenizer.json`` of a local ``--tokenizer-model``.
- Llama2Tokenizer, GPTSentencePieceTokenizer: the pieces of the SentencePiece ``--tokenizer-model``
  (a protobuf whose field 1 repeats once a piece; counted here, no sentencepiece needed).
- TikTokenizer: ``--vocab-size``, else megatron's fallback 2**17.

Where the tokenizer's file is not on this host (a plan made before the data is), ``--vocab-size``
stands for the tokenizer's vocabulary and the plan says so; without it that is an error naming both
fixes. ``--padded-vocab-size`` skips all of this, as it does in Megatron-LM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mindspeed_like.toolkit.errors import ConfigError

GPT2_VOCAB = 50257  # the entries of GPT-2's vocab.json, which GPT2BPETokenizer reads
TIKTOKEN_FALLBACK = 2**17  # CustomTikTokenizer's vocabulary when --vocab-size is not given
PIECE_FILE_TOKENIZERS = ("Llama2Tokenizer", "GPTSentencePieceTokenizer")


def tokenizer_vocab(ns: Any) -> tuple[int, str | None]:
    """(the tokenizer's vocabulary before padding, a note for the plan or None) for a parsed
    Megatron-LM namespace (``tokenizer_type``, ``vocab_size``, ``vocab_file``, ``tokenizer_model``)."""
    kind = getattr(ns, "tokenizer_type", None)
    given = getattr(ns, "vocab_size", None)
    if kind in ("NullTokenizer", "NullMultimodalTokenizer"):
        if given is None:
            raise ConfigError(f"plan: --tokenizer-type {kind} needs --vocab-size N (Megatron-LM asserts it too)")
        return given + 1, None  # its EOD token comes after the vocabulary
    if kind == "TikTokenizer":
        return (given, None) if given is not None else (TIKTOKEN_FALLBACK, None)
    if kind == "GPT2BPETokenizer":
        path = _existing(getattr(ns, "vocab_file", None))
        if path is not None:
            return _json_entries(path), None
        if given is not None:
            return given, _stands_in(kind, "--vocab-file", given)
        return GPT2_VOCAB, (
            f"--vocab-file is not on this host: GPT-2's vocabulary ({GPT2_VOCAB:,} entries) taken for "
            "GPT2BPETokenizer; give --vocab-size N for another"
        )
    if kind == "HuggingFaceTokenizer":
        path = _existing(getattr(ns, "tokenizer_model", None))
        path = path / "tokenizer.json" if path is not None and path.is_dir() else path
        if path is not None and path.is_file() and path.suffix == ".json":
            return _huggingface_entries(path), None
    if kind in PIECE_FILE_TOKENIZERS:
        path = _existing(getattr(ns, "tokenizer_model", None))
        if path is not None and path.is_file():
            return sentencepiece_pieces(path), None
    if given is None:
        where = (
            " (its --tokenizer-model or --vocab-file is not readable here)"
            if kind
            else " (no --tokenizer-type given, and Megatron-LM's build_tokenizer needs one: GPT2BPETokenizer with "
            "--vocab-file and --merge-file, NullTokenizer with --vocab-size, ...)"
        )
        raise ConfigError(
            f"plan: give --vocab-size N, the tokenizer's vocabulary{where}, or --padded-vocab-size "
            "(the embedding's rows)"
        )
    if kind in ("HuggingFaceTokenizer", *PIECE_FILE_TOKENIZERS):
        return given, _stands_in(kind, "--tokenizer-model", given)
    return given, None


def _stands_in(kind: str, option: str, given: int) -> str:
    return (
        f"{kind}'s {option} is not readable on this host: --vocab-size {given:,} taken as its vocabulary "
        "(Megatron-LM pads the tokenizer's own count)"
    )


def _existing(path: str | None) -> Path | None:
    if not path:
        return None
    candidate = Path(path).expanduser()
    return candidate if candidate.exists() else None


def _json_entries(path: Path) -> int:
    try:
        return len(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError) as error:
        raise ConfigError(f"plan: --vocab-file {path} is not a vocabulary JSON ({error})") from error


def _huggingface_entries(path: Path) -> int:
    """``len(tokenizer)`` of a fast tokenizer: its model's token ids and the added tokens' ids."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        vocab = data["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"plan: {path} is not a HuggingFace tokenizer.json ({error})") from error
    ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))  # BPE/WordPiece; Unigram
    ids.update(token["id"] for token in data.get("added_tokens", []))
    return len(ids)


def sentencepiece_pieces(path: Path) -> int:
    """The pieces of a SentencePiece model file: the top-level entries of ModelProto's field 1."""
    data = path.read_bytes()
    pieces, at = 0, 0
    try:
        while at < len(data):
            key, at = _varint(data, at)
            field, wire = key >> 3, key & 7
            if wire == 0:
                _, at = _varint(data, at)
            elif wire == 1:
                at += 8
            elif wire == 2:
                length, at = _varint(data, at)
                at += length
                pieces += field == 1
            elif wire == 5:
                at += 4
            else:
                raise ValueError(f"wire type {wire}")
            if at > len(data):
                raise ValueError("truncated")
    except (ValueError, IndexError) as error:
        raise ConfigError(f"plan: --tokenizer-model {path} is not a SentencePiece model ({error})") from error
    if not pieces:
        raise ConfigError(f"plan: --tokenizer-model {path} is not a SentencePiece model (no pieces)")
    return pieces


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")
