"""fsdp2-config (``--fsdp2-config-path``): MindSpeed's FSDP2 YAML on megatron's torch-FSDP2 path.

Parsing and validation without a model (every mistake a ConfigError naming the key), the
validate_args hook against Megatron-LM's arguments, and megatron's tiny GPT trained on 2 gloo ranks
under megatron's ``TorchFullyShardedDataParallel`` with YAML configurations against the same run without
one (HSDP over 4 ranks: slow)."""

from __future__ import annotations

import argparse

import fsdp2_config_workers as workers
import pytest
import torch

from mindspeed_like.features import fsdp2_config
from mindspeed_like.features.fsdp2_config import options as yaml_options
from mindspeed_like.testing import run_distributed
from mindspeed_like.toolkit.errors import ConfigError


def _parse(text: str, tmp_path):
    path = tmp_path / "fsdp2.yaml"
    path.write_text(text)
    return yaml_options.load(str(path))


# ------------------------------------------------------------------------------------------------
# the file, without a model


def test_mindspeed_example_parses(tmp_path):
    options = _parse(
        "sharding_size: auto\n"
        "sub_modules_to_wrap:\n  - output_layer\n  - embedding\n  - decoder.layers.{*}\n"
        "param_dtype: bf16\nreduce_dtype: fp32\ncast_forward_inputs: true\n"
        "recompute_modules:\n  - decoder.layers.{0-3,6}\nnum_to_forward_prefetch: 2\nnum_to_backward_prefetch: 2\n"
        "offload_to_cpu: false\nreshard_after_forward: false\nuse_reentrant: false\n",
        tmp_path,
    )
    assert options.sharding_size == "auto"
    assert [e.text for e in options.sub_modules_to_wrap] == ["output_layer", "embedding", "decoder.layers.{*}"]
    assert options.sub_modules_to_wrap[2].indices == "*"
    assert options.recompute_modules[0].indices == (0, 1, 2, 3, 6)
    assert (options.param_dtype, options.reduce_dtype, options.output_dtype) == (torch.bfloat16, torch.float32, None)
    assert options.reshard_after_forward is False and options.use_reentrant is False
    assert options.num_to_forward_prefetch == 2


def test_a_class_entry_is_mindspeeds_earlier_spelling(tmp_path):
    from megatron.core.transformer.transformer_layer import TransformerLayer

    options = _parse(
        "sub_modules_to_wrap:\n  - megatron.core.transformer.transformer_layer.TransformerLayer\n", tmp_path
    )
    assert options.sub_modules_to_wrap[0].cls is TransformerLayer


@pytest.mark.parametrize(
    "text, key, says",
    [
        ("param_dtyp: bf16\n", "param_dtyp", "Did you mean 'param_dtype'?"),
        ("moe_modules: [a]\n", "moe_modules", "MindSpeed-MM's native FSDP2 trainer only"),
        ("param_dtype: fp8\n", "param_dtype", "is not a dtype taken here"),
        ("reduce_dtype: fp16\n", "reduce_dtype", "megatron refuses fp16"),
        ("sub_modules_to_wrap:\n  - decoder.layers.{0-3\n", "sub_modules_to_wrap", "unbalanced braces"),
        ("ignored_modules:\n  - a.{1}.b.{2}\n", "ignored_modules", "more than one pair of braces"),
        ("recompute_modules:\n  - decoder.layers.{3-1}\n", "recompute_modules", "runs backwards"),
        ("recompute_modules:\n  - decoder.layers.{a-b}\n", "recompute_modules", "is not '*' nor indices"),
        ("sub_modules_to_wrap:\n  - decoder.layers{*}\n", "sub_modules_to_wrap", "a whole path segment"),
        ("sub_modules_to_wrap: decoder\n", "sub_modules_to_wrap", "not a list of module paths"),
        ("sharding_size: 0\n", "sharding_size", "is not 'auto' nor an int >= 1"),
        ("reshard_after_forward: 1\n", "reshard_after_forward", "is not true, false nor an int >= 2"),
        ("sharding_size: 4\nreshard_after_forward: 3\n", "reshard_after_forward", "must divide"),
        ("offload_to_cpu: 'yes'\n", "offload_to_cpu", "is not true or false"),
        ("num_to_forward_prefetch: -1\n", "num_to_forward_prefetch", "is not an int >= 0"),
        ("sub_modules_to_wrap: [embedding]\nignored_modules: [embedding]\n", "ignored_modules", "sharded or ignored"),
    ],
)
def test_each_mistake_names_its_key(tmp_path, text, key, says):
    with pytest.raises(ConfigError) as error:
        _parse(text, tmp_path)
    message = str(error.value)
    assert f": {key}: " in message and says in message, message


