"""A Megatron-LM command line (what a user passes to pretrain_gpt.py) read into a :class:`Run`.

Two parsers give the same namespace (Megatron-LM's ``dest`` names):

- Megatron-LM's own (``parse_args`` + ``validate_args``) when ``megatron.training`` is importable
  (``--parser megatron-lm``, or ``auto`` there): its defaults and derived values exactly, its
  errors. Importing it costs ~7 s of CPU (megatron.core and torch).
- The built-in one: the options below with Megatron-LM 0.16's names and defaults (a test checks
  them against Megatron-LM's parser where it is installed) and the derived values
  ``validate_args`` computes (ffn 4h or SwiGLU's 8h/3 rounded down to 64, kv_channels, query
  groups, the padded vocabulary, virtual stages, data parallel size, fp32 gradient accumulation
  for bf16). It imports neither megatron nor torch. Any other Megatron-LM option is accepted and
  listed as not modeled unless it cannot change memory (learning rate, data, logging, ...); an
  option Megatron-LM does not have is an error with a suggestion.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import re
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from mindspeed_like.plan.spec import Layout, Model, Precision, Recompute, Run, moe_pattern, pad_vocab
from mindspeed_like.plan.tokenizer_vocab import tokenizer_vocab
from mindspeed_like.toolkit.errors import ConfigError

_DTYPES = ("fp32", "bf16", "fp16", "fp8")
FSDP_MAIN_DTYPES = ("fp32", "bf16", "fp16", "auto")
"""Megatron-LM's choices of --megatron-fsdp-main-params-dtype / --megatron-fsdp-main-grads-dtype (``auto``: None)."""
NEWER_OPTIONS = {"--megatron-fsdp-main-params-dtype": "0.17", "--megatron-fsdp-main-grads-dtype": "0.17"}
"""Options of the built-in parser that Megatron-LM has only from a later release than 0.16 (the release)."""


