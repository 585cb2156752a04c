"""The vocabulary plan pads is the one Megatron-LM's tokenizer reports, not --vocab-size as given.

The fixtures were made by the real libraries (not installed here): ``tiny_sp.model`` by
sentencepiece 0.2.x (``SentencePieceTrainer.train(vocab_size=300, model_type="bpe",
normalization_rule_name="identity")``: ``SentencePieceProcessor.vocab_size()`` 300) and
``hf_tokenizer/tokenizer.json`` by tokenizers (a 200-token BPE, then ``add_special_tokens`` of two new
tokens and one already in it: ``get_vocab_size(with_added_tokens=True)`` 202).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mindspeed_like.plan import cli
from mindspeed_like.plan.tokenizer_vocab import GPT2_VOCAB, tokenizer_vocab
from mindspeed_like.testing import megatron_lm
from mindspeed_like.toolkit.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures"
MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 1"
).split()


def padded_vocab(*args: str, parser: str = "builtin") -> tuple[int, tuple[str, ...]]:
    own, rest = cli.plan_parser().parse_known_args([*MODEL, *args, "--parser", parser, "--target-device", "cpu"])
    run, _ = cli.read_run(rest, own)
    return run.model.vocab_size, run.notes


def ns(**values) -> argparse.Namespace:
    base = dict(tokenizer_type=None, vocab_size=None, vocab_file=None, tokenizer_model=None)
    return argparse.Namespace(**{**base, **values})


def test_null_tokenizer_adds_its_eod_token_before_padding() -> None:
    # 32000 + EOD = 32001, up to a multiple of 128: 32128 rows (Megatron-LM prints "padded vocab (size:
    # 32001) with 127 dummy tokens (new size: 32128)"); at TP 8 a multiple of 1024
    assert padded_vocab("--tokenizer-type", "NullTokenizer", "--vocab-size", "32000")[0] == 32128
    tp8 = ("--tensor-model-parallel-size", "8", "--num-attention-heads", "8")
    assert padded_vocab("--tokenizer-type", "NullTokenizer", "--vocab-size", "32768", *tp8)[0] == 33792
    assert padded_vocab("--vocab-size", "32000")[0] == 32000  # no tokenizer named: the vocabulary as given


def test_gpt2_bpe_counts_its_vocab_file(tmp_path: Path) -> None:
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({f"t{i}": i for i in range(1000)}))
    assert tokenizer_vocab(ns(tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab))) == (1000, None)
    size, note = tokenizer_vocab(ns(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "absent.json")))
    assert size == GPT2_VOCAB and "GPT-2's vocabulary" in note
    # the 175B example's tokenizer: 50257 padded to 50304
    assert padded_vocab("--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/nowhere/gpt2-vocab.json")[0] == 50304


def test_huggingface_and_sentencepiece_files_are_read_without_their_libraries() -> None:
    hf = tokenizer_vocab(ns(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(FIXTURES / "hf_tokenizer")))
    assert hf == (202, None)  # the directory's tokenizer.json is read, as from_pretrained does
    sp = tokenizer_vocab(ns(tokenizer_type="Llama2Tokenizer", tokenizer_model=str(FIXTURES / "tiny_sp.model")))
    assert sp == (300, None)
    # the file wins over --vocab-size, as in Megatron-LM (it pads the tokenizer's count)
    given = ns(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=str(FIXTURES / "tiny_sp.model"))
    given.vocab_size = 128256
    assert tokenizer_vocab(given) == (300, None)


def test_tokenizer_file_missing_here_takes_vocab_size_and_says_so() -> None:
    vocab, notes = padded_vocab(
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "meta-llama/Meta-Llama-3-8B",
        "--vocab-size", "128256",
    )  # fmt: skip
    assert vocab == 128256
    assert any("--vocab-size 128,256 taken as its vocabulary" in note for note in notes)


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(tokenizer_type="NullTokenizer"), "NullTokenizer needs --vocab-size"),
        (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="org/model"), "not readable here"),
        (dict(), "give --vocab-size N"),
    ],
)
def test_no_vocabulary_is_a_clear_error(values: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tokenizer_vocab(ns(**values))


def test_a_file_that_is_not_a_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(b"\xff" * 16)
    with pytest.raises(ConfigError, match="is not a SentencePiece model"):
        tokenizer_vocab(ns(tokenizer_type="Llama2Tokenizer", tokenizer_model=str(bad)))


@pytest.mark.skipif(not megatron_lm.available(), reason=megatron_lm.SKIP_REASON)
@pytest.mark.parametrize("tp", [1, 4])
def test_megatron_lm_pads_the_same_vocabulary(tmp_path: Path, tp: int) -> None:
    """Megatron-LM's own build_tokenizer (the legacy one that sets padded_vocab_size) on the same
    arguments, for the tokenizers whose libraries are here."""
    import sys

    sys.path.insert(0, megatron_lm.MEGATRON_LM)
    from megatron.training.tokenizer.tokenizer import build_tokenizer

    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps({**{f"t{i}": i for i in range(776)}, "<|endoftext|>": 776}))
    merges.write_text("#version: 0.2\n")
    for values in (
        dict(tokenizer_type="NullTokenizer", vocab_size=32000),
        dict(tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges)),
    ):
        args = argparse.Namespace(
            **{**vars(ns()), **values},
            rank=0,
            padded_vocab_size=None,
            make_vocab_size_divisible_by=128,
            tensor_model_parallel_size=tp,
        )
        build_tokenizer(args)
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in values.items() if k != "merge_file"]
        heads = ("--num-attention-heads", "4") if tp == 4 else ()
        for parser in ("builtin", "megatron-lm"):
            planned = padded_vocab(*flags, "--tensor-model-parallel-size", str(tp), *heads, parser=parser)[0]
            assert planned == args.padded_vocab_size, (parser, values)
