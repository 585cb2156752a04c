"""`mindspeed-like plan` as a user runs it: a 70B-shaped Megatron-LM command line answered from
arithmetic (no model, megatron.core never imported, under 5 s of CPU), compare's options, --json
with compare's metric names, and clear errors."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from mindspeed_like.plan import cli

LLAMA_70B = (
    "--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --group-query-attention --num-query-groups 8 "
    "--ffn-hidden-size 28672 --swiglu --normalization RMSNorm --position-embedding-type rope "
    "--untie-embeddings-and-output-weights --disable-bias-linear --seq-length 8192 --max-position-embeddings 8192 "
    "--vocab-size 128256 --bf16 --tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size 8 "
    "--use-distributed-optimizer --micro-batch-size 1 --global-batch-size 1024 --lr 3e-4 --train-iters 1000 "
    "--world-size 1024 --device-memory 80GiB"
).split()
METRICS = (
    "weights_bytes",
    "gradients_bytes",
    "optimizer_bytes",
    "model_state_bytes",
    "activations_bytes",
    "process_peak_bytes",
)

# run in a fresh interpreter with the built-in parser; report whether megatron.core was imported
_PROBE = """
import json, sys
from mindspeed_like.plan.cli import main
code = main(sys.argv[1:])
print(json.dumps({"megatron_core_imported": "megatron.core" in sys.modules}), file=sys.stderr)
sys.exit(code)
"""


def _run(args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)  # no Megatron-LM: the built-in parser
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, env=env, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return done, cpu


def test_70b_command_line_answers_fast_without_building_a_model() -> None:
    done, cpu = _run([*LLAMA_70B, "--parser", "builtin", "--json"])
    assert done.returncode == 0, done.stderr
    # CPU seconds of the whole process (interpreter, imports, plan), not wall time: the machine is shared
    assert cpu < 5.0, f"plan took {cpu:.2f} s of CPU for the 70B command line"
    probe = json.loads(done.stderr.strip().splitlines()[-1])
    assert probe == {"megatron_core_imported": False}
    result = json.loads(done.stdout)
    assert result["run"]["world_size"] == 1024 and len(result["per_rank"]) == 8
    for stage in result["per_rank"]:
        assert len(stage["ranks"]) == 128
        for arm in ("megatron", "features"):
            assert all(isinstance(stage[arm][m], int) and stage[arm][m] > 0 for m in METRICS)
    # stage 0 holds PP microbatches in flight (1F1B), the last stage one
    assert result["per_rank"][0]["microbatches_in_flight"] == {"0": 8}
    assert result["per_rank"][7]["microbatches_in_flight"] == {"0": 1}
    first = result["per_rank"][0]
    assert first["features"]["process_peak_bytes"] < first["megatron"]["process_peak_bytes"]
    # the model state of a 70B at TP 8 x PP 8 with the distributed optimizer over DP 16: ~1.1 B params a rank
    state = first["megatron"]["model_state_bytes"]
    assert 6 * 2**30 < state < 9 * 2**30, state


def test_compare_options_text_names_every_row(capsys) -> None:
    code = cli.main(
        [
            "--preset",
            "llama",
            "--num-layers",
            "2",
            "--hidden-size",
            "128",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "64",
            "--micro-batch-size",
            "1",
            "--optimization-level",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    for label in (
        "weights",
        "gradients",
        "optimizer state",
        "activations per layer",
        "process peak",
        "largest temporary",
    ):
        assert label in out
    assert "flash-attention" in out and "each feature's share" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-layer", "2"], "did you mean --num-layers"),
        (
            ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"],
            "--vocab-size",
        ),
        (["--preset", "llama", "--fit"], "--fit needs --device-memory"),
        (
            [
                "--num-layers",
                "2",
                "--hidden-size",
                "64",
                "--num-attention-heads",
                "4",
                "--seq-length",
                "32",
                "--vocab-size",
                "100",
                "--tensor-model-parallel-size",
                "3",
                "--world-size",
                "3",
            ],
            "divisible by TP 3",
        ),
    ],
)
def test_bad_input_is_a_clear_error(args: list[str], message: str, capsys) -> None:
    assert cli.main([*args, "--parser", "builtin"]) == 2
    assert message in capsys.readouterr().err


SMALL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 100".split()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("--num-layers 0", "--num-layers must be 1 or more, got 0"),
        ("--seq-length -1", "--seq-length must be 1 or more, got -1"),
        ("--tensor-model-parallel-size 0", "--tensor-model-parallel-size must be 1 or more, got 0"),
        ("--num-attention-heads 0", "--num-attention-heads must be 1 or more, got 0"),
        ("--fp16 --bf16", "--fp16 and --bf16 exclude each other"),
        ("--recompute-granularity full", "needs --recompute-method uniform or block"),
        ("--recompute-granularity full --recompute-method block", "--recompute-num-layers between 1 and"),
        ("--recompute-granularity full --recompute-method block --recompute-num-layers 3", "got 3"),
        ("--recompute-activations --recompute-method uniform", "--recompute-method is for --recompute-granularity"),
        # megatron builds these models and fails at the first forward (GQA reshape) or in the router
        ("--group-query-attention --num-query-groups 3", "must be a multiple of --num-query-groups 3"),
        ("--num-experts 4 --moe-router-topk 5", "--moe-router-topk 5 must be between 1 and --num-experts 4"),
        (
            "--num-experts 4 --ffn-hidden-size 256 --expert-tensor-parallel-size 3 --world-size 3",
            "must be divisible by expert TP 3",
        ),
        ("--optimizer muon --use-distributed-optimizer", "does not run with --use-distributed-optimizer"),
    ],
)
def test_what_megatron_would_refuse_later_is_refused_here(extra: str, message: str, capsys) -> None:
    assert cli.main([*SMALL, *extra.split(), "--parser", "builtin"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("--world-size 0", "--world-size: must be 1 or more"),
        ("--device-memory 0GiB", "more than 0 bytes"),
        ("--device-memory -80GiB", "argument --device-memory: not a memory size: '-80GiB'"),
        ("--num-layers abc", "argument --num-layers: invalid int value: 'abc'"),
        ("--position-embedding-type nope", "argument --position-embedding-type: invalid choice: 'nope'"),
    ],
)
def test_argument_errors_are_one_line(extra: str, message: str, capsys) -> None:
    """A bad value is one line naming the option (argparse would print its whole usage first)."""
    assert cli.main([*SMALL, *extra.split(), "--parser", "builtin"]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and err.startswith("mindspeed-like plan: argument "), err


def test_memory_sizes() -> None:
    assert cli.memory_size("80GiB") == 80 * 2**30
    assert cli.memory_size("80GB") == 80 * 10**9
    assert cli.memory_size("1.5GiB") == 3 * 2**29
    with pytest.raises(Exception, match="not a memory size"):
        cli.memory_size("80 parsecs")


def test_fit_prints_a_command_line_or_what_is_short(capsys) -> None:
    base = [
        "--preset",
        "llama",
        "--num-layers",
        "2",
        "--hidden-size",
        "128",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "256",
        "--micro-batch-size",
        "1",
        "--target-device",
        "cuda",
    ]
    assert cli.main([*base, "--fit", "--device-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "recommended: mindspeed-like compare --preset llama" in out and "--optimization-level" in out
    assert cli.main([*base, "--fit", "--device-memory", "1MiB"]) == cli.NOTHING_FITS == 1
    out = capsys.readouterr().out
    assert "nothing fits" in out and "more than the device" in out


def test_megatron_is_imported_without_compiling_only_in_plans_own_process(monkeypatch) -> None:
    """plan's CLI imports Megatron-LM's parser with torch.compile handing functions back unchanged
    (megatron-core compiles its fused ops at import: ~2 s of the import). Only in plan's own process:
    an in-process call (argv given) must not leave megatron's fused ops uncompiled for the caller."""
    import torch

    from mindspeed_like.plan import megatron_args

    compile_ = torch.compile
    with megatron_args._compile_left_for_later():

        def fused(x):
            return x

        assert torch.compile(fused) is fused and torch.compile(mode="max-autotune")(fused) is fused
    assert torch.compile is compile_
    seen = {}

    def parse(argv, world_size, parse_only_process=False, device="cuda"):
        seen["parse_only_process"] = parse_only_process
        raise ImportError("megatron.training")

    monkeypatch.setattr(megatron_args, "parse_with_megatron_lm", parse)
    tiny = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --vocab-size 128".split()
    assert cli.main(tiny) == 0
    assert seen == {"parse_only_process": False}
    assert cli.main(tiny, own_process=True) == 0
    assert seen == {"parse_only_process": True}


