"""ms-swift's unmodified ``megatron sft`` on a CPU host (issue 55 items 1 and 7): ``make ms-swift-smoke``.

ms-swift 4.6.0 and mcore-bridge 1.6.5 run as their users run them: the ``megatron`` console script,
its torchrun workers, no line of theirs edited. The adaptor comes in through
``MINDSPEED_LIKE_AUTOLOAD=1`` (the effect of the import line in every worker) with
``MINDSPEED_LIKE_ARGS="--transfer-to-host ..."`` (their own CUDA calls on the host). Everything is
made here, offline: a byte-level BPE tokenizer trained on a synthetic corpus, a random 2-layer
Qwen3 and Qwen3-MoE (hidden 64) saved with ``save_pretrained``, and a chat jsonl.
``--check_model false`` is the one flag ms-swift needs offline (it otherwise asks the hub whether
the local model is a known one).

Each case is one ``megatron sft`` launch; its losses and grad norms are read from ms-swift's own
``logging.jsonl``. The checks: layouts (DP=2, TP=2 with SP, PP=2, EP=2) against the one-rank run of
the same model and precision (losses within bf16 noise, grad norms too); a run resumed from the
dist checkpoint its twin saved at iteration 2 (``--mcore_model DIR --finetune false``, as ms-swift
documents resuming) against the straight run's iterations 3-4; ``megatron export --to_hf true
--test_convert_precision true``: the HF export loaded by transformers and its logits against the
megatron model's, ms-swift's own comparison, and the export loaded by ``AutoModelForCausalLM``. The
record (command, versions, every case's figures, each check) goes to ``--record``.

Precisions as ms-swift spells them: ``--torch_dtype float32`` alone is fp16 mixed precision there,
so the fp32 cases add ``--fp16 false`` (:data:`FP32`); the fp16 case checks that ms-swift stops where
its own code makes it stop (:data:`FP16_STOP`).

Run: ``python -m mindspeed_like.testing.ms_swift_smoke --root DIR --record results/ms-swift-smoke.json
[--cases NAME ...]`` with ms-swift, mcore-bridge and this project installed in the same venv
(``make ms-swift-smoke`` builds that venv).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from importlib import metadata
from typing import Any

MSL_ARGS = "--transfer-to-host --optimization-level 1"
ITERS = 4
# bf16: each matmul rounds to 2**-8 relative; over 2 layers and 4 steps the order of the reductions
# (TP's split matmuls, DP's all-reduce, PP's two halves) moves a loss of ~6 by a few 1e-3 at most.
BF16_LOSS_ATOL = 2e-2
BF16_GRAD_NORM_RTOL = 2e-2
FP32_LOSS_ATOL = 1e-4

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True)


@dataclasses.dataclass(frozen=True)
class Case:
    """One ``megatron sft`` launch."""

    name: str
    model: str  # "qwen3" or "qwen3_moe"
    nproc: int = 1
    dtype: str = "bfloat16"
    tuner: str = "full"
    extra: tuple[str, ...] = ()
    msl_args: str = MSL_ARGS
    reference: str | None = None  # the case whose losses and grad norms this one must equal
    resume_from: str | None = None  # the case whose checkpoint-2 this one resumes
    # False where the reference's grad norms are not this layout's by construction (see LORA_INIT)
    grad_norm_compared: bool = True
    # a stop that is ms-swift's own behaviour (see FP16_STOP): the case checks that it stops so
    expected_stop: str | None = None


# ms-swift maps `--torch_dtype float32` to fp16 mixed precision (its ModelArguments._init_mixed_precision:
# fp16=True for float16 and float32) unless `--fp16 false`: that flag makes the fp32 cases fp32.
FP32 = ("--fp16", "false")
# ms-swift's fp16 stops at iteration 1, on any hardware: megatron's dynamic loss scaler starts at 2**32,
# the first backward overflows fp16 (the scaler's signal to skip the step and lower the scale;
# megatron-LM turns the NaN check off for fp16 with a dynamic scale), but ms-swift's wrap_model sets
# DDP's check_for_nan_in_grad=True unconditionally and megatron raises on the NaN. docs/clients.md.
FP16_STOP = r"found NaN in local grad norm for bucket #0 in backward pass before data-parallel communication"
# mcore-bridge's LoRA draws lora_A on each rank where it lives: kaiming_uniform on the local shard (at TP=2
# a row-parallel linear's lora_A has half the fan-in, so values up to sqrt(2) larger than at one rank),
# under each PP stage's own seed (PP=2's second stage draws other values). lora_B is zero, so iteration
# 1's loss is the same, but the adapters' gradients, and so the grad norms, differ. DP=2 draws the same.
LORA_INIT = "lora_A drawn per TP shard / PP stage (mcore-bridge): grad norms not comparable to one rank's"


CASES = (
    Case("qwen3-full-bf16", "qwen3", extra=("--save_steps", "2")),
    Case("qwen3-full-bf16-dp2", "qwen3", nproc=2, reference="qwen3-full-bf16"),
    Case(
        "qwen3-full-bf16-tp2-sp",
        "qwen3",
        nproc=2,
        extra=("--tensor_model_parallel_size", "2", "--sequence_parallel", "true"),
        reference="qwen3-full-bf16",
    ),
    Case(
        "qwen3-full-bf16-pp2",
        "qwen3",
        nproc=2,
        extra=("--pipeline_model_parallel_size", "2"),
        reference="qwen3-full-bf16",
    ),
    Case("qwen3-full-bf16-resume", "qwen3", resume_from="qwen3-full-bf16", reference="qwen3-full-bf16"),
    Case("qwen3-lora-bf16", "qwen3", tuner="lora"),
    Case("qwen3-lora-bf16-dp2", "qwen3", nproc=2, tuner="lora", reference="qwen3-lora-bf16"),
    Case(
        "qwen3-lora-bf16-pp2",
        "qwen3",
        nproc=2,
        tuner="lora",
        extra=("--pipeline_model_parallel_size", "2"),
        reference="qwen3-lora-bf16",
        grad_norm_compared=False,
    ),
    Case(
        "qwen3-lora-bf16-tp2-sp",
        "qwen3",
        nproc=2,
        tuner="lora",
        extra=("--tensor_model_parallel_size", "2", "--sequence_parallel", "true"),
        reference="qwen3-lora-bf16",
        grad_norm_compared=False,
    ),
    Case("qwen3-full-fp32", "qwen3", dtype="float32", extra=FP32),
    Case(
        "qwen3-full-fp32-tp2-sp",
        "qwen3",
        nproc=2,
        dtype="float32",
        extra=(*FP32, "--tensor_model_parallel_size", "2", "--sequence_parallel", "true"),
        reference="qwen3-full-fp32",
    ),  # fmt: skip
    Case("qwen3-full-fp16", "qwen3", dtype="float16", expected_stop=FP16_STOP),
    Case("qwen3_moe-full-bf16", "qwen3_moe"),
    Case(
        "qwen3_moe-full-bf16-ep2",
        "qwen3_moe",
        nproc=2,
        extra=("--expert_model_parallel_size", "2"),
        reference="qwen3_moe-full-bf16",
    ),  # fmt: skip
    Case("qwen3_moe-lora-bf16", "qwen3_moe", tuner="lora"),
    Case(
        "qwen3_moe-lora-bf16-ep2",
        "qwen3_moe",
        nproc=2,
        tuner="lora",
        extra=("--expert_model_parallel_size", "2"),
        reference="qwen3_moe-lora-bf16",
    ),
)
CI_CASES = ("qwen3-full-bf16", "qwen3-full-bf16-tp2-sp")
EXPORT_FROM = "qwen3-full-bf16"
BF16_EPS = 2**-8  # bf16's relative rounding (8 significant bits)


def make_assets(root: str) -> dict[str, str]:
    """The tokenizer, the two random models and the data, made here (no hub): their folders."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    corpus = [f"question {i}: what is {i} plus {i}? answer: {2 * i}. the quick brown fox jumps." for i in range(200)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    ids = dict(
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    folders = {}
    for kind in ("qwen3", "qwen3_moe"):
        folder = folders[kind] = os.path.join(root, kind)
        if os.path.exists(os.path.join(folder, "config.json")):
            continue
        torch.manual_seed(0)
        if kind == "qwen3":
            model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, **ids))
        else:
            model = transformers.Qwen3MoeForCausalLM(
                transformers.Qwen3MoeConfig(**COMMON, **MOE, **ids, mlp_only_layers=[])
            )
        tokenizer.save_pretrained(folder)
        model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    data = folders["data"] = os.path.join(root, "data.jsonl")
    with open(data, "w", encoding="utf-8") as handle:
        for i in range(32):
            messages = [
                {"role": "user", "content": f"what is {i} plus {i}?"},
                {"role": "assistant", "content": f"{2 * i}"},
            ]
            handle.write(json.dumps({"messages": messages}) + "\n")
    return folders


