"""repatch(args): MindSpeed's client API with megatron's arguments as ms-swift and verl pass them
(a whole argument dict, a DictConfig-like Mapping, a Namespace); docs/clients.md."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
from collections.abc import Iterator, Mapping

import pytest

import mindspeed_like
from mindspeed_like import runtime
from mindspeed_like.megatron_adaptor import Repatched, repatch
from mindspeed_like.toolkit.errors import ConfigError

# ms-swift's asdict(MegatronSftArguments) holds hundreds of its own and megatron's keys; these stand
# for them (none is ours), beside the ones ms-swift sets for MindSpeed (use_flash_attn on NPU).
SWIFT_LIKE = {
    "model": "Qwen/Qwen3-0.6B",
    "tensor_model_parallel_size": 1,
    "context_parallel_size": 2,
    "use_megatron_fsdp": False,
    "attention_backend": "flash",
    "device": "npu",  # a client's own `device`: never our generic --device
    "strict": True,
    "moe_permute_fusion": False,
}


class DictConfigLike(Mapping):
    """A read-only Mapping that is no dict, as omegaconf's DictConfig (verl's override_transformer_config)."""

    def __init__(self, data: dict) -> None:
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self) -> Iterator:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.delenv("MINDSPEED_LIKE_ARGS", raising=False)
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    yield
    mindspeed_like.reset()


def _applied(feature: str) -> bool:
    return any(r.feature == feature and r.status == "applied" for r in mindspeed_like.report())


def test_switches_on_what_the_args_ask_and_says_what_changed(fresh):
    import megatron.core.transformer.dot_product_attention  # noqa: F401  (flash-attention's target applied at once)

    assert not _applied("flash-attention")
    result = repatch({**SWIFT_LIKE, "use_flash_attn": True, "context_parallel_algo": "ulysses_cp_algo"})
    assert isinstance(result, Repatched) and result
    assert result.flags["use_flash_attn"] == (False, True)
    assert result.flags["context_parallel_algo"] == ("megatron_cp_algo", "ulysses_cp_algo")
    assert "flash-attention" in result.switched_on and result.switched_off == ()
    assert _applied("flash-attention")
    config = mindspeed_like.current_config()
    assert config.sources["use_flash_attn"] == "megatron-args" and config["context_parallel_algo"] == "ulysses_cp_algo"
    # the client's own device/strict are not ours; megatron's own arguments pass through untouched
    assert config["device"] == "cpu" and config["strict"] is False
    assert set(runtime.megatron_args()) == {"use_flash_attn", "context_parallel_algo", "moe_permute_fusion"}
    # the same args again: nothing changes
    assert not repatch({**SWIFT_LIKE, "use_flash_attn": True, "context_parallel_algo": "ulysses_cp_algo"})


def test_merges_like_mindspeed_absent_keep_present_win_none_unsets(fresh, monkeypatch):
    repatch({"use_flash_attn": True})
    result = repatch({"use_fused_rmsnorm": True})  # use_flash_attn absent: kept
    assert mindspeed_like.current_config()["use_flash_attn"] is True and result.switched_on == ("fused-rmsnorm",)
    result = repatch({"use_flash_attn": False})  # present: wins
    assert result.flags == {"use_flash_attn": (True, False)} and result.switched_off == ("flash-attention",)
    monkeypatch.setenv("MINDSPEED_LIKE_ARGS", "--use-flash-attn")
    # megatron's args sit above the env variable, as Megatron-LM's command line does
    assert runtime.apply()["use_flash_attn"] is False
    repatch({"use_flash_attn": None})  # None: unset, the env variable's value shows through
    assert mindspeed_like.current_config().sources["use_flash_attn"] == "env"
    mindspeed_like.configure(use_flash_attn=False)  # configure() above all
    assert not repatch({"use_flash_attn": True}).flags


@pytest.mark.parametrize(
    "make",
    [dict, DictConfigLike, lambda d: argparse.Namespace(**d), lambda d: types.SimpleNamespace(**d)],
    ids=["dict", "mapping", "namespace", "simple-namespace"],
)
def test_takes_a_dict_a_mapping_or_a_namespace(fresh, make):
    assert repatch(make({"use_fused_swiglu": True, "num_layers": 2})).flags == {"use_fused_swiglu": (False, True)}


def test_mindspeed_spellings_and_their_disagreement(fresh):
    assert repatch({"use_ascend_coc": True, "coc_parallel_num": 2}).flags == {
        "use_tiled_tp_overlap": (False, True),
        "tiled_tp_overlap_chunks": (4, 2),
    }
    with pytest.raises(ConfigError, match=r"use_tiled_tp_overlap=False and use_ascend_coc=True are two spellings"):
        repatch({"use_ascend_coc": True, "use_tiled_tp_overlap": False})


@dataclasses.dataclass
class SwiftArgs:
    use_flash_attn: bool = True


@pytest.mark.parametrize(
    ("args", "hint"),
    [([("use_flash_attn", True)], "builtins.list"), (SwiftArgs(), "dataclasses.asdict"), ("--use-flash-attn", "str")],
)
def test_another_type_is_a_type_error_naming_it(fresh, args, hint):
    with pytest.raises(TypeError, match=r"repatch\(\): expected megatron's arguments as a dict") as error:
        repatch(args)
    assert hint in str(error.value)


def test_a_bad_value_is_refused_and_nothing_changes(fresh):
    repatch({"use_fused_rmsnorm": True})
    before = (mindspeed_like.current_config(), runtime.megatron_args(), [r.target for r in mindspeed_like.report()])
    with pytest.raises(
        ConfigError, match=r"repatch\(\) argument 'use_flash_attn': use_flash_attn='yes'.*expected bool"
    ):
        repatch({"use_flash_attn": "yes"})
    with pytest.raises(ConfigError, match=r"context_parallel_algo='ring' is not one of"):
        repatch({"context_parallel_algo": "ring"})
    # a refusal found by the runtime (not by the type check): the previous megatron args are back
    with pytest.raises(ConfigError):
        repatch({"ulysses_degree_in_cp": 2})  # only with --context-parallel-algo hybrid_cp_algo
    assert (
        mindspeed_like.current_config(),
        runtime.megatron_args(),
        [r.target for r in mindspeed_like.report()],
    ) == before
    mindspeed_like.configure()  # the refused values are not left behind to fail the next apply


def test_reset_forgets_them(fresh):
    repatch({"use_flash_attn": True})
    mindspeed_like.reset()
    assert runtime.megatron_args() == {} and mindspeed_like.current_config()["use_flash_attn"] is False