def test_cpu_hosts_count_the_experts_gemm_kernels(monkeypatch) -> None:
    """oneDNN keeps a kernel per bf16 GEMM shape on a CPU host: the plan counts the experts' shapes
    (bucketed by the grouped GEMM, exact in megatron's own SequentialMLP), nothing for a dense model,
    an accelerator, fp32, or a CPU without bf16 units; a long run meets every bucket in the range."""
    import argparse

    from mindspeed_like.kernels import grouped_gemm
    from mindspeed_like.plan import host_kernels
    from mindspeed_like.plan.cli import read_run

    monkeypatch.setattr(grouped_gemm, "cpu_has_bf16_gemm", lambda: True)

    def run(preset: str, device: str = "cpu", *extra: str):
        size = "--steps 3 --num-layers 2 --hidden-size 256 --seq-length 512 --micro-batch-size 2".split()
        return read_run(["--preset", preset, *size, *extra], argparse.Namespace(target_device=device))[0]

    moe = run("qwen3-moe")
    grouped = host_kernels.kernel_bytes(moe, 0, grouped=True)
    # 2 MoE layers x 8 experts x 3 steps = 48 counts of mean 256: 22.8 expected buckets, 6 GEMMs each
    assert grouped == int(host_kernels.KERNEL_BYTES * 6 * host_kernels.distinct_counts(256, 48, True))
    assert 20 < host_kernels.distinct_counts(256, 48, True) < 26
    assert host_kernels.kernel_bytes(moe, 0, grouped=False) > grouped  # every exact count its own kernel
    assert host_kernels.kernel_bytes(run("llama"), 0, grouped=True) == 0
    assert host_kernels.kernel_bytes(run("qwen3-moe", device="cuda"), 0, grouped=True) == 0
    assert host_kernels.kernel_bytes(run("qwen3-moe", "cpu", "--fp32"), 0, grouped=True) == 0
    assert host_kernels.distinct_counts(256, None, True) == len({min(896, b) for b in map(_bucket, range(1, 897))})
    assert host_kernels.distinct_counts(256, 10**6, True) > 0.99 * host_kernels.distinct_counts(256, None, True)
    assert host_kernels.distinct_counts(0, 48, True) == 0
    monkeypatch.setattr(grouped_gemm, "cpu_has_bf16_gemm", lambda: False)
    assert host_kernels.kernel_bytes(moe, 0, grouped=True) == 0