def _env(nproc: int, msl_args: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        MINDSPEED_LIKE_AUTOLOAD="1",
        MINDSPEED_LIKE_ARGS=msl_args,
        NPROC_PER_NODE=str(nproc),
        OMP_NUM_THREADS="1",
        TORCHDYNAMO_DISABLE=env.get("TORCHDYNAMO_DISABLE", "1"),
        MASTER_PORT=str(29500 + os.getpid() % 1000),
    )
    return env


def _megatron() -> str:
    return os.path.join(os.path.dirname(sys.executable), "megatron")


def _tail(text: str, lines: int = 25) -> str:
    """The workers' error lines (torchrun's own summary, at the very end, names none), then the end."""
    errors = [line for line in text.splitlines() if re.match(r"(\[rank\d+\]: )?\w+(Error|Exception): ", line)]
    return "\n".join(errors[:10] + ["..."] + text.splitlines()[-lines:])


def run_case(case: Case, assets: dict[str, str], root: str, done: dict[str, dict]) -> dict:
    out = os.path.join(root, "runs", case.name)
    command = [
        _megatron(), "sft", "--model", assets[case.model], "--model_type", case.model,
        "--template", "qwen3_nothinking", "--dataset", assets["data"], "--tuner_type", case.tuner,
        "--torch_dtype", case.dtype, "--train_iters", str(ITERS), "--micro_batch_size", "1",
        "--global_batch_size", "2", "--max_length", "128", "--logging_steps", "1",
        "--split_dataset_ratio", "0", "--save_safetensors", "true", "--ddp_backend", "gloo",
        "--dataloader_num_workers", "0", "--dataset_num_proc", "1", "--check_model", "false",
        "--add_version", "false", "--output_dir", out, *case.extra,
    ]  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)  # ms-swift appends to an existing run's logging.jsonl
    if case.resume_from:
        checkpoint = os.path.join(done[case.resume_from]["output_dir"], "checkpoint-2")
        command += ["--mcore_model", checkpoint, "--finetune", "false"]
    start = time.time()
    proc = subprocess.run(command, env=_env(case.nproc, case.msl_args), capture_output=True, text=True, check=False)
    log = proc.stdout + proc.stderr
    steps = []
    logging_jsonl = os.path.join(out, "logging.jsonl")
    if os.path.exists(logging_jsonl):
        with open(logging_jsonl, encoding="utf-8") as handle:
            steps = [json.loads(line) for line in handle if '"loss"' in line]
    result = {
        "case": dataclasses.asdict(case),
        "command": " ".join(command),
        "env": {
            "MINDSPEED_LIKE_AUTOLOAD": "1",
            "MINDSPEED_LIKE_ARGS": case.msl_args,
            "NPROC_PER_NODE": str(case.nproc),
        },
        "rc": proc.returncode,
        "wall_s": round(time.time() - start, 1),
        "output_dir": out,
        "iterations": [s.get("iteration") for s in steps],
        "loss": [s.get("loss") for s in steps],
        "grad_norm": [s.get("grad_norm") for s in steps],
        "memory_gib": [s.get("memory(GiB)") for s in steps],
        "checkpoints": sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "checkpoint-*"))),
        "nan_lines": [line.strip()[:200] for line in log.splitlines() if "NaN" in line or "nan" in line.split()][:5],
    }
    if case.expected_stop:
        result["expected_stop_seen"] = proc.returncode != 0 and re.search(case.expected_stop, log) is not None
    if proc.returncode != 0 or not steps:
        result["log_tail"] = _tail(log)
    return result