def _freq(text: str) -> int | list[int]:
    """Megatron-LM's ``moe_freq_type``: an int, or a Python list expression such as ``([0]*3+[1]*58)``."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = _eval_list(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError) as error:
        raise argparse.ArgumentTypeError(f"not an int or a list expression such as ([0]+[1]*23): {text!r}") from error
    return value


def _eval_list(node: ast.AST) -> list[int]:
    """Lists of ints, ``+`` and ``* int`` only (what Megatron-LM's examples write); no eval()."""
    if isinstance(node, ast.List):
        return [int(ast.literal_eval(e)) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _eval_list(node.left) + _eval_list(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        if isinstance(node.right, ast.Constant):
            return _eval_list(node.left) * int(node.right.value)
        return _eval_list(node.right) * int(ast.literal_eval(node.left))
    raise ValueError("unsupported expression")


def add_megatron_options(parser: argparse.ArgumentParser) -> None:
    """The Megatron-LM options the memory and time models read, with Megatron-LM 0.16's defaults."""
    g = parser.add_argument_group("Megatron-LM model and layout (its names and defaults)")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        g.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    for name in (
        "ffn_hidden_size",
        "kv_channels",
        "max_position_embeddings",
        "micro_batch_size",
        "global_batch_size",
        "vocab_size",
        "padded_vocab_size",
        "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size",
        "moe_router_num_groups",
        "moe_router_group_topk",
        "q_lora_rank",
        "mtp_num_layers",
        "num_experts",
        "num_layers_per_virtual_pipeline_stage",
        "num_virtual_stages_per_pipeline_rank",
        "decoder_first_pipeline_num_layers",
        "decoder_last_pipeline_num_layers",
        "expert_tensor_parallel_size",
        "recompute_num_layers",
    ):
        g.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-layout", default=None)
    g.add_argument("--moe-shared-expert-gate", action="store_true")
    g.add_argument(
        "--microbatch-group-size-per-virtual-pipeline-stage",
        type=int,
        default=None,
        dest="microbatch_group_size_per_vp_stage",
    )
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    # what the tokenizer's vocabulary is read from (plan/tokenizer_vocab.py)
    g.add_argument("--tokenizer-type", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--normalization", default="LayerNorm", choices=("LayerNorm", "RMSNorm"))
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument(
        "--position-embedding-type",
        default="learned_absolute",
        choices=("learned_absolute", "rope", "mrope", "relative", "none"),
    )
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-layer-freq", type=_freq, default=1)
    g.add_argument("--moe-grouped-gemm", action="store_true")
    g.add_argument("--moe-router-dtype", default=None, choices=("fp32", "fp64"))
    g.add_argument("--moe-router-score-function", default="softmax", choices=("softmax", "sigmoid"))
    g.add_argument("--moe-router-enable-expert-bias", action="store_true")
    g.add_argument("--moe-router-load-balancing-type", nargs="+", default="aux_loss")
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0)
    g.add_argument("--moe-token-dispatcher-type", default="allgather", choices=("allgather", "alltoall", "flex"))
    g.add_argument("--multi-latent-attention", action="store_true")
    g.add_argument("--kv-lora-rank", type=int, default=32)
    g.add_argument("--qk-head-dim", type=int, default=128)
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64)
    g.add_argument("--v-head-dim", type=int, default=128)
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--grad-reduce-in-bf16", action="store_true")
    g.add_argument("--use-precision-aware-optimizer", action="store_true")
    g.add_argument("--main-grads-dtype", default="fp32", choices=("fp32", "bf16"))
    g.add_argument("--main-params-dtype", default="fp32", choices=("fp32", "fp16"))
    g.add_argument("--exp-avg-dtype", default="fp32", choices=_DTYPES)
    g.add_argument("--exp-avg-sq-dtype", default="fp32", choices=_DTYPES)
    g.add_argument("--optimizer", default="adam", choices=("adam", "sgd", "muon", "dist_muon"))
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion")
    g.add_argument(
        "--no-create-attention-mask-in-dataloader", action="store_false", dest="create_attention_mask_in_dataloader"
    )
    g.add_argument("--recompute-activations", action="store_true")
    g.add_argument("--recompute-granularity", default=None, choices=("full", "selective"))
    g.add_argument("--recompute-method", default=None, choices=("uniform", "block"))
    g.add_argument("--recompute-modules", nargs="+", default=None)
    g.add_argument(
        "--transformer-impl",
        default="transformer_engine",
        choices=("local", "transformer_engine", "inference_optimized"),
    )
    g.add_argument("--overlap-grad-reduce", action="store_true")
    # megatron's sharded data-parallel wrappers (plan/fsdp.py models both); --ckpt-format because
    # Megatron-LM ties each path to one
    g.add_argument("--use-torch-fsdp2", action="store_true")
    g.add_argument(
        "--torch-fsdp2-no-reshard-after-forward", action="store_false", dest="torch_fsdp2_reshard_after_forward"
    )
    g.add_argument("--use-megatron-fsdp", action="store_true")
    g.add_argument(
        "--data-parallel-sharding-strategy",
        default="no_shard",
        choices=("no_shard", "optim", "optim_grads", "optim_grads_params"),
    )
    # Megatron-FSDP's hybrid sharding (HSDP); under DDP the distributed optimizer's instances (not modeled there)
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1)
    g.add_argument("--outer-dp-sharding-strategy", default="no_shard", choices=("no_shard", "optim"))
    # Megatron-FSDP's buffer dtypes (Megatron-LM 0.17+'s options: NEWER_OPTIONS; plan/fsdp.py models them)
    g.add_argument("--clip-grad", type=float, default=1.0)  # Megatron-FSDP's buffer dtypes are refused with it
    g.add_argument("--megatron-fsdp-main-params-dtype", default="fp32", choices=FSDP_MAIN_DTYPES)
    g.add_argument("--megatron-fsdp-main-grads-dtype", default="auto", choices=FSDP_MAIN_DTYPES)
    g.add_argument("--ckpt-format", default="torch_dist")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion")


# Megatron-LM options that cannot change what a rank holds in memory: accepted without a note.
NO_MEMORY_EFFECT_PREFIXES = (
    "--lr",
    "--min-lr",
    "--train-",
    "--eval-",
    "--data-",
    "--split",
    "--log",
    "--save",
    "--load",
    "--tensorboard",
    "--wandb",
    "--tokenizer",
    "--vocab-file",
    "--merge-file",
    "--seed",
    "--clip-grad",
    "--weight-decay",
    "--adam-",
    "--init-method",
    "--exit-",
    "--timing",
    "--use-mcore-models",
    "--no-masked-softmax-fusion",
    "--no-bias-",
    "--decoupled-",
    "--no-mmap-bin-files",
    "--no-rope-fusion",
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
    "--rotary-",
    "--norm-epsilon",
    "--distributed-backend",
    "--distributed-timeout",
    "--ckpt-",
    "--dist-ckpt",
    "--no-load",
    "--no-save",
    "--finetune",
    "--num-workers",
    "--mock-data",
    "--use-flash-attn",
    "--no-async-tensor-model-parallel-allreduce",
    "--moe-router-bias-update-rate",
    "--moe-router-topk-scaling-factor",
    "--moe-router-pre-softmax",
    "--mscale",
    "--rope-type",
    "--kv-channels",
    "--manual-gc",
    "--profile",
    "--overlap-param-gather",
    "--moe-z-loss-coeff",
    "--mtp-loss-scaling-factor",
    "--no-check-for-nan",
    "--check-for-nan",
    "--micro-batch-size",
    "--cross-entropy-loss-fusion",
    "--apply-layernorm-1p",
    "--use-rotary-position-embeddings",
    "--rotary-base",
    "--moe-router-group-topk",
    "--moe-permute-fusion",
    "--moe-router-fusion",
    "--dataloader-",
    "--calculate-per-token-loss",
    "--bias-",
    "--loss-scale",
    "--initial-loss-scale",
    "--min-loss-scale",
    "--hysteresis",
    "--no-position-embedding",
    "--sequence-parallel",
    "--recompute-",
)


def build_parser() -> argparse.ArgumentParser:
    from mindspeed_like.plan.arg_errors import OneLineParser

    parser = OneLineParser(add_help=False, allow_abbrev=False)
    add_megatron_options(parser)
    return parser


def parse_builtin(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The options above from ``argv``; returns the namespace and the Megatron-LM options given
    that the model does not read (ours and plan's own are left to their parsers: ``known`` names
    them). An option neither Megatron-LM nor anyone else knows is a ConfigError."""
    namespace, rest = build_parser().parse_known_args(list(argv))
    return namespace, rest


def classify_unknown(rest: Sequence[str], known_elsewhere: set[str]) -> list[str]:
    """The Megatron-LM options in ``rest`` that the model does not read (for the "not modeled"
    line); raises for an option nobody defines, with Megatron-LM's or our nearest names."""
    from mindspeed_like.toolkit.megatron_lm_options import MEGATRON_LM_OPTIONS

    not_modeled = []
    for token in rest:
        if not token.startswith("--"):
            continue
        option = token.split("=", 1)[0]
        if option in known_elsewhere:
            continue
        if option not in MEGATRON_LM_OPTIONS:
            close = difflib.get_close_matches(option, sorted(MEGATRON_LM_OPTIONS | known_elsewhere), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"plan: unknown option {option} (neither Megatron-LM's nor mindspeed_like's){hint}")
        if not option.startswith(NO_MEMORY_EFFECT_PREFIXES):
            not_modeled.append(option)
    return not_modeled


@contextlib.contextmanager
def import_notices_kept_out() -> Iterator[None]:
    """megatron's notices that say nothing of the run planned, kept out of a plan's output: an
    optional package missing at import (Transformer Engine, Apex, absl: "falling back to ..."), and
    megatron-core 0.16's TransformerConfig default itself ("full scope is deprecated", at every
    config built). A plan imports megatron for its parser or config checks only."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*(Transformer Engine|Apex|absl)[^\n]*not installed", category=UserWarning
        )
        warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)
        yield


@contextlib.contextmanager
def _compile_left_for_later() -> Iterator[None]:
    """``torch.compile`` hands its function back unchanged while this block imports megatron.

    megatron-core decorates its fused ops at import time (``megatron/core/jit.py``: ``jit_fuser =
    torch.compile``), which imports dynamo and inductor: ~2 of the ~5 s that importing
    ``megatron.training.arguments`` takes on this 2-core host (3.2 s without). Only for a process that
    parses and exits (plan's own): in any other the decorated functions would stay uncompiled."""
    import torch

    def undecorated(model=None, **options):
        return model if model is not None else (lambda function: function)

    compile_ = torch.compile
    torch.compile = undecorated
    try:
        yield
    finally:
        torch.compile = compile_


def parse_with_megatron_lm(
    argv: Sequence[str], world_size: int, parse_only_process: bool = False, device: str = "cuda"
) -> tuple[argparse.Namespace, str | None]:
    """Megatron-LM's own ``parse_args`` and ``validate_args`` on ``argv`` (unknown options, ours
    included, ignored by it), for a world of ``world_size`` ranks. Raises ImportError where
    megatron.training is not importable. ``validate_args`` asks CUDA for the GPU's architecture (TP
    or CP above 1, grouped GEMM): for a CUDA target on a host without one it is answered as the
    plan's device model, a Hopper GPU (:func:`_hopper_answered`), so every later check still runs;
    where it needs the device otherwise, the namespace is Megatron-LM's parsed one with the built-in
    derivations, and the second value says so. ``parse_only_process``: this process only parses
    (plan's CLI), so megatron is imported without compiling its fused ops."""
    import io
    import os
    import sys

    from mindspeed_like.plan.arg_errors import megatron_lm_usage_errors

    fresh = parse_only_process and "megatron.core" not in sys.modules
    with _compile_left_for_later() if fresh else contextlib.nullcontext(), import_notices_kept_out():
        from megatron.training import arguments  # noqa: F401 (ImportError: not installed)

    saved_argv = sys.argv
    saved_env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "CUDA_DEVICE_MAX_CONNECTIONS")}
    sys.argv = ["pretrain_gpt.py", *argv]
    os.environ.update(WORLD_SIZE=str(world_size), RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")
    note = None
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints every argument
            with megatron_lm_usage_errors():
                args = arguments.parse_args(ignore_unknown_args=True)
            try:
                with _hopper_answered() if device == "cuda" else contextlib.nullcontext():
                    arguments.validate_args(args)
            except (AssertionError, RuntimeError) as error:
                if "CUDA" not in str(error) and "cuda" not in str(error):
                    raise ConfigError(
                        f"plan: Megatron-LM's validate_args refuses these arguments: {_refusal(error)}"
                    ) from error
                note = (
                    f"Megatron-LM's validate_args needs the target device on this host ({error}): its parsed "
                    "arguments with the built-in derivations"
                )
                args = derive(arguments.parse_args(ignore_unknown_args=True), world_size)
    finally:
        sys.argv = saved_argv
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return args, note


@contextlib.contextmanager
def _hopper_answered() -> Iterator[None]:
    """torch's CUDA device queries answered as an H100 would (compute capability 9.0) where this
    host has no CUDA device: Megatron-LM's validate_args asks them (``get_device_arch_version`` at TP
    or CP above 1, ``get_device_capability`` for grouped GEMM) only to choose a setting or refuse
    pre-Ampere GPUs, and the plan's device model is Hopper's (its cuBLAS workspaces)."""
    import types
    from unittest import mock

    import torch

    if torch.cuda.is_available():
        yield
        return
    hopper = types.SimpleNamespace(major=9, minor=0, name="H100 (assumed by plan)", total_memory=80 * 2**30)
    with (
        mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (9, 0)),
        mock.patch.object(torch.cuda, "get_device_properties", lambda device=None: hopper),
    ):
        yield


def _refusal(error: BaseException) -> str:
    """The error's message, or, for a bare ``assert`` (Megatron-LM has many), the asserting line
    itself: ``assert not (args.fp16 and args.bf16)`` says what is wrong where '' does not."""
    import linecache
    import traceback

    missing = re.fullmatch(r"(\w+) argument is None", str(error))
    if missing:
        return f"--{missing[1].replace('_', '-')} is required: give it"
    if str(error):
        return str(error)
    frame = traceback.extract_tb(error.__traceback__)[-1]
    line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
    return f"{line} ({'/'.join(frame.filename.split('/')[-3:])}:{frame.lineno})"


def derive(ns: argparse.Namespace, world_size: int | None) -> argparse.Namespace:
    """What Megatron-LM's ``validate_args`` derives, for the built-in parser's namespace."""
    missing = [n for n in ("num_layers", "hidden_size", "num_attention_heads", "seq_length") if getattr(ns, n) is None]
    if missing:
        raise ConfigError(
            "plan: give " + ", ".join("--" + m.replace("_", "-") for m in missing) + " (Megatron-LM needs them)"
        )
    if ns.hidden_size % ns.num_attention_heads:
        raise ConfigError(
            f"plan: --hidden-size {ns.hidden_size} must be divisible by --num-attention-heads {ns.num_attention_heads}"
        )
    if ns.ffn_hidden_size is None:
        ns.ffn_hidden_size = int((4 * ns.hidden_size * 2 / 3) / 64) * 64 if ns.swiglu else 4 * ns.hidden_size
    if ns.kv_channels is None:
        ns.kv_channels = ns.hidden_size // ns.num_attention_heads
    if not ns.group_query_attention:
        ns.num_query_groups = ns.num_attention_heads
    if ns.recompute_activations:
        ns.recompute_granularity = "selective"
    if ns.tensor_model_parallel_size == 1:
        # validate_args: "Disabling sequence parallelism because tensor model parallelism is disabled"
        ns.sequence_parallel = False
    tp, pp, cp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size, ns.context_parallel_size
    model_parallel = tp * pp * cp
    world = world_size if world_size is not None else model_parallel
    if world % model_parallel:
        raise ConfigError(f"plan: --world-size {world} is not divisible by TP x PP x CP = {model_parallel}")
    ns.world_size = world
    ns.data_parallel_size = world // model_parallel
    ns.virtual_pipeline_model_parallel_size = None
    # Megatron-LM counts the embedding and the loss as a layer each in the split where asked
    split = ns.num_layers + ns.account_for_embedding_in_pipeline_split + ns.account_for_loss_in_pipeline_split
    if ns.num_layers_per_virtual_pipeline_stage is not None:
        if split % pp or (split // pp) % ns.num_layers_per_virtual_pipeline_stage:
            raise ConfigError(
                "plan: number of layers per pipeline stage must be divisible by --num-layers-per-virtual-pipeline-stage"
            )
        vpp = split // pp // ns.num_layers_per_virtual_pipeline_stage
        ns.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
    elif ns.num_virtual_stages_per_pipeline_rank is not None and ns.num_virtual_stages_per_pipeline_rank > 1:
        ns.virtual_pipeline_model_parallel_size = ns.num_virtual_stages_per_pipeline_rank
    elif ns.pipeline_model_parallel_layout is not None:
        from mindspeed_like.plan import layer_layout

        vpp = layer_layout.virtual_stages(ns.pipeline_model_parallel_layout, pp)
        ns.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
    if ns.micro_batch_size is None:
        ns.micro_batch_size = 1
    if ns.global_batch_size is None:
        ns.global_batch_size = ns.micro_batch_size * ns.data_parallel_size
    if ns.bf16 and not ns.grad_reduce_in_bf16 and ns.main_grads_dtype == "fp32":
        ns.accumulate_allreduce_grads_in_fp32 = True
    if ns.num_experts and ns.moe_ffn_hidden_size is None:
        ns.moe_ffn_hidden_size = ns.ffn_hidden_size
    return ns


def run_from_namespace(
    ns: argparse.Namespace,
    *,
    device: str,
    flags: dict[str, Any],
    command: Sequence[str],
    source: str,
    not_modeled: Sequence[str] = (),
    notes: Sequence[str] = (),
) -> Run:
    """A :class:`Run` from a (validated) Megatron-LM namespace, whichever parser made it."""
    get = lambda name, default=None: getattr(ns, name, default)  # noqa: E731 (Megatron-LM versions differ)
    unpadded = None
    if get("padded_vocab_size") is None:  # Megatron-LM pads when it builds the tokenizer, after validate_args
        unpadded, note = tokenizer_vocab(ns)
        ns.padded_vocab_size = pad_vocab(unpadded, ns.make_vocab_size_divisible_by, ns.tensor_model_parallel_size)
        notes = (*notes, note) if note else notes
    if "--sequence-parallel" in command and ns.tensor_model_parallel_size == 1:
        notes = (*notes, "--sequence-parallel at TP 1: Megatron-LM switches it off (validate_args), as the plan does")
    if "muon" in str(get("optimizer", "adam")):
        notes = (*notes, MUON_NOTE)
    tp, dp = ns.tensor_model_parallel_size, ns.data_parallel_size
    experts = get("num_experts") or 0
    mbs = ns.micro_batch_size
    if ns.global_batch_size % (mbs * dp):
        raise ConfigError(
            f"plan: --global-batch-size {ns.global_batch_size} is not divisible by micro batch x DP ({mbs} x {dp})"
        )
    balance = get("moe_router_load_balancing_type") or ["aux_loss"]
    coeff = get("moe_aux_loss_coeff") or [0.0]
    balance = balance if isinstance(balance, list) else [balance]
    coeff = coeff if isinstance(coeff, list) else [coeff]
    aux = any(
        t in ("aux_loss", "seq_aux_loss", "global_aux_loss") and c > 0 for t, c in zip(balance, coeff * len(balance))
    )
    params = "bf16" if ns.bf16 else "fp16" if ns.fp16 else "fp32"
    model = Model(
        num_layers=ns.num_layers,
        hidden_size=ns.hidden_size,
        num_attention_heads=ns.num_attention_heads,
        ffn_hidden_size=ns.ffn_hidden_size,
        vocab_size=ns.padded_vocab_size,
        vocab_unpadded=unpadded,
        vocab_divisible_by=ns.make_vocab_size_divisible_by,
        bias_swiglu_fusion=bool(get("swiglu")) and bool(get("bias_swiglu_fusion", True)),
        attention_mask_in_dataloader=bool(get("create_attention_mask_in_dataloader", True)),
        seq_length=ns.seq_length,
        max_position_embeddings=get("max_position_embeddings"),
        kv_channels=ns.kv_channels,
        # core_transformer_config_from_args: no --group-query-attention means one group per head
        num_query_groups=ns.num_query_groups if get("group_query_attention") else ns.num_attention_heads,
        normalization=ns.normalization,
        gated_linear_unit=bool(ns.swiglu),
        add_bias_linear=bool(ns.add_bias_linear),
        add_qkv_bias=bool(get("add_qkv_bias")),
        position_embedding_type=ns.position_embedding_type,
        tied_embeddings=not ns.untie_embeddings_and_output_weights,
        qk_layernorm=bool(get("qk_layernorm")),
        hidden_dropout=float(get("hidden_dropout", 0.1)),
        attention_dropout=float(get("attention_dropout", 0.1)),
        # validate_args: --apply-query-key-layer-scaling also sets attention_softmax_in_fp32
        attention_softmax_in_fp32=bool(get("attention_softmax_in_fp32") or get("apply_query_key_layer_scaling")),
        num_experts=experts,
        moe_ffn_hidden_size=get("moe_ffn_hidden_size") or 0,
        moe_router_topk=get("moe_router_topk", 2),
        moe_layer_pattern=moe_pattern(get("moe_layer_freq", 1), ns.num_layers) if experts else (),
        moe_shared_expert_intermediate_size=get("moe_shared_expert_intermediate_size") or 0,
        moe_shared_expert_gate=bool(get("moe_shared_expert_gate")),
        moe_router_dtype=get("moe_router_dtype"),
        moe_router_score_function=get("moe_router_score_function", "softmax"),
        moe_router_num_groups=get("moe_router_num_groups"),
        moe_router_enable_expert_bias=bool(get("moe_router_enable_expert_bias")),
        moe_aux_loss=aux,
        moe_grouped_gemm=bool(get("moe_grouped_gemm")),
        moe_token_dispatcher_type=get("moe_token_dispatcher_type", "allgather"),
        multi_latent_attention=bool(get("multi_latent_attention")),
        q_lora_rank=get("q_lora_rank"),
        kv_lora_rank=get("kv_lora_rank", 0) or 0,
        qk_head_dim=get("qk_head_dim", 0) or 0,
        qk_pos_emb_head_dim=get("qk_pos_emb_head_dim", 0) or 0,
        v_head_dim=get("v_head_dim", 0) or 0,
        mtp_num_layers=get("mtp_num_layers") or 0,
    )
    layout = Layout(
        tp=tp,
        pp=ns.pipeline_model_parallel_size,
        vpp=get("virtual_pipeline_model_parallel_size"),
        cp=ns.context_parallel_size,
        ep=ns.expert_model_parallel_size,
        etp=get("expert_tensor_parallel_size"),
        dp=dp,
        sequence_parallel=bool(ns.sequence_parallel),
        micro_batch_size=mbs,
        num_microbatches=ns.global_batch_size // (mbs * dp),
        overlap_grad_reduce=bool(get("overlap_grad_reduce")),
        first_stage_layers=get("decoder_first_pipeline_num_layers"),
        last_stage_layers=get("decoder_last_pipeline_num_layers"),
        embedding_in_split=bool(get("account_for_embedding_in_pipeline_split")),
        loss_in_split=bool(get("account_for_loss_in_pipeline_split")),
        layer_layout=_layout_text(get("pipeline_model_parallel_layout")),
        microbatch_group=get("microbatch_group_size_per_vp_stage"),
        optimizer_instances=get("num_distributed_optimizer_instances", 1) or 1,
        outer_sharding=get("outer_dp_sharding_strategy", "no_shard") or "no_shard",
        **{"distributed_optimizer": bool(ns.use_distributed_optimizer), **_fsdp_fields(ns)},
    )
    precision = Precision(
        params=params,
        grad_reduce_in_fp32=bool(ns.accumulate_allreduce_grads_in_fp32) or params == "fp32",
        precision_aware_optimizer=bool(get("use_precision_aware_optimizer")),
        main_grads=_dtype_name(get("main_grads_dtype", "fp32")),
        main_params=_dtype_name(get("main_params_dtype", "fp32")),
        exp_avg=_dtype_name(get("exp_avg_dtype", "fp32")),
        exp_avg_sq=_dtype_name(get("exp_avg_sq_dtype", "fp32")),
        optimizer=get("optimizer", "adam"),
        sgd_momentum=float(get("sgd_momentum", 0.9)),
        fsdp_main_params=_fsdp_dtype_name(get("megatron_fsdp_main_params_dtype", "fp32")),
        fsdp_main_grads=_fsdp_dtype_name(get("megatron_fsdp_main_grads_dtype", "auto")),
    )
    modules = get("recompute_modules")
    recompute = Recompute(
        granularity=get("recompute_granularity"),
        method=get("recompute_method"),
        num_layers=get("recompute_num_layers"),
        modules=tuple(modules) if modules else ("core_attn",),
    )
    check(model, layout)
    if layout.fsdp == "megatron_fsdp":
        from mindspeed_like.plan.fsdp import megatron_fsdp_dtype_refusal, megatron_fsdp_precision_aware_refusal

        refusal = megatron_fsdp_precision_aware_refusal(precision) or megatron_fsdp_dtype_refusal(
            precision, float(get("clip_grad", 1.0))
        )
        if refusal:
            raise ConfigError(f"plan: {refusal}")
    check_recompute(recompute, model.num_layers, layout.pp)
    instances = get("num_distributed_optimizer_instances", 1) or 1
    if instances > 1 and layout.fsdp is None and layout.distributed_optimizer:
        # the distributed optimizer's instances under DDP (its shards over DP / N ranks): not modeled
        not_modeled = [*not_modeled, "--num-distributed-optimizer-instances"]
    return Run(
        model=model,
        layout=layout,
        precision=precision,
        recompute=recompute,
        transformer_impl=ns.transformer_impl if ns.transformer_impl != "inference_optimized" else "transformer_engine",
        device=device,
        flags=dict(flags),
        command=tuple(command),
        source=source,
        steps=get("train_iters"),
        not_modeled=tuple(not_modeled),
        notes=tuple(notes),
    )


def _fsdp_fields(ns: argparse.Namespace) -> dict[str, Any]:
    """The :class:`Layout` fields of Megatron-LM's --use-torch-fsdp2 / --use-megatron-fsdp."""
    if getattr(ns, "use_torch_fsdp2", False):
        return {
            "fsdp": "torch_fsdp2",
            "reshard_after_forward": bool(getattr(ns, "torch_fsdp2_reshard_after_forward", True)),
        }
    if getattr(ns, "use_megatron_fsdp", False):
        return {
            "fsdp": "megatron_fsdp",
            "sharding_strategy": getattr(ns, "data_parallel_sharding_strategy", "no_shard"),
            # Megatron-FSDP's optimizer is megatron's distributed one over its buffers
            "distributed_optimizer": True,
        }
    return {}


def check_sharded_data_parallel(ns: argparse.Namespace) -> None:
    """Megatron-LM's validate_args refusals of its two FSDP paths (quoted), which the built-in parser
    would otherwise pass, and compare's: two paths at once, an option of one path without it, and
    Megatron-FSDP's no_shard on the megatron-core releases where it does not train
    (fixes/megatron_fsdp_no_shard.py)."""
    get = lambda name, default=None: getattr(ns, name, default)  # noqa: E731
    torch_fsdp2, megatron_fsdp = bool(get("use_torch_fsdp2")), bool(get("use_megatron_fsdp"))
    strategy = get("data_parallel_sharding_strategy", "no_shard")
    if torch_fsdp2 and megatron_fsdp:
        raise ConfigError("plan: --use-torch-fsdp2 and --use-megatron-fsdp are two FSDP paths; choose one")
    if get("torch_fsdp2_reshard_after_forward", True) is False and not torch_fsdp2:
        raise ConfigError("plan: --torch-fsdp2-no-reshard-after-forward acts with --use-torch-fsdp2; give both")
    if strategy != "no_shard" and not megatron_fsdp:
        raise ConfigError(
            f"plan: --data-parallel-sharding-strategy {strategy} acts with --use-megatron-fsdp; give both"
        )
    if torch_fsdp2:
        refusals = (
            (
                get("pipeline_model_parallel_size", 1) > 1,
                "'--use-torch-fsdp2 is not supported with pipeline parallelism'",
            ),
            (get("expert_model_parallel_size", 1) > 1, "'--use-torch-fsdp2 is not supported with expert parallelism'"),
            (
                get("use_distributed_optimizer"),
                '"--use-torch-fsdp2 is not supported with MCore\'s distributed optimizer"',
            ),
            (
                get("gradient_accumulation_fusion", True),
                "'--use-torch-fsdp2 is not supported with gradient accumulation fusion' (Megatron-LM's default: add "
                "--no-gradient-accumulation-fusion)",
            ),
            (
                get("ckpt_format", "torch_dist") not in ("torch_dist", "torch_dcp"),
                "'--use-torch-fsdp2 requires --ckpt-format torch_dist or torch_dcp'",
            ),
            (
                not get("untie_embeddings_and_output_weights", False),
                "'--use-torch-fsdp2 requires --untie-embeddings-and-output-weights'",
            ),
            (get("fp16"), "'--use-torch-fsdp2 not supported with fp16 yet'"),
        )
        for refused, words in refusals:
            if refused:
                raise ConfigError(f"plan: Megatron-LM refuses this with --use-torch-fsdp2: {words}")
    check_megatron_fsdp_dtypes(
        megatron_fsdp,
        _fsdp_dtype_name(get("megatron_fsdp_main_params_dtype", "fp32")),
        _fsdp_dtype_name(get("megatron_fsdp_main_grads_dtype", "auto")),
        "plan",
    )
    if megatron_fsdp:
        if get("ckpt_format", "torch_dist") != "fsdp_dtensor":
            raise ConfigError(
                "plan: Megatron-LM refuses --use-megatron-fsdp without --ckpt-format fsdp_dtensor ('Megatron FSDP "
                "only supports fsdp_dtensor checkpoint format'): add it"
            )
        if strategy == "no_shard":
            from mindspeed_like.fixes.megatron_fsdp_no_shard import refusal

            message = refusal()
            if message is not None:
                raise ConfigError(f"plan: --data-parallel-sharding-strategy no_shard: {message}")


def check_megatron_fsdp_dtypes(megatron_fsdp: bool, main_params: str, main_grads: str, tool: str) -> None:
    """--megatron-fsdp-main-params-dtype / --megatron-fsdp-main-grads-dtype away from their defaults: they act with
    --use-megatron-fsdp only, and only where the megatron-core release has the fields
    (``megatron_code.megatron_fsdp_has_main_dtype_fields``: 0.17+); refused otherwise (plan's and compare's)."""
    given = [
        f"--{name} {value}"
        for name, value, default in (
            ("megatron-fsdp-main-params-dtype", main_params, "fp32"),
            ("megatron-fsdp-main-grads-dtype", main_grads, "auto"),
        )
        if value != default
    ]
    if not given:
        return
    for value in (main_params, main_grads):
        if value not in FSDP_MAIN_DTYPES:
            choices = ", ".join(FSDP_MAIN_DTYPES)
            raise ConfigError(f"{tool}: a Megatron-FSDP buffer dtype is one of {choices}; got {value!r}")
    if not megatron_fsdp:
        raise ConfigError(f"{tool}: {' and '.join(given)} act(s) with --use-megatron-fsdp; give both")
    from mindspeed_like.plan import megatron_code

    if not megatron_code.megatron_fsdp_has_main_dtype_fields():
        raise ConfigError(
            f"{tool}: {' and '.join(given)}: megatron-core {megatron_code.release()}'s DistributedDataParallelConfig "
            "has no megatron_fsdp_main_params_dtype / megatron_fsdp_main_grads_dtype (Megatron-LM's options from "
            "0.17): its Megatron-FSDP keeps fp32 masters (preserve_fp32_weights) and fp32 gradients under "
            "--accumulate-allreduce-grads-in-fp32; leave the option(s) out, or use megatron-core 0.17 or later"
        )


def _fsdp_dtype_name(value: Any) -> str:
    """A Megatron-FSDP buffer dtype as Megatron-LM's choices name it: validate_args maps ``auto`` to None."""
    return "auto" if value is None else _dtype_name(value)


def _dtype_name(value: Any) -> str:
    """'fp32' from 'fp32' or torch.float32 (Megatron-LM's validate_args maps some to torch dtypes)."""
    text = str(value).replace("torch.", "")
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "uint8": "fp8"}.get(text, text)


_POSITIVE = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "micro_batch_size",
    "global_batch_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "ffn_hidden_size",
    "kv_channels",
    "num_query_groups",
    "padded_vocab_size",
)


