"""The plan's byte counts against the real megatron-core GPT, built as `mindspeed-like compare`'s
workers build it (one rank, CPU, bf16): the parameters megatron creates, and the bytes one forward
saves for backward (``SavedBytesMeter``, parameters excluded), for megatron's own path (level 0)
and the features (levels 1 and 2), per preset. The measuring is testing/plan_parity.py's, which the
CUDA lane runs on a GPU too. Multi-rank layouts are checked against compare's records
(test_accuracy.py)."""

from __future__ import annotations

import pytest
import torch

from mindspeed_like.testing import plan_parity

CASES = [
    ("llama", "transformer_engine", 0),
    ("llama", "transformer_engine", 2),
    ("llama", "local", 1),
    ("moe", "transformer_engine", 2),
    pytest.param("llama", "local", 0, marks=pytest.mark.slow),
    pytest.param("gpt", "transformer_engine", 0, marks=pytest.mark.slow),
    pytest.param("gpt", "transformer_engine", 2, marks=pytest.mark.slow),
    pytest.param("moe", "transformer_engine", 0, marks=pytest.mark.slow),
    pytest.param("moe", "transformer_engine", 1, marks=pytest.mark.slow),
    pytest.param("qwen3-moe", "transformer_engine", 0, marks=pytest.mark.slow),
    pytest.param("qwen3-moe", "transformer_engine", 2, marks=pytest.mark.slow),
    pytest.param("deepseek", "transformer_engine", 0, marks=pytest.mark.slow),
    pytest.param("deepseek", "transformer_engine", 2, marks=pytest.mark.slow),
]


# megatron's default dropout (0.1, hidden and attention), as Megatron-LM runs it: the masks, and on a
# CPU host the flash-attention feature's SDPA math kernel (its flash kernel takes no dropout)
DROPOUT_CASES = [
    ("llama", "local", 0),
    ("llama", "transformer_engine", 1),
    ("llama", "transformer_engine", 2),
    pytest.param("gpt", "transformer_engine", 1, marks=pytest.mark.slow),
    pytest.param("moe", "transformer_engine", 2, marks=pytest.mark.slow),
    pytest.param("deepseek", "transformer_engine", 0, marks=pytest.mark.slow),
    pytest.param("deepseek", "transformer_engine", 2, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("preset", "impl", "level"), CASES)
def test_parameters_and_saved_bytes_match_the_real_model(preset: str, impl: str, level: int) -> None:
    _check(preset, impl, level)


@pytest.mark.parametrize(("preset", "impl", "level"), DROPOUT_CASES)
def test_saved_bytes_with_megatrons_default_dropout(preset: str, impl: str, level: int, monkeypatch) -> None:
    from mindspeed_like.testing import models

    monkeypatch.setitem(models.DEFAULTS, "hidden_dropout", 0.1)
    monkeypatch.setitem(models.DEFAULTS, "attention_dropout", 0.1)
    _check(preset, impl, level, dropout=0.1)


def _check(preset: str, impl: str, level: int, dropout: float = 0.0) -> None:
    args = plan_parity.compare_options(preset, impl)
    predicted_params, predicted_saved = plan_parity.predicted(args, level, dropout, "cpu")
    built, saved = plan_parity.measured(args, level, torch.device("cpu"))
    assert predicted_params == built, f"{preset}/{impl}: plan {predicted_params} parameters, megatron built {built}"
    # every storage is one row of the model; the router's split of rows is the only data-dependent
    # part (balanced in the plan, exact at EP = 1 since every row lands on this rank)
    assert abs(predicted_saved / saved - 1) <= plan_parity.bound(preset, impl, level, "cpu"), (
        f"{preset}/{impl}/level {level}: plan {predicted_saved} bytes saved for backward, measured {saved} "
        f"({100 * (predicted_saved / saved - 1):+.2f}%)"
    )