def test_the_docs_table_lists_every_key_taken():
    from pathlib import Path

    page = Path(__file__).parents[2] / "docs" / "features" / "fsdp2-config.md"
    section = page.read_text().split("## The YAML's keys", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1].strip().strip("`") for line in section.splitlines() if line.startswith("| `")]
    assert rows == list(yaml_options.KEYS)


def test_sharding_size_must_divide_the_data_parallel_size():
    options = yaml_options.from_mapping({"sharding_size": 3})
    options.check_group_size(6, "DP")
    with pytest.raises(ConfigError, match=r"sharding_size: 3 does not divide DP \(4 ranks\)"):
        options.check_group_size(4, "DP")


def test_configure_refuses_a_bad_file_at_once(tmp_path):
    import mindspeed_like

    path = tmp_path / "bad.yaml"
    path.write_text("sharding_sise: 2\n")
    with pytest.raises(ConfigError, match="sharding_sise: not a key.*Did you mean 'sharding_size'"):
        mindspeed_like.configure(device="cpu", fsdp2_config_path=str(path))
    mindspeed_like.configure(fsdp2_config_path=None)


def _args(path: str, **values) -> argparse.Namespace:
    base = dict(
        fsdp2_config_path=path,
        use_torch_fsdp2=True,
        recompute_granularity=None,
        torch_fsdp2_reshard_after_forward=True,
        data_parallel_size=4,
        context_parallel_size=1,
    )
    return argparse.Namespace(**{**base, **values})


def _hook(args) -> None:
    with fsdp2_config.check_arguments(args):
        pass


def test_validate_args_hook(tmp_path):
    path = tmp_path / "f.yaml"
    path.write_text("sharding_size: 2\nrecompute_modules:\n  - decoder.layers.{*}\nreshard_after_forward: true\n")
    _hook(_args(str(path)))  # accepted: 2 divides DP 4
    with pytest.raises(ConfigError, match="add --use-torch-fsdp2"):
        _hook(_args(str(path), use_torch_fsdp2=False))
    with pytest.raises(ConfigError, match="recompute_modules: megatron's --recompute-granularity full"):
        _hook(_args(str(path), recompute_granularity="full"))
    with pytest.raises(ConfigError, match="reshard_after_forward: True contradicts"):
        _hook(_args(str(path), torch_fsdp2_reshard_after_forward=False))
    with pytest.raises(ConfigError, match="sharding_size: 2 does not divide the data-parallel size"):
        _hook(_args(str(path), data_parallel_size=3))


# ------------------------------------------------------------------------------------------------
# megatron's GPT trained with a YAML, 2 gloo ranks (one spawn)

LAYERS = "  - decoder.layers.{*}\n"
UNITS = ["embedding", "rotary_pos_emb", "decoder.layers.0", "decoder.layers.1", "output_layer"]


def _cases() -> list[dict]:
    te = dict(impl="transformer_engine")
    return [
        dict(te, name="plain", yaml=None),
        dict(
            te,
            name="pattern",
            yaml="sub_modules_to_wrap:\n" + LAYERS + "  - embedding\n  - rotary_pos_emb\n  - output_layer\n",
        ),
        dict(te, name="hsdp-1", yaml="sharding_size: 1\n"),
        dict(te, name="recompute", yaml="recompute_modules:\n" + LAYERS + "num_to_forward_prefetch: 1\n"),
        dict(te, name="no-match", yaml="sub_modules_to_wrap:\n  - decoder.layer.{*}\n"),
        dict(te, name="out-of-range", yaml="recompute_modules:\n  - decoder.layers.{0-5}\n"),
        dict(name="local-plain", impl="local", yaml=None),
        dict(name="local-keep", impl="local", yaml="reshard_after_forward: false\n"),
    ]