def check_sizes(ns: argparse.Namespace) -> None:
    """Sizes and parallel degrees below 1, which neither parser refuses (Megatron-LM fails later).
    Run on the built-in parser's namespace as soon as it is read, before anything divides by them
    (the world size, ``derive``, Megatron-LM's validate_args): both parsers read the same values."""
    for name in _POSITIVE:
        value = getattr(ns, name, None)
        if value is not None and value < 1:
            raise ConfigError(f"plan: --{name.replace('_', '-')} must be 1 or more, got {value}")
    if getattr(ns, "fp16", False) and getattr(ns, "bf16", False):
        raise ConfigError("plan: --fp16 and --bf16 exclude each other (Megatron-LM asserts it): give one")


MUON_NOTE = (
    "--optimizer muon: its state is not modeled and is counted as Adam's (two fp32 moments a parameter); "
    "Muon keeps one momentum for each matrix and Adam's two for the rest, so the optimizer figure is an upper bound"
)


def _layout_text(layout: Any) -> str | None:
    """--pipeline-model-parallel-layout as given (Megatron-LM may hold its parsed object instead)."""
    if layout is None or isinstance(layout, str):
        return layout
    return str(getattr(layout, "input_data", layout))


def check_exclusive(ns: argparse.Namespace, argv: Sequence[str]) -> None:
    """Options Megatron-LM's validate_args refuses together, refused here for both parsers: the
    built-in one reads only one of each pair, and Megatron-LM's validation stops where its device
    queries cannot be answered (an NPU or CPU target on a host without that device: TP/CP > 1,
    grouped GEMM), so neither would say it there."""
    given = {token.split("=", 1)[0] for token in argv if token.startswith("--")}
    virtual = [
        option
        for option in (
            "--num-layers-per-virtual-pipeline-stage",
            "--num-virtual-stages-per-pipeline-rank",
            "--pipeline-model-parallel-layout",
        )
        if option in given
    ]
    if len(virtual) > 1:
        raise ConfigError(
            f"plan: {' and '.join(virtual)} exclude each other (Megatron-LM: no more than one of them can be set): "
            "give one"
        )
    if "--rampup-batch-size" in given and ("--train-iters" in given):
        raise ConfigError(
            "plan: --rampup-batch-size is for sample-based training (--train-samples); with --train-iters "
            "Megatron-LM refuses it ('expected no batch-size rampup for iteration-based training')"
        )
    optimizer = str(getattr(ns, "optimizer", "adam"))
    if "muon" in optimizer and getattr(ns, "use_distributed_optimizer", False):
        raise ConfigError(
            f"plan: --optimizer {optimizer} does not run with --use-distributed-optimizer (Megatron-LM asserts "
            "'Muon optimizer does not support distributed optimizer for now'): leave one out"
        )
    check_sharded_data_parallel(ns)
    experts, ep = getattr(ns, "num_experts", None), getattr(ns, "expert_model_parallel_size", 1)
    if ep > 1 and not experts:
        raise ConfigError(
            f"plan: --expert-model-parallel-size {ep} needs --num-experts (Megatron-LM asserts it): give the "
            "experts, or leave expert parallelism out"
        )