def run_export(assets: dict[str, str], root: str, done: dict[str, dict]) -> dict:
    """ms-swift's own HF export and logits check: the mcore checkpoint -> HF safetensors, loaded by
    transformers, logits of both on the same batch (in fp32, ms-swift's default test dtype)."""
    source = os.path.join(done[EXPORT_FROM]["output_dir"], f"checkpoint-{ITERS}")
    out = os.path.join(root, "runs", "export-hf")
    shutil.rmtree(out, ignore_errors=True)
    command = [
        _megatron(), "export", "--model", assets["qwen3"], "--model_type", "qwen3", "--template", "qwen3_nothinking",
        "--mcore_model", source, "--to_hf", "true",
        "--test_convert_precision", "true", "--torch_dtype", "bfloat16", "--output_dir", out,
        "--check_model", "false", "--ddp_backend", "gloo",
    ]  # fmt: skip
    start = time.time()
    proc = subprocess.run(command, env=_env(1, MSL_ARGS), capture_output=True, text=True, check=False)
    log = proc.stdout + proc.stderr
    found = re.search(r"mean_diff: ([0-9.e+-]+), max_diff: ([0-9.e+-]+)\n", log)
    with_loss = re.search(r"mean_diff \(with loss\): ([0-9.e+-]+), max_diff \(with loss\): ([0-9.e+-]+)", log)
    token_diff = re.search(r"token_diff: (\d+)", log)
    result = {
        "command": " ".join(command),
        "rc": proc.returncode,
        "wall_s": round(time.time() - start, 1),
        "exported": sorted(os.listdir(out)) if os.path.isdir(out) else [],
        "mean_diff": float(found.group(1)) if found else None,
        "max_diff": float(found.group(2)) if found else None,
        "mean_diff_with_loss": float(with_loss.group(1)) if with_loss else None,
        "max_diff_with_loss": float(with_loss.group(2)) if with_loss else None,
        "token_diff": int(token_diff.group(1)) if token_diff else None,
    }
    if os.path.exists(os.path.join(out, "config.json")):
        result["transformers_load"] = _load_in_transformers(out, assets["data"])
    # ms-swift's own comparison (megatron model vs the HF model it loads from the export, same batch):
    # within bf16's rounding of the largest logit, and the same argmax token everywhere
    scale = result.get("transformers_load", {}).get("max_abs_logit")
    result["tolerance"] = None if scale is None else BF16_EPS * scale
    result["matches"] = (
        result["max_diff"] is not None
        and result["tolerance"] is not None
        and result["max_diff"] <= result["tolerance"]
        and result["token_diff"] == 0
    )
    if proc.returncode != 0 or found is None:
        result["log_tail"] = _tail(log)
    return result