def _bucket(count: int) -> int:
    from mindspeed_like.kernels.row_buckets import bucket

    return bucket(count)


def test_the_model_build_is_a_phase_of_its_own_on_cpu_hosts() -> None:
    """compare's workers initialise in fp32 (two models at once where weights are copied across
    specs: the TE spec, grouped-gemm's experts) and hand the freed pages back before training
    (compare/worker.py), so the peak is the build's or training's, whichever is larger, never both;
    Megatron-LM (built in the parameter dtype) and an accelerator have no build phase."""
    import argparse

    from mindspeed_like.plan import peak
    from mindspeed_like.plan.cli import read_run
    from mindspeed_like.plan.params import stage
    from mindspeed_like.plan.paths import megatron_paths

    def run(*extra: str, device: str = "cpu"):
        size = "--num-layers 2 --hidden-size 128 --seq-length 64 --micro-batch-size 1".split()
        return read_run([*size, *extra], argparse.Namespace(target_device=device, parser="builtin", world_size=None))[0]

    def params_of(r) -> int:
        return sum(p.numel for chunk in stage(r, 0) for p in chunk)

    paths = megatron_paths()
    te = run("--preset", "llama", "--transformer-impl", "transformer_engine")
    local = run("--preset", "llama", "--transformer-impl", "local")
    assert peak.build_bytes(te, paths) == 8 * params_of(te)
    assert peak.build_bytes(local, paths) == 4 * params_of(local)
    assert peak.build_bytes(run("--preset", "llama", device="cuda"), paths) == 0
    mlm = run("--vocab-size", "128", "--num-attention-heads", "4", "--bf16")
    assert mlm.source != "compare" and peak.build_bytes(mlm, paths) == 0

    def at(build: int) -> peak.Peak:
        return peak.Peak(runtime=7, build=build, model_state=100, activations=30, temporary=5,
                         temporary_what="x", optimizer_temporary=20, kernels=3)  # fmt: skip

    assert at(50).total == 7 + 3 + 100 + 35 and at(50).phase == "forward/backward"
    assert at(500).total == 7 + 3 + 500 and at(500).phase == "model build"


