"""te-client-module: ``import transformer_engine`` for clients, without TransformerEngine.

In fresh interpreters (import order matters): each order (client first, megatron first, adaptor
then megatron then client) serves our module to the client while EVERY megatron-core module that
probes TE at import (read from the installed source) has imported and holds no True ``HAVE_TE*``
and no reference to our module; the report lists the feature as a global change; probing
libraries (accelerate, transformers) still answer "not installed" (no distribution metadata);
``reset()`` removes the finder and the served modules, and applying again serves again. A real
TE on sys.path (a stand-in package) is never shadowed. In process: the layers against torch's own
math, the refusals, and the finder's rules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mindspeed_like.te_backend.refusals import TransformerEngineFeatureUnsupported
from mindspeed_like.te_shim import ops, pytorch, recipe

SCRIPT = os.path.join(os.path.dirname(__file__), "import_order_script.py")


def _run(order: str, extra_path: str | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, SCRIPT, order], capture_output=True, text=True, env=env, timeout=900, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("order", ["client-first", "megatron-first", "adaptor-megatron-client"])
def test_megatron_sees_no_te_in_any_import_order(order):
    out = _run(order)
    assert out["served"] and out["fp8_supported"] is False
    assert out["probers"] > 0 and out["probers_imported"] == out["probers"]
    assert out["have_te_true"] == []
    assert out["holding_ours"] == []
    assert out["te_moe_experts"] == "TEGroupedMLP"
    if order == "client-first":
        assert out["extension_te_is_mock"]  # megatron's TE extension took its no-TE branch
    # the report lists it, as a declared global change
    assert out["report"] == [
        ["te-client-module", "mindspeed_like.te_shim.finder.ClientModuleFinder.find_spec", "applied", True]
    ]
    # probing libraries: importable, but no distribution -> "not installed" (no fp8 paths taken)
    assert out["find_spec"] and not out["metadata"]
    assert out["accelerate"] in (False, None) and out["transformers"] in (False, None)
    # reset() removes the finder and the modules it served; applying again serves again
    assert out["after_reset_modules"] == [] and out["after_reset_finders"] == []
    assert not out["after_reset_importable"]
    assert out["reapplied_served"]


def test_a_real_transformer_engine_is_never_shadowed(tmp_path):
    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text("__version__ = '2.8.0'  # stand-in for an installed TE\n")
    out = _run("fake-te", extra_path=str(tmp_path))
    assert out["module_file"] == str(package / "__init__.py")
    assert out["finders"] == [] and out["report"] == []


# ---------------------------------------------------------------------------- the layers, in process
def test_linear_is_torch_linear_with_te_contract():
    torch.manual_seed(0)
    layer = pytorch.Linear(8, 6, bias=True, params_dtype=torch.float32, device="cpu")
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=0, atol=0)
    returning = pytorch.Linear(8, 6, return_bias=True, device="cpu")
    out, bias = returning(x)
    assert bias is returning.bias
    torch.testing.assert_close(out, x @ returning.weight.t(), rtol=0, atol=0)
    assert set(layer.state_dict()) == {"weight", "bias", "_extra_state"}
    with pytest.raises(ValueError, match="tensor/sequence parallelism is megatron's"):
        pytorch.Linear(8, 6, tp_size=2, parallel_mode="column")


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_layernorm_linear_and_norms(normalization):
    torch.manual_seed(0)
    layer = pytorch.LayerNormLinear(
        8, 4, eps=1e-6, normalization=normalization, return_layernorm_output=True, device="cpu"
    )
    with torch.no_grad():
        layer.layer_norm_weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 8, dtype=torch.float64).float()
    out, normed = layer(x)
    if normalization == "RMSNorm":
        ref = torch.nn.functional.rms_norm(x, (8,), layer.layer_norm_weight, 1e-6)
        norm = pytorch.RMSNorm(8, eps=1e-6, device="cpu")
        assert {"weight", "_extra_state"} == set(norm.state_dict())
    else:
        ref = torch.nn.functional.layer_norm(x, (8,), layer.layer_norm_weight, layer.layer_norm_bias, 1e-6)
        norm = pytorch.LayerNorm(8, eps=1e-6, device="cpu")
        assert {"weight", "bias", "_extra_state"} == set(norm.state_dict())
    torch.testing.assert_close(normed, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, torch.nn.functional.linear(ref, layer.weight, layer.bias), rtol=1e-5, atol=1e-6)
    assert torch.equal(norm(x), norm(x))
    zero_centered = pytorch.RMSNorm(8, zero_centered_gamma=True, device="cpu")
    assert torch.equal(zero_centered.weight, torch.zeros(8))
    torch.testing.assert_close(zero_centered(x), torch.nn.functional.rms_norm(x, (8,), torch.ones(8), 1e-5))


@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
def test_dot_product_attention_causal_gqa(layout):
    torch.manual_seed(0)
    s, b, heads, groups, d = 6, 2, 4, 2, 8
    attention = pytorch.DotProductAttention(heads, d, num_gqa_groups=groups, qkv_format=layout, attn_mask_type="causal")
    q = torch.randn(s, b, heads, d)
    k = torch.randn(s, b, groups, d)
    v = torch.randn(s, b, groups, d)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), is_causal=True, enable_gqa=True
    )  # [b, h, s, d]
    if layout == "sbhd":
        out = attention(q, k, v)
        expected = reference.permute(2, 0, 1, 3).reshape(s, b, heads * d)
    else:
        out = attention(*(t.transpose(0, 1) for t in (q, k, v)))
        expected = reference.permute(0, 2, 1, 3).reshape(b, s, heads * d)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_grouped_linear_rows_by_group():
    torch.manual_seed(0)
    layer = pytorch.GroupedLinear(3, 8, 5, bias=True, device="cpu")
    with torch.no_grad():
        for i in range(3):
            getattr(layer, f"bias{i}").uniform_()
    x = torch.randn(7, 8)
    splits = [2, 0, 5]
    out = layer(x, splits)
    pieces = torch.split(x, splits)
    expected = torch.cat(
        [
            torch.nn.functional.linear(p, getattr(layer, f"weight{i}"), getattr(layer, f"bias{i}"))
            for i, p in enumerate(pieces)
        ]
    )
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert {f"weight{i}" for i in range(3)} <= set(layer.state_dict())


# ---------------------------------------------------------------------------- refusals
def test_fp8_refused_when_enabled_and_nothing_when_disabled():
    with pytorch.fp8_autocast(enabled=False):
        pass
    with pytest.raises(TransformerEngineFeatureUnsupported, match="fp8 training.*--bf16"):
        with pytorch.fp8_autocast(enabled=True):
            pass
    with pytest.raises(TransformerEngineFeatureUnsupported, match="DelayedScaling"):
        recipe.DelayedScaling()


def test_fp8_probes_answer_unsupported_as_te_on_a_gpu_without_fp8():
    """``transformer_engine.pytorch.fp8``: megatron's tests import its probes at module level (11 of its
    test files failed to import without the submodule); they answer (False, reason), as TE does."""
    from mindspeed_like.te_shim import finder, fp8

    for probe in (fp8.check_fp8_support, fp8.check_mxfp8_support, fp8.check_fp8_block_scaling_support):
        supported, reason = probe()
        assert supported is False and "no fp8 kernels" in reason
    assert not fp8.FP8GlobalStateManager.is_fp8_enabled()
    with fp8.fp8_autocast(enabled=False):
        pass
    with pytest.raises(TransformerEngineFeatureUnsupported, match="fp8 training"):
        with fp8.fp8_autocast(enabled=True):
            pass
    with pytest.raises(TransformerEngineFeatureUnsupported, match="fp8 training"):
        fp8.get_fp8_recipe  # noqa: B018
    assert finder.MODULES["transformer_engine.pytorch.fp8"] == fp8.__name__


def test_userbuffers_cuda_graphs_offload_ops_refused_by_name():
    with pytest.raises(TransformerEngineFeatureUnsupported, match="--use-tiled-tp-overlap"):
        pytorch.Linear(8, 8, ub_overlap_ag=True, ub_name="qkv")
    with pytest.raises(TransformerEngineFeatureUnsupported, match="--use-tiled-tp-overlap"):
        pytorch.initialize_ub  # noqa: B018
    with pytest.raises(TransformerEngineFeatureUnsupported, match="CUDA graphs"):
        pytorch.make_graphed_callables  # noqa: B018
    with pytest.raises(TransformerEngineFeatureUnsupported, match="CPU offloading"):
        pytorch.get_cpu_offload_context  # noqa: B018
    assert not hasattr(pytorch, "initialize_ub")  # hasattr probes read "absent"
    with pytest.raises(TransformerEngineFeatureUnsupported, match=r"ops\.Sequential"):
        ops.Sequential()


# ---------------------------------------------------------------------------- the finder's rules
def test_finder_serves_only_its_names_and_never_over_a_real_te(monkeypatch):
    from mindspeed_like.te_shim import finder

    client = finder.ClientModuleFinder()
    client._settled = True
    assert client.find_spec("transformer_engine.pytorch.optimizers") is None  # clients' fallbacks run
    assert client.find_spec("transformer_engine").loader is client
    monkeypatch.setattr(finder, "real_te_installed", lambda: True)
    assert client.find_spec("transformer_engine") is None
    client._settled, client._settling = False, True
    monkeypatch.setattr(finder, "real_te_installed", lambda: False)
    assert client.find_spec("transformer_engine") is None  # megatron is deciding: declined