def _load_in_transformers(folder: str, data: str) -> dict:
    """The export as a user loads it: ``AutoModelForCausalLM.from_pretrained`` in fp32, one chat line's
    logits (finite? their size sets the comparison's bf16 tolerance)."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with open(data, encoding="utf-8") as handle:
        messages = json.loads(handle.readline())["messages"]
    ids = tokenizer.apply_chat_template(messages, return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    with torch.no_grad():
        logits = model(ids).logits
    return {
        "class": type(model).__name__,
        "tokens": int(ids.shape[-1]),
        "finite": bool(torch.isfinite(logits).all()),
        "max_abs_logit": float(logits.abs().max()),
    }


def check(name: str, result: dict, done: dict[str, dict]) -> dict:
    """This case against its reference: equal losses and grad norms within the precision's noise."""
    case = result["case"]
    if case["expected_stop"]:
        return {"expected_stop": case["expected_stop"], "stopped_as_expected": result["expected_stop_seen"]}
    verdict: dict[str, Any] = {
        "trained": result["rc"] == 0 and len(result["loss"]) >= (2 if case["resume_from"] else ITERS)
    }
    losses = [x for x in result["loss"] if x is not None]
    verdict["finite"] = bool(losses) and all(x == x and abs(x) != float("inf") for x in losses)
    reference = case["reference"]
    if reference and reference in done and done[reference]["loss"]:
        ref = done[reference]
        offset = len(ref["loss"]) - len(result["loss"]) if case["resume_from"] else 0
        pairs = list(zip(ref["loss"][offset:], result["loss"]))
        norms = list(zip(ref["grad_norm"][offset:], result["grad_norm"]))
        atol = FP32_LOSS_ATOL if case["dtype"] == "float32" else BF16_LOSS_ATOL
        loss_diff = max((abs(a - b) for a, b in pairs), default=None)
        norm_rdiff = max((abs(a - b) / abs(a) for a, b in norms if a), default=None)
        rtol = BF16_GRAD_NORM_RTOL if case["dtype"] != "float32" else 1e-4
        norms_equal = norm_rdiff is not None and norm_rdiff <= rtol
        verdict.update(
            reference=reference,
            max_loss_diff=loss_diff,
            max_grad_norm_rdiff=norm_rdiff,
            loss_atol=atol,
            grad_norm_rtol=rtol if case["grad_norm_compared"] else LORA_INIT,
            equal=loss_diff is not None and loss_diff <= atol and (norms_equal or not case["grad_norm_compared"]),
        )
    return verdict