def test_host_allocator_on_a_cpu_host_is_said_to_be_outside_the_figures(capsys) -> None:
    """glibc's retained heap is not a tensor row: with host-allocator on a CPU host the plan says so
    (and how to trade it back); on a device, where the feature stands aside, nothing is said."""
    tiny = "--preset llama --num-layers 2 --hidden-size 128 --seq-length 64 --optimization-level 1".split()
    assert cli.main([*tiny, "--target-device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert cli.HOST_ALLOCATOR_NOTE in out and cli.CPU_HEAP_NOTE in out
    assert cli.main([*tiny, "--target-device", "cpu", "--no-tune-host-allocator"]) == 0
    out = capsys.readouterr().out
    assert cli.HOST_ALLOCATOR_NOTE not in out and cli.CPU_HEAP_NOTE in out  # step 1's figures either way
    assert cli.main([*tiny, "--target-device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert cli.HOST_ALLOCATOR_NOTE not in out and cli.CPU_HEAP_NOTE not in out


@pytest.mark.parametrize(
    "extra",
    [
        # each offloads or re-sizes what the plan counts: a silent plan would be wrong (the FSDP paths are
        # modeled: tests/plan/test_plan_fsdp.py)
        "--attention-backend unfused",
        "--fp8-format hybrid",
        "--cpu-offloading-num-layers 1",
    ],
)
def test_options_that_change_memory_unmodeled_are_said(extra: str, capsys) -> None:
    common = "--lr 1e-4 --train-iters 10 --seed 3 --log-interval 1".split()
    assert cli.main([*SMALL, *common, *extra.split(), "--parser", "builtin", "--json"]) == 0
    said = json.loads(capsys.readouterr().out)["not_modeled"]
    assert said == [extra.split()[0]]  # and nothing of --lr, --train-iters, --seed, --log-interval


def test_fit_says_each_choice_as_a_command_line_would(capsys) -> None:
    """No recomputation is the option left out ("no --recompute-granularity"), not "None"."""
    argv = [*SMALL, "--seq-length", "1024", "--max-position-embeddings", "1024", "--bf16", "--micro-batch-size", "1"]
    assert cli.main([*argv, "--fit", "--device-memory", "1GiB", "--parser", "builtin"]) == 0
    why = capsys.readouterr().out.split("why:")[1]
    assert "None" not in why
    assert "no --recompute-granularity (peak" in why and "instead full: fits" in why


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # our flags in a plan's command line are the plan's: a wrong value is an error, not the default level
        ("--optimization-level 3", "--optimization-level: invalid choice: 3"),
        (
            "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
            "--num-virtual-stages-per-pipeline-rank 2 --global-batch-size 4",
            "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank exclude each other",
        ),
        ("--train-iters 10 --rampup-batch-size 16 16 100", "--rampup-batch-size is for sample-based training"),
        ("--expert-model-parallel-size 2", "--expert-model-parallel-size 2 needs --num-experts"),
        (
            "--num-experts 8 --expert-model-parallel-size 8 --pipeline-model-parallel-size 2",
            "give --world-size as a multiple of 16",
        ),
    ],
)
def test_refusals_name_the_options_and_the_fix(extra: str, message: str, capsys) -> None:
    assert cli.main([*SMALL, *extra.split(), "--parser", "builtin"]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("mindspeed-like plan: ") and "plan: plan:" not in err


def test_a_device_memory_without_its_unit_is_refused(capsys) -> None:
    assert cli.main([*SMALL, "--device-memory", "80", "--parser", "builtin"]) == 2
    assert "'80' would be 80 bytes: give a unit (e.g. 80GiB or 80GB)" in capsys.readouterr().err


def test_world_size_with_compares_options_points_to_their_layout(capsys) -> None:
    assert cli.main(["--preset", "llama", "--num-layers", "2", "--world-size", "4"]) == 2
    assert "--world-size is for a Megatron-LM command line" in capsys.readouterr().err


def test_the_learned_position_table_has_max_position_embeddings_rows(capsys) -> None:
    """GPTModel's position table is --max-position-embeddings rows (not --seq-length); without the
    option (Megatron-LM refuses that) the plan takes the sequence length and says so."""
    gpt = [*SMALL, "--parser", "builtin", "--json"]  # LayerNorm, learned positions: Megatron-LM's defaults

    def weights(*extra: str) -> tuple[int, list[str]]:
        assert cli.main([*gpt, *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        return out["per_rank"][0]["megatron"]["weights_bytes"], out["notes"]

    short, notes = weights()
    assert any("no --max-position-embeddings: taken as --seq-length (32)" in n for n in notes)
    same, notes = weights("--max-position-embeddings", "32")
    assert same == short and not any("max-position" in n for n in notes)
    longer, _ = weights("--max-position-embeddings", "96")
    assert longer - short == (96 - 32) * 64 * 4  # fp32 rows of hidden 64


def test_fits_command_line_is_quoted_for_a_shell(capsys) -> None:
    import shlex

    moe = [*SMALL, "--num-experts", "4", "--moe-layer-freq", "([0]+[1]*1)", "--world-size", "4"]
    assert cli.main([*moe, "--fit", "--device-memory", "80GiB", "--parser", "builtin"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("recommended: "))
    tokens = shlex.split(line.split(") ", 1)[1])  # after "pretrain_gpt.py (with `import ...`)"
    assert tokens[tokens.index("--moe-layer-freq") + 1] == "([0]+[1]*1)"


def test_megatron_lms_missing_argument_refusal_names_the_option() -> None:
    from mindspeed_like.plan.megatron_args import _refusal

    error = AssertionError("max_position_embeddings argument is None")  # _check_arg_is_not_none's words
    assert _refusal(error) == "--max-position-embeddings is required: give it"


def test_fits_recommendation_plans_to_the_peak_it_promised(capsys) -> None:
    """--fit tries other TP sizes; megatron pads the vocabulary to a multiple of 128 x TP, so each
    TP's embedding and output layer have their own rows (GPT-3 175B at TP 8 -> TP 2: 51,200 rows
    become 50,432, 31-36 MiB on the first and last stage)."""
    gpt3 = (
        "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048 "
        "--micro-batch-size 1 --global-batch-size 1536 --fp16 --tensor-model-parallel-size 8 "
        "--pipeline-model-parallel-size 16 --tokenizer-type NullTokenizer --vocab-size 50257 --parser builtin"
    ).split()
    assert cli.main([*gpt3, "--fit", "--device-memory", "80GiB", "--world-size", "128", "--json"]) == 0
    fitted = json.loads(capsys.readouterr().out)["fit"]
    recommended = fitted["command"].split("`import mindspeed_like.megatron_adaptor`) ", 1)[1].split()
    assert "--tensor-model-parallel-size" in recommended
    assert recommended[recommended.index("--tensor-model-parallel-size") + 1] != "8", "the case must change TP"
    assert cli.main([*recommended, "--parser", "builtin", "--world-size", "128", "--json"]) == 0
    replanned = json.loads(capsys.readouterr().out)
    peaks = [stage["features"]["process_peak_bytes"] for stage in replanned["per_rank"]]
    assert peaks == fitted["peak_per_stage_bytes"]


def _optimizer_bytes(extra: list[str], capsys) -> tuple[int, dict]:
    base = (
        "--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 "
        "--micro-batch-size 1 --bf16 --tokenizer-type NullTokenizer --vocab-size 1000 --parser builtin "
        "--optimization-level 0 --json"
    ).split()
    assert cli.main([*base, *extra]) == 0
    out = json.loads(capsys.readouterr().out)
    return out["per_rank"][0]["megatron"]["optimizer_bytes"], out


def test_sgd_keeps_one_momentum_buffer_and_muon_is_counted_once_as_adam(capsys) -> None:
    """torch's SGD (megatron's without TE/Apex) holds an fp32 momentum buffer beside each fp32 master
    (none at --sgd-momentum 0); Adam holds two moments and a step counter per tensor. Muon is not
    modeled: counted as Adam's, once, and the output says so."""
    adam, out = _optimizer_bytes([], capsys)
    params = out["per_rank"][0]["megatron"]["weights_bytes"] // 2  # bf16 weights
    sgd, _ = _optimizer_bytes(["--optimizer", "sgd"], capsys)
    assert sgd == 8 * params  # fp32 master + momentum
    no_momentum, _ = _optimizer_bytes(["--optimizer", "sgd", "--sgd-momentum", "0"], capsys)
    assert no_momentum == 4 * params
    assert 0 < adam - 12 * params <= 4 * 64  # Adam: master + two moments, and one fp32 step counter a tensor
    muon, out = _optimizer_bytes(["--optimizer", "muon"], capsys)
    assert muon == adam
    assert any("--optimizer muon" in note and "upper bound" in note for note in out["notes"])


def test_the_output_says_which_parser_read_the_arguments_and_why(monkeypatch, capsys) -> None:
    """With Megatron-LM on the path but not importable (a missing dependency), --parser auto falls back
    to the built-in parser and says why; --parser megatron-lm names the real cause."""
    import builtins

    real_import = builtins.__import__

    def broken(name, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if name.startswith("megatron.training"):
            raise ModuleNotFoundError("No module named 'six'", name="six")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken)
    assert cli.main([*SMALL, "--tokenizer-type", "NullTokenizer"]) == 0
    out = capsys.readouterr().out
    assert "arguments read by: the built-in parser" in out
    assert "Megatron-LM's parser not used, importing megatron.training failed: No module named 'six'" in out
    assert cli.main([*SMALL, "--tokenizer-type", "NullTokenizer", "--parser", "megatron-lm"]) == 2
    assert "importing megatron.training failed: No module named 'six'" in capsys.readouterr().err


def test_the_device_memory_is_said_as_given(capsys) -> None:
    assert cli.main([*SMALL, "--parser", "builtin", "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "device memory (--device-memory 80GB: decimal)" in out and "of 74.51 GiB" in out
    assert "FP32 optimizer (no optimizer sharding)" in out  # neither --bf16 nor --fp16


_LOCAL = (
    "--num-layers 3 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 512 "
    "--micro-batch-size 2 --global-batch-size 2 --vocab-size 1000 --tokenizer-type NullTokenizer --bf16 "
    "--transformer-impl local --target-device cpu --parser builtin --optimization-level 0 --json"
).split()
_SWIGLU = "--swiglu --disable-bias-linear --normalization RMSNorm --position-embedding-type rope".split()


def _activations(extra: list[str], capsys) -> int:
    assert cli.main([*_LOCAL, *extra]) == 0
    return json.loads(capsys.readouterr().out)["per_rank"][0]["megatron"]["activations_bytes"]


def test_megatron_lms_defaults_that_compares_models_lack(capsys) -> None:
    """Against Megatron-LM's own GPT built on the CPU (docs/plan.md): its default --bias-swiglu-fusion
    keeps fc1's output only (the unfused GLU two more [t, ffn] tensors); its dataloader's mask is one
    b x s x s bool tensor every layer's softmax keeps (without it each layer makes its own s x s)."""
    b, s, t, ffn, layers = 2, 256, 2 * 256, 640, 3  # --swiglu's ffn: 4h x 2/3 down to a multiple of 64
    from mindspeed_like.plan import megatron_code

    halves = 2 if megatron_code.glu_copies_linear_half() else 1  # 0.13: x2 is a view of fc1's output
    masks = 1 if megatron_code.caches_causal_mask() else layers  # 0.13 caches one causal mask
    fused = _activations(_SWIGLU, capsys)
    assert _activations([*_SWIGLU, "--no-bias-swiglu-fusion"], capsys) - fused == layers * halves * 2 * t * ffn
    own_masks = _activations([*_SWIGLU, "--no-create-attention-mask-in-dataloader"], capsys)
    assert own_masks - fused == masks * s * s - b * s * s


def test_selective_recompute_drops_the_attention_internals_only(capsys) -> None:
    """core_attn recompute keeps the core attention's inputs (rotated q and k, the qkv output v is a
    view of), which the rows already hold: what goes is the s x s softmax output (bf16, b x heads x
    s x s) of every layer."""
    b, s, heads, layers = 2, 256, 4, 3
    no_dropout = [*_SWIGLU, "--attention-dropout", "0", "--hidden-dropout", "0"]  # else its s x s rows go too
    whole = _activations(no_dropout, capsys)
    selective = _activations([*no_dropout, "--recompute-granularity", "selective"], capsys)
    assert whole - selective == layers * 2 * b * heads * s * s


def test_the_embedding_and_the_loss_can_count_as_layers_of_the_pipeline_split(capsys) -> None:
    """--account-for-embedding/loss-in-pipeline-split (megatron's get_num_layers_to_build): 6 layers +
    the embedding + the loss over PP 4 are 2 a stage, so the first and the last build one layer each."""
    command = (
        "--num-layers 6 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 "
        "--micro-batch-size 1 --global-batch-size 8 --vocab-size 1000 --tokenizer-type NullTokenizer --bf16 "
        "--pipeline-model-parallel-size 4 --world-size 4 --parser builtin"
    ).split()
    both = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    assert cli.main([*command, *both, "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["per_rank"]
    assert [s["layers"] for s in stages] == [[[0]], [[1, 2]], [[3, 4]], [[5]]]
    assert cli.main([*command, both[0]]) == 2  # 7 does not divide over 4 stages
    assert "with the embedding counted as a layer" in capsys.readouterr().err


def test_a_pipeline_layout_places_the_layers_it_lists(capsys) -> None:
    """--pipeline-model-parallel-layout "Et*3|t|t*3|tL" at PP 2: stage k is rank k % 2's chunk k // 2
    and layers are numbered in stage order (megatron's PipelineParallelLayerLayout); a layout that
    does not list --num-layers decoder layers, or lacks the loss, is refused."""
    command = (
        "--num-layers 8 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 "
        "--micro-batch-size 1 --global-batch-size 8 --vocab-size 1000 --tokenizer-type NullTokenizer --bf16 "
        "--pipeline-model-parallel-size 2 --world-size 2 --parser builtin --pipeline-model-parallel-layout"
    ).split()
    assert cli.main([*command, "Et*3|t|t*3|tL", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["layers"] for s in out["per_rank"]] == [[[0, 1, 2], [4, 5, 6]], [[3], [7]]]
    assert out["not_modeled"] == []
    assert cli.main([*command, "Et*3|t|t*2|tL"]) == 2
    assert "has 7 decoder layers ('t'), --num-layers is 8" in capsys.readouterr().err
    assert cli.main([*command, "Et*3|t|t*3|t"]) == 2
    assert "needs one 'L'" in capsys.readouterr().err


def test_the_shared_experts_gate_has_its_weight_and_saves(capsys) -> None:
    """--moe-shared-expert-gate: one [1, h] weight a MoE layer (megatron's SharedExpertMLP.gate_weight),
    and output * sigmoid(score) keeps the shared experts' output and the [t, 1] score."""
    command = (
        "--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 "
        "--micro-batch-size 1 --global-batch-size 1 --vocab-size 1000 --tokenizer-type NullTokenizer --bf16 --swiglu "
        "--num-experts 4 --moe-shared-expert-intermediate-size 256 --parser builtin --optimization-level 0 --json"
    ).split()
    rows = []
    for gate in ([], ["--moe-shared-expert-gate"]):
        assert cli.main([*command, *gate]) == 0
        rows.append(json.loads(capsys.readouterr().out)["per_rank"][0]["megatron"])
    assert rows[1]["weights_bytes"] - rows[0]["weights_bytes"] == 2 * 2 * 256  # bf16, 2 MoE layers
    assert rows[1]["activations_bytes"] - rows[0]["activations_bytes"] == 2 * 2 * 256 * (256 + 1)
