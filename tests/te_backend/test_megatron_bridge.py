"""Megatron-Bridge (NVIDIA's HF <-> Megatron converter, verl's default backend) after our import line,
without TransformerEngine: ``from megatron.bridge import AutoBridge`` imports (its
``peft/lora_layers.py`` imports ``transformer_engine.pytorch``: the te-client-module serves it),
a tiny RANDOM Qwen3 and Qwen3-MoE (transformers configs, no hub) convert to megatron's TE-spec
models (the te-backend's layers), give HF's own logits in fp32 (within 1e-4), train (the loss falls
over a few steps on one batch) and export back to HF bitwise (``export_hf_weights`` and
``save_hf_pretrained``).

Opt-in: Megatron-Bridge is not a dependency. ``make megatron-bridge-smoke`` installs it (0.3.1, the
last release for Python 3.11 and megatron-core 0.15-0.16) into .venv and runs this file.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile

import pytest
import torch
from tiny_qwen3 import COMMON, hf_model

from mindspeed_like.testing import run_distributed

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron.bridge") is None,
    reason="Megatron-Bridge is not installed (opt-in lane: `make megatron-bridge-smoke` installs it and runs this)",
)

LOGITS_ATOL = 1e-4  # the issue's bound: fp32, the same math in other module boundaries
STEPS = 5


def _save_tiny_tokenizer(path: str) -> None:
    """A word-level tokenizer over the tiny vocabulary (Bridge's save_hf_pretrained copies the
    tokenizer beside the weights; no hub download)."""
    import tokenizers
    import transformers

    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, COMMON["vocab_size"])}}
    inner = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>").save_pretrained(path)


def _bitwise_mismatches(expected: dict, got: dict) -> list[str]:
    bad = sorted(set(expected) ^ set(got))
    bad += [k for k in sorted(set(expected) & set(got)) if not torch.equal(expected[k], got[k].to(expected[k].dtype))]
    return bad


def bridge_worker(kinds: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="bridge-") as root:  # the HF folders, removed after
        return _bridge_worker(kinds, root)


def _bridge_worker(kinds: list[str], root: str) -> dict:
    import mindspeed_like
    import mindspeed_like.megatron_adaptor  # noqa: F401  (the user's import line)
    from mindspeed_like.testing.parallel import init_parallel

    mindspeed_like.configure(device="cpu")
    init_parallel(seed=1234)
    from megatron.bridge import AutoBridge  # imports transformer_engine.pytorch itself

    results: dict = {"te_module": repr(sys.modules["transformer_engine"].__spec__.loader)}
    for kind in kinds:
        hf = hf_model(kind)
        expected = {k: v.detach().clone() for k, v in hf.state_dict().items()}
        path = tempfile.mkdtemp(prefix=f"bridge_{kind}_", dir=root)
        hf.save_pretrained(path)
        _save_tiny_tokenizer(path)
        bridge = AutoBridge.from_hf_pretrained(path, torch_dtype=torch.float32)
        model = bridge.to_megatron_model(load_weights=True, wrap_with_ddp=False, use_cpu_initialization=True)
        gpt = model[0]
        out: dict = {"modules": sorted({type(m).__name__ for m in gpt.modules() if type(m).__name__.startswith("TE")})}
        torch.manual_seed(1)
        tokens = torch.randint(0, COMMON["vocab_size"], (2, 16))
        positions = torch.arange(16).unsqueeze(0).expand(2, -1)
        gpt.eval()
        with torch.no_grad():
            reference = hf(tokens).logits
            logits = gpt(input_ids=tokens, position_ids=positions, attention_mask=None)
        out["logits_max_diff"] = (logits - reference).abs().max().item()

        exported = {name: tensor.detach().cpu().clone() for name, tensor in bridge.export_hf_weights(model, cpu=True)}
        out["export_mismatches"] = _bitwise_mismatches(expected, exported)
        saved = tempfile.mkdtemp(prefix=f"bridge_{kind}_export_", dir=root)
        bridge.save_hf_pretrained(model, saved)
        reloaded = type(hf).from_pretrained(saved, torch_dtype=torch.float32).state_dict()
        out["save_mismatches"] = _bitwise_mismatches(expected, reloaded)

        gpt.train()
        optimizer = torch.optim.Adam(gpt.parameters(), lr=1e-2)
        labels = torch.roll(tokens, -1, dims=1)
        losses = []
        for _ in range(STEPS):
            optimizer.zero_grad()
            loss = gpt(input_ids=tokens, position_ids=positions, attention_mask=None, labels=labels).mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        out["losses"] = losses
        results[kind] = out
    mindspeed_like.reset()
    return results


@pytest.fixture(scope="module")
def bridge_results() -> dict:
    results = run_distributed(bridge_worker, 1, ["qwen3", "qwen3_moe"], timeout=1800)[0]
    for kind in ("qwen3", "qwen3_moe"):  # the numbers, for the lane's log (pytest -s / -rA)
        out = results[kind]
        print(
            f"{kind}: logits max|diff| {out['logits_max_diff']:.3g}; losses {[round(x, 4) for x in out['losses']]}; "
            f"export mismatches {len(out['export_mismatches'])}, save_hf_pretrained mismatches "
            f"{len(out['save_mismatches'])}"
        )
    return results


def test_the_client_module_served_transformer_engine(bridge_results):
    assert "ClientModuleFinder" in bridge_results["te_module"]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_bridge_model_is_te_backend_spec(bridge_results, kind):
    modules = bridge_results[kind]["modules"]
    assert {"TELayerNormColumnParallelLinear", "TERowParallelLinear", "TEDotProductAttention"} <= set(modules)
    if kind == "qwen3_moe":
        assert {"TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear"} <= set(modules)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_bridge_logits_equal_hf(bridge_results, kind):
    assert bridge_results[kind]["logits_max_diff"] <= LOGITS_ATOL, bridge_results[kind]["logits_max_diff"]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_bridge_export_round_trips_bitwise(bridge_results, kind):
    assert bridge_results[kind]["export_mismatches"] == []
    assert bridge_results[kind]["save_mismatches"] == []


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_bridge_model_trains(bridge_results, kind):
    losses = bridge_results[kind]["losses"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0], losses