def versions() -> dict[str, str]:
    found = {}
    for dist in ("torch", "megatron-core", "ms-swift", "mcore-bridge", "transformers", "peft", "mindspeed_like"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "absent"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True, help="working folder: models, data, run outputs")
    parser.add_argument("--record", required=True, help="the JSON record to write")
    parser.add_argument("--cases", nargs="*", help="case names (default: all); 'ci' for the CI-sized part")
    parser.add_argument("--no-export", action="store_true", help="skip megatron export's HF logits check")
    args = parser.parse_args(argv)
    wanted = CI_CASES if args.cases == ["ci"] else (args.cases or [c.name for c in CASES])
    unknown = sorted(set(wanted) - {c.name for c in CASES})
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {[c.name for c in CASES]}")
    os.makedirs(args.root, exist_ok=True)
    record: dict[str, Any] = {
        "what": "ms-swift megatron sft on a CPU host, unmodified, MINDSPEED_LIKE_AUTOLOAD=1 (issue 55 items 1, 3, 7)",
        "command": " ".join([sys.executable, "-m", "mindspeed_like.testing.ms_swift_smoke", *(argv or sys.argv[1:])]),
        "versions": versions(),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "load_at_start": os.getloadavg()[0]},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": {"common": COMMON, "moe": MOE},
        "iterations": ITERS,
        "cases": {},
    }
    assets = make_assets(args.root)
    done: dict[str, dict] = {}
    for case in CASES:
        if case.name not in wanted:
            continue
        if case.resume_from and case.resume_from not in done:
            record["cases"][case.name] = {"skipped": f"needs {case.resume_from}'s checkpoint, not run"}
            continue
        result = run_case(case, assets, args.root, done)
        done[case.name] = result
        result["check"] = check(case.name, result, done)
        record["cases"][case.name] = result
        print(
            f"== {case.name}: rc {result['rc']}, {result['wall_s']} s, loss {result['loss']}, "
            f"grad_norm {result['grad_norm']}, check {result['check']}",
            flush=True,
        )
        _write(args.record, record)
    if not args.no_export and EXPORT_FROM in done and done[EXPORT_FROM]["rc"] == 0:
        record["export"] = run_export(assets, args.root, done)
        print(f"== export: {record['export']}", flush=True)
    record["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    failed = [n for n, r in record["cases"].items() if "check" in r and not _passed(r)]
    if "export" in record and not record["export"]["matches"]:
        failed.append("export-hf")
    record["failed"] = failed
    _write(args.record, record)
    print(f"== ms-swift smoke: {len(record['cases']) - len(failed)} of {len(record['cases'])} passed; failed: {failed}")
    return 1 if failed else 0


def _passed(result: dict) -> bool:
    verdict = result["check"]
    if "stopped_as_expected" in verdict:
        return bool(verdict["stopped_as_expected"])
    return verdict["trained"] and verdict["finite"] and verdict.get("equal", True)


def _write(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=1, default=str)
        handle.write("\n")


if __name__ == "__main__":
    sys.exit(main())