def _more_cases() -> list[dict]:
    te = dict(impl="transformer_engine")
    return [
        dict(te, name="plain", yaml=None),
        dict(te, name="layers-only", yaml="sub_modules_to_wrap:\n  - decoder.layers.{0-1}\n"),
        dict(te, name="recompute-nonreentrant", yaml="recompute_modules:\n" + LAYERS + "use_reentrant: false\n"),
        dict(te, name="bf16", yaml="param_dtype: bf16\nreduce_dtype: fp32\n"),
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return run_distributed(workers.train_cases, 2, _cases(), str(tmp_path_factory.mktemp("yaml")), timeout=600)[0]


@pytest.fixture(scope="module")
def trained_more(tmp_path_factory):
    return run_distributed(workers.train_cases, 2, _more_cases(), str(tmp_path_factory.mktemp("yaml")), timeout=600)[0]


def test_patterns_choose_the_units_and_train_as_the_default(trained):
    plain = trained["plain"]
    assert plain["units"] == UNITS and plain["mesh"] == (2,)
    # the same units named by pattern: the same run, bit for bit
    assert trained["pattern"]["units"] == UNITS
    assert trained["pattern"]["losses"] == plain["losses"]
    assert plain["losses"][1] != plain["losses"][0]  # it trains


@pytest.mark.slow
def test_other_units_and_precisions(trained_more):
    plain = trained_more["plain"]
    # only the layers as units (the rest in the root's group): other units, the same training to fp32 rounding
    assert trained_more["layers-only"]["units"] == ["decoder.layers.0", "decoder.layers.1"]
    assert trained_more["layers-only"]["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=0)
    nonreentrant = trained_more["recompute-nonreentrant"]
    assert nonreentrant["losses"] == plain["losses"]
    assert nonreentrant["saved_bytes"] < plain["saved_bytes"] / 2, (nonreentrant["saved_bytes"], plain["saved_bytes"])
    assert trained_more["bf16"]["losses"] == pytest.approx(plain["losses"], rel=2e-3)


def test_hsdp_mesh_trains_as_plain_fsdp2(trained):
    hsdp = trained["hsdp-1"]
    assert hsdp["mesh"] == (2, 1)  # replicate over 2, shard in groups of 1
    assert hsdp["losses"] == pytest.approx(trained["plain"]["losses"], rel=1e-6, abs=0)
    # megatron's own grad-norm group look-up refuses the 2-D mesh: the wrapper is what makes clipping work
    assert "dimension" in (hsdp["megatron_group_error"] or "").lower(), hsdp["megatron_group_error"]
    assert trained["plain"]["megatron_group_error"] is None


def test_recompute_modules_save_less_and_train_the_same(trained):
    run, plain = trained["recompute"], trained["plain"]
    assert run["losses"] == plain["losses"]  # the recompute is the same forward
    assert run["saved_bytes"] < plain["saved_bytes"] / 2, (run["saved_bytes"], plain["saved_bytes"])


def test_local_spec_keeps_megatrons_units(trained):
    # megatron drops ColumnParallelLinear from its entries for the local spec; the YAML's matcher too
    local = trained["local-keep"]
    assert (
        local["units"]
        == trained["local-plain"]["units"]
        == ["embedding", "rotary_pos_emb", "decoder.layers.0", "decoder.layers.1"]
    )
    assert local["losses"] == trained["local-plain"]["losses"]  # keeping the unsharded parameters changes nothing


def test_a_pattern_matching_nothing_is_refused_when_the_wrapper_is_built(trained):
    assert trained["no-match"]["error"].endswith(
        "no-match.yaml: sub_modules_to_wrap: 'decoder.layer.{*}' matches no module: decoder has no 'layer' "
        "(its children: layers, final_layernorm)"
    )
    assert (
        "recompute_modules: 'decoder.layers.{0-5}': decoder.layers has no 2, 3, 4, 5"
        in trained["out-of-range"]["error"]
    )


@pytest.mark.slow
def test_hsdp_over_four_ranks_trains_as_plain_fsdp2(tmp_path):
    cases = [
        dict(name="plain", impl="local", yaml=None),
        dict(name="hsdp", impl="local", yaml="sharding_size: 2\n"),
    ]
    result = run_distributed(workers.train_cases, 4, cases, str(tmp_path), timeout=600)[0]
    assert result["hsdp"]["mesh"] == (2, 2)
    assert result["hsdp"]["losses"] == pytest.approx(result["plain"]["losses"], rel=1e-6, abs=0)