def check_recompute(recompute: Recompute, num_layers: int, pp: int) -> None:
    """megatron's TransformerConfig refusals for recomputation, at the plan instead of model build."""
    granularity, method, layers = recompute.granularity, recompute.method, recompute.num_layers
    if granularity == "full":
        if method is None:
            raise ConfigError(
                "plan: --recompute-granularity full needs --recompute-method uniform or block (megatron's "
                "TransformerConfig refuses it without)"
            )
        if layers is None or not 1 <= layers <= num_layers // pp:
            raise ConfigError(
                f"plan: --recompute-granularity full needs --recompute-num-layers between 1 and the layers of a "
                f"pipeline stage ({num_layers // pp}), got {layers}"
            )
    elif granularity == "selective":
        if method is not None:
            raise ConfigError(
                "plan: --recompute-method is for --recompute-granularity full; selective recomputation takes "
                "--recompute-modules (Megatron-LM refuses the pair)"
            )
        if layers is not None:
            raise ConfigError("plan: --recompute-num-layers is for --recompute-granularity full (megatron refuses it)")


def check(model: Model, layout: Layout) -> None:
    """What megatron would refuse later, refused here with the fix."""
    from mindspeed_like.plan.fsdp import expert_data_parallel_size, hybrid_sharding_refusal

    refusal = hybrid_sharding_refusal(
        megatron_fsdp=layout.fsdp == "megatron_fsdp",
        instances=layout.optimizer_instances,
        outer=layout.outer_sharding,
        strategy=layout.sharding_strategy,
        dp_cp=layout.dp * layout.cp,
        ep=layout.ep,
        overlap_grad_reduce=layout.overlap_grad_reduce,
        expert_dp=expert_data_parallel_size(
            tp=layout.tp, cp=layout.cp, dp=layout.dp, expert_tp=layout.expert_tp, ep=layout.ep
        ),
    )
    if refusal:
        raise ConfigError(f"plan: {refusal}")
    tp = layout.tp
    if model.num_attention_heads % tp:
        raise ConfigError(f"plan: --num-attention-heads {model.num_attention_heads} must be divisible by TP {tp}")
    if not model.multi_latent_attention and model.num_query_groups % tp:
        raise ConfigError(f"plan: --num-query-groups {model.num_query_groups} must be divisible by TP {tp}")
    if model.ffn_hidden_size % tp:
        raise ConfigError(f"plan: --ffn-hidden-size {model.ffn_hidden_size} must be divisible by TP {tp}")
    if not model.multi_latent_attention and model.num_attention_heads % model.num_query_groups:
        # megatron builds such a model, and its first forward fails reshaping the keys and values
        raise ConfigError(
            f"plan: --num-attention-heads {model.num_attention_heads} must be a multiple of --num-query-groups "
            f"{model.num_query_groups} (each key/value head serves heads / groups query heads): give groups that "
            "divide the heads"
        )
    if model.is_moe and not 1 <= model.moe_router_topk <= model.num_experts:
        raise ConfigError(
            f"plan: --moe-router-topk {model.moe_router_topk} must be between 1 and --num-experts {model.num_experts} "
            "(the router picks that many distinct experts a token)"
        )
    if model.is_moe and model.moe_ffn_hidden_size % layout.expert_tp:
        raise ConfigError(
            f"plan: the experts' ffn size {model.moe_ffn_hidden_size} (--moe-ffn-hidden-size, else --ffn-hidden-size) "
            f"must be divisible by expert TP {layout.expert_tp} (--expert-tensor-parallel-size, else TP)"
        )
    if model.is_moe and model.num_experts % layout.ep:
        raise ConfigError(
            f"plan: --num-experts {model.num_experts} must be divisible by --expert-model-parallel-size {layout.ep}"
        )
    if model.is_moe and (layout.dp * layout.cp * tp) % (layout.expert_tp * layout.ep):
        ranks = layout.dp * layout.cp * tp
        per_stage = tp * layout.pp * layout.cp
        world = next(
            k * per_stage
            for k in range(1, 1 + layout.expert_tp * layout.ep)
            if (k * tp * layout.cp) % (layout.expert_tp * layout.ep) == 0
        )
        raise ConfigError(
            f"plan: DP x CP x TP ({layout.dp} x {layout.cp} x {tp} = {ranks}) must be divisible by expert TP x EP "
            f"({layout.expert_tp} x {layout.ep}; megatron's initialize_model_parallel) in a world of "
            f"{layout.world_size} ranks: give --world-size as a multiple of {world} (without it the world is "
            "TP x PP x CP)"
        )
    if model.seq_length % layout.cp or (layout.cp > 1 and model.seq_length % (2 * layout.cp)):
        raise ConfigError(f"plan: --seq-length {model.seq_length} must be divisible by 2 x CP ({2 * layout.cp})")
    if layout.sequence_parallel and tp == 1:
        raise ConfigError("plan: --sequence-parallel needs --tensor-model-parallel-size > 1")
    if layout.vpp and layout.pp == 1:
        raise ConfigError("plan: virtual pipeline stages need --pipeline-model-parallel-size > 1")
    if layout.pp > 1 and layout.vpp:
        # megatron's forward_backward_pipelining_with_interleaving refuses these at the first step
        m, group = layout.num_microbatches, layout.microbatch_group or layout.pp
        if not layout.pp <= group <= m:
            raise ConfigError(
                f"plan: the interleaved schedule needs its microbatch group ({group}: "
                f"--microbatch-group-size-per-virtual-pipeline-stage, else PP) between PP ({layout.pp}) and the "
                f"microbatches per step ({m}); raise --global-batch-size or change the group"
            )
        if 0 < m % group < layout.pp:
            raise ConfigError(
                f"plan: the interleaved schedule needs the microbatches per step ({m}) to be a multiple of its "
                f"microbatch group ({group}: --microbatch-group-size-per-virtual-pipeline-stage, else PP), or to "
                f"leave at least PP ({layout.pp}) over; raise --global-batch-size"
            )
