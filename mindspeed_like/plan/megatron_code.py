"""What the installed megatron-core's code keeps for backward where that differs between its
releases, read from its source files (parsed with ``ast``, never imported: ``plan`` imports neither
torch nor megatron). Each check looks for the code that makes the difference (a dataclass field,
a decorator, a parameter, a method), not for a version number, and names the change it follows.

The activation rows (activations.py) were read off megatron-core 0.16.1; the differences below were
found on 0.13.1 and 0.19.2 by listing every storage the parity model saves (shape, dtype, module and
megatron's line) under each release. Megatron-FSDP's model state (state.py) differs too: which dtype its
main-grad buffer takes and the fp32 copy of the gradient shard it keeps for the masters, read in the 0.16.1,
0.17.1, 0.18.2 and 0.19.2 wheels (the ``megatron_fsdp_*`` checks at the end). Where megatron-core is not found,
or a file cannot be read, the 0.16 behaviour is taken.
"""

from __future__ import annotations

import ast
import contextlib
import functools
from collections.abc import Callable, Iterator

from mindspeed_like.megatron_version import core_file

_recent: list = []  # the release (a Version) while predicting what a 0.16-0.19 run measured (:func:`as_measured_on`)


@contextlib.contextmanager
def as_measured_on(version: str | None) -> Iterator[None]:
    """Predict a record measured on megatron-core ``version``: the installed code decides where it
    is that version (or the record does not say), the 0.16-0.19 behaviour where the record is from
    one of those and another release is installed (the version lanes predict the 0.16.1 records).
    A record of an older release than 0.16 on another install is refused: its code is not at hand."""
    from packaging.version import Version

    from mindspeed_like.megatron_version import megatron_core_version

    installed = megatron_core_version()
    if version is None or installed is None or Version(version) == installed:
        yield
        return
    if Version(version) < Version("0.16"):
        raise ValueError(f"a record measured on megatron-core {version} cannot be predicted on {installed}")
    _recent.append(Version(version))
    try:
        yield
    finally:
        _recent.pop()


def release() -> object:
    """The megatron-core release (a ``packaging`` Version, or None where none is installed) being
    predicted: the record's inside :func:`as_measured_on`, else the installed one."""
    from mindspeed_like.megatron_version import megatron_core_version

    return _recent[-1] if _recent else megatron_core_version()


def as_measured_by(record: dict) -> contextlib.AbstractContextManager[None]:
    """:func:`as_measured_on` the megatron-core version a record (results/*.json) was measured on."""
    return as_measured_on((record.get("versions") or {}).get("megatron_core"))


def as_measured_in(name: str) -> contextlib.AbstractContextManager[None]:
    """:func:`as_measured_by` the record ``results/<name>.json``; the installed code where it is absent."""
    from mindspeed_like.toolkit import records

    path = records.results_dir() / f"{name}.json"
    return as_measured_by(records.read(path)) if path.exists() else contextlib.nullcontext()


@functools.cache
def _tree(relative: str) -> ast.Module | None:
    """The parsed ``megatron/core/<relative>`` that ``import megatron.core`` would load."""
    path = core_file(relative)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return ast.parse(handle.read())
    except (OSError, SyntaxError, ValueError):
        return None


def _member(body: list[ast.stmt], name: str) -> ast.stmt | None:
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node
    return None


def _class(relative: str, name: str) -> ast.ClassDef | None:
    tree = _tree(relative)
    node = _member(tree.body, name) if tree is not None else None
    return node if isinstance(node, ast.ClassDef) else None


def _trait(recent: bool) -> Callable[[Callable[[], bool]], Callable[[], bool]]:
    """A check of the installed code (read once), answered as megatron 0.16-0.19's (``recent``)
    inside :func:`as_measured_on` a record of those releases."""

    def wrap(check: Callable[[], bool]) -> Callable[[], bool]:
        installed = functools.cache(check)

        @functools.wraps(check)
        def trait() -> bool:
            return recent if _recent else installed()

        return trait

    return wrap


@_trait(recent=True)
def glu_copies_linear_half() -> bool:
    """Whether megatron's unfused GLU keeps a copy of the linear half. 0.16.1 and 0.19.2 compute
    ``activation_func(x_glu) * (x_linear + config.glu_linear_offset)`` (``glu`` in ``MLP.forward``,
    transformer/mlp.py, and in ``TEGroupedMLP.forward``'s ``bias_act_func``, transformer/moe/experts.py):
    the sum is a new tensor, kept by the product beside ``activation_func(x_glu)``. 0.13.1 computes
    ``activation_func(x[0]) * x[1]``: the product keeps ``x[1]``, a view of fc1's output, which is
    already kept. Checked as ``TransformerConfig``'s field ``glu_linear_offset`` (the offset and the
    new ``glu`` came together)."""
    config = _class("transformer/transformer_config.py", "TransformerConfig")
    if config is None:
        return True
    return _member(config.body, "glu_linear_offset") is not None


@_trait(recent=False)
def caches_causal_mask() -> bool:
    """Whether megatron's unfused softmax takes one causal mask for every layer. 0.13.1's
    ``get_default_causal_mask`` (transformer/utils.py, called by ``FusedScaleMaskSoftmax.forward_torch_softmax``)
    is an ``lru_cache``: every layer's masked fill keeps the same s x s bool tensor (and the cache
    holds it). 0.16.1 and 0.19.2 dropped the cache: each layer makes and keeps its own."""
    tree = _tree("transformer/utils.py")
    node = _member(tree.body, "get_default_causal_mask") if tree is not None else None
    if not isinstance(node, ast.FunctionDef):
        return False
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name in ("lru_cache", "cache"):
            return True
    return False


@_trait(recent=False)
def mtp_block_runs_output_layer() -> bool:
    """Whether the multi-token-prediction block runs the output layer and the loss of each MTP
    layer itself and returns the decoder's hidden states (0.13.1: ``MultiTokenPredictionBlock.forward``
    takes ``output_layer`` and ``compute_language_model_loss``, transformer/multi_token_prediction.py),
    rather than returning the decoder's and the MTP layers' hidden states concatenated for
    ``GPTModel._postprocess`` to run the output layer on (0.16.1, 0.19.2). Under 0.13.1 the decoder's
    output layer reads the decoder's normed output, the tensor the first MTP layer's ``hnorm`` reads:
    one storage where that norm keeps its input."""
    block = _class("transformer/multi_token_prediction.py", "MultiTokenPredictionBlock")
    forward = _member(block.body, "forward") if block is not None else None
    if not isinstance(forward, ast.FunctionDef):
        return False
    names = [a.arg for a in forward.args.args + forward.args.kwonlyargs]
    return "compute_language_model_loss" in names


@_trait(recent=False)
def seq_aux_loss_keeps_fp32_cost() -> bool:
    """Whether the sequence-level load-balancing loss keeps an fp32 [b, experts] cost. 0.13.1's
    ``TopKRouter.seq_aux_loss_load_balancing`` calls ``moe_utils.sequence_load_balancing_loss_func``,
    whose ``cost_coeff * probs.mean(0)`` keeps the fp32 cost; 0.16.1's and 0.19.2's
    ``TopKRouter._apply_seq_aux_loss`` calls ``switch_load_balancing_loss_func`` on the scores
    reshaped to [s, b x experts], which keeps the int64 tokens per (sequence, expert)."""
    router = _class("transformer/moe/router.py", "TopKRouter")
    if router is None:
        return False
    return _member(router.body, "_apply_seq_aux_loss") is None and (
        _member(router.body, "seq_aux_loss_load_balancing") is not None
    )


@functools.cache
def _installed_permute_selects_by_argsort() -> bool:
    tree = _tree("transformer/moe/moe_utils.py")
    node = _member(tree.body, "permute") if tree is not None else None
    if not isinstance(node, ast.FunctionDef):
        return False
    calls = {n.func.attr for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    return "masked_select" not in calls


def permute_selects_by_argsort() -> bool:
    """Whether megatron's dropless ``moe_utils.permute`` selects the rows by a stable argsort of the
    flattened [experts x tokens] routing map (0.17.1, 0.18.2, 0.19.2: a fixed-shape selection, CUDA-graph
    safe; the same lines in the three), and not by ``masked_select`` (0.13.1, 0.16.1). The probs are then
    gathered by advanced indexing with a slice of that argsort, which keeps the WHOLE int64 experts x tokens
    argsort for backward (measured on 0.19.2: 12,288 B a layer at 8 experts x 192 tokens, beside the 3,072 B
    of row indices), where 0.16 keeps the bool routing map, the probs and the row indices. Checked as
    ``masked_select`` absent from ``permute``. Inside :func:`as_measured_on` the record's release answers
    (0.17 and later)."""
    if _recent:
        from packaging.version import Version

        return _recent[-1] >= Version("0.17")
    return _installed_permute_selects_by_argsort()


_ADAPTER = "distributed/fsdp/mcore_fsdp_adapter.py"
_FSDP_BUFFER = "distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py"


def _calls(node: ast.AST, name: str) -> list[ast.Call]:
    """The calls in ``node`` of a function or method called ``name`` (``f(...)`` or ``x.f(...)``)."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            func = n.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called == name:
                out.append(n)
    return out


def _names_attribute(node: ast.AST, attr: str) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == attr for n in ast.walk(node))


@functools.cache
def _installed_megatron_fsdp_grads_follow_grad_reduce_in_fp32() -> bool:
    adapter = _class(_ADAPTER, "FullyShardedDataParallel")
    init = _member(adapter.body, "__init__") if adapter is not None else None
    if not isinstance(init, ast.FunctionDef):
        return True  # no Megatron-FSDP adapter (0.13) or not readable: 0.16's
    policies = _calls(init, "MixedPrecisionPolicy")
    if policies:
        # 0.17-0.18: main_grads_dtype=(torch.float32 if ddp_config.grad_reduce_in_fp32 else ...); 0.19: the
        # ddp_config's megatron_fsdp_main_grads_dtype alone
        given = [kw.value for call in policies for kw in call.keywords if kw.arg == "main_grads_dtype"]
        return any(_names_attribute(value, "grad_reduce_in_fp32") for value in given)
    # 0.16: no policy; ParamAndGradBuffer takes grad_reduce_in_fp32 and sizes the main-grad buffer by it
    buffer = _class(_FSDP_BUFFER, "ParamAndGradBuffer")
    buffer_init = _member(buffer.body, "__init__") if buffer is not None else None
    if not isinstance(buffer_init, ast.FunctionDef):
        return True
    return any(a.arg == "grad_reduce_in_fp32" for a in buffer_init.args.args + buffer_init.args.kwonlyargs)


def megatron_fsdp_grads_follow_grad_reduce_in_fp32() -> bool:
    """Whether Megatron-FSDP's main-grad buffer is fp32 where ``DistributedDataParallelConfig.grad_reduce_in_fp32``
    is set (Megatron-LM's ``--accumulate-allreduce-grads-in-fp32``, its default for bf16; compare sets it), or in
    the parameters' dtype whatever it says (unless ``megatron_fsdp_main_grads_dtype`` names one). Read in the
    wheels: 0.16.1's ``ParamAndGradBuffer`` takes ``grad_reduce_in_fp32`` and makes the buffer fp32 by it; 0.17.1
    and 0.18.2's ``FullyShardedDataParallel.__init__`` builds the ``MixedPrecisionPolicy`` with
    ``main_grads_dtype=torch.float32 if ddp_config.grad_reduce_in_fp32 else ...`` ("Grandfathered Argument");
    0.19.2's passes ``ddp_config.megatron_fsdp_main_grads_dtype`` alone, whose default (None, Megatron-LM's
    ``--megatron-fsdp-main-grads-dtype auto``) is the parameters' dtype. Checked as ``grad_reduce_in_fp32`` read
    in that keyword, or, with no policy, taken by the buffer. Inside :func:`as_measured_on` the record's
    release answers (before 0.19)."""
    if _recent:
        return _recent[-1].release < (0, 19)
    return _installed_megatron_fsdp_grads_follow_grad_reduce_in_fp32()


@functools.cache
def _installed_megatron_fsdp_casts_grads_to_the_masters_dtype() -> bool:
    buffer = _class(_FSDP_BUFFER, "ParamAndGradBuffer")
    update = _member(buffer.body, "update_main_grads") if buffer is not None else None
    if not isinstance(update, ast.FunctionDef):
        return True  # no Megatron-FSDP (0.13) or not readable: 0.16's
    return any(
        any(_names_attribute(arg, "dtype") for arg in call.args) and _names_attribute(call.func, "to")
        for call in _calls(update, "to")
    )


def megatron_fsdp_casts_grads_to_the_masters_dtype() -> bool:
    """Whether Megatron-FSDP hands its optimizer each gradient shard cast to the fp32 masters' dtype: a new
    tensor beside the main-grad buffer wherever their dtypes differ, kept (``dist_main_grad``) from one
    optimizer step to the next. ``ParamAndGradBuffer.update_main_grads`` does ``optimizer_grad =
    optimizer_grad.to(param.dtype)`` where the group has a main-weight buffer and the gradients are not
    decoupled (read in 0.16.1, 0.17.1, 0.18.2 and 0.19.2: all of them; ``.to`` of an equal dtype is the
    tensor itself). Measured on 0.19.2 (compare, llama DP 2 optim_grads_params bf16): the bf16 main-grad
    shard and its fp32 copy, 2 + 4 bytes an element of the shard. Checked as a ``.to(<x>.dtype)`` call in
    ``update_main_grads``; inside :func:`as_measured_on`, every release 0.16-0.19."""
    if _recent:
        return True
    return _installed_megatron_fsdp_casts_grads_to_the_masters_dtype()


@functools.cache
def _installed_megatron_fsdp_keeps_fp32_masters() -> bool:
    config = _class("distributed/distributed_data_parallel_config.py", "DistributedDataParallelConfig")
    if config is None:
        return True
    for name in ("megatron_fsdp_main_params_dtype", "preserve_fp32_weights"):
        field = _member(config.body, name)
        if isinstance(field, ast.AnnAssign) and field.value is not None:
            value = field.value
            if isinstance(value, ast.Constant):  # preserve_fp32_weights = True / main_params_dtype = None
                return bool(value.value)
            return True  # torch.float32
    return True


def megatron_fsdp_keeps_fp32_masters() -> bool:
    """Whether Megatron-FSDP keeps a main-weight buffer of fp32 masters whatever the parameters' dtype (fp32
    parameters too) by default: ``DistributedDataParallelConfig.megatron_fsdp_main_params_dtype = torch.float32``
    (0.17.1, 0.18.2, 0.19.2; Megatron-LM 0.19's ``--megatron-fsdp-main-params-dtype`` default fp32) or
    ``preserve_fp32_weights = True`` (0.16.1; Megatron-LM core_v0.16.1 does not set it), read as that field's
    default. Measured: compare, llama DP 2 optim_grads_params ``--fp32`` on 0.16.1 and 0.19.2, optimizer state
    12 bytes an element of the shard (masters and two moments), as at bf16. Inside :func:`as_measured_on`, every
    release 0.16-0.19."""
    if _recent:
        return True
    return _installed_megatron_fsdp_keeps_fp32_masters()


_MEGATRON_FSDP = "distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py"


def _marks_pre_backward(node: ast.AST) -> bool:
    """Whether ``node`` assigns ``<x>._training_state = TrainingState.PRE_BACKWARD``."""
    return any(
        isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Attribute) and t.attr == "_training_state" for t in n.targets)
        and _names_attribute(n.value, "PRE_BACKWARD")
        for n in ast.walk(node)
    )


@functools.cache
def _installed_megatron_fsdp_regathers_the_units_at_the_forward_end() -> bool:
    fsdp = _class(_MEGATRON_FSDP, "MegatronFSDP")
    if fsdp is None:
        return True  # no Megatron-FSDP (0.13) or not readable: 0.16's
    hooks = [n for n in ast.walk(fsdp) if isinstance(n, ast.FunctionDef) and n.name == "_root_pre_backward"]
    if not hooks:
        return True
    for loop in (n for n in ast.walk(hooks[0]) if isinstance(n, ast.For)):
        over = loop.iter
        if not (isinstance(over, ast.Call) and isinstance(over.func, ast.Attribute) and over.func.attr == "modules"):
            continue
        for statement in loop.body:
            if not _marks_pre_backward(statement):
                continue
            # 0.16/0.17: ``if isinstance(module, tuple(fsdp_unit_modules)): module._training_state = PRE_BACKWARD``;
            # 0.18/0.19: every submodule, unconditionally
            return isinstance(statement, ast.If) and bool(_calls(statement.test, "isinstance"))
    return True


def megatron_fsdp_regathers_the_units_at_the_forward_end() -> bool:
    """Whether, under ``optim_grads_params``, every TransformerLayer's gathered bucket is alive again when a
    step's forward ends (so the tensors autograd saved from it hold it to the layer's backward), from the
    second step on. Each unit's bucket is released after its forward; the parameters outside the units
    (embedding, output layer, final norm: Megatron-FSDP's first bucket) are all-gathered at each of those
    modules' forward with ``prefetch=True`` where the module is not PRE_BACKWARD, and the prefetch takes
    the buckets after the first in forward order (up to 500M elements): at the output layer, every layer's.
    ``_root_pre_backward`` marks PRE_BACKWARD only the FSDP units in 0.16.1 and 0.17.1 (the post-backward hook
    resets them), so those modules prefetch at every step: True. 0.18.2 and 0.19.2 mark every submodule and the
    post-backward hook resets only the units' own, so the modules outside the units stay PRE_BACKWARD and
    gather without prefetch from the second step on: False. Measured: the local-spec tiny GPT at DP 2
    (saved storages at the third step's forward end: one layer's 82,432-byte bucket alive on 0.17.1, freed
    on 0.18.2; the output layer's all-gather ``prefetch=True`` at step 3 on 0.17.1, False on 0.18.2), and
    compare's llama DP 2 optim_grads_params: megatron's arm 32,086,528 bytes of activations on 0.16.1 and
    0.17.1, 29,248,000 (the layers' buckets, 2,838,528, left out) on 0.18.2 and 0.19.2. Checked as the
    ``PRE_BACKWARD`` assignment in ``_root_pre_backward``'s loop over ``modules()`` under an ``isinstance``
    test. Inside :func:`as_measured_on` the record's release answers (before 0.18)."""
    if _recent:
        return _recent[-1].release < (0, 18)
    return _installed_megatron_fsdp_regathers_the_units_at_the_forward_end()


_DDP_CONFIG = "distributed/distributed_data_parallel_config.py"
MAIN_DTYPE_FIELDS = ("megatron_fsdp_main_params_dtype", "megatron_fsdp_main_grads_dtype")
"""``DistributedDataParallelConfig``'s Megatron-FSDP dtype fields (Megatron-LM's ``--megatron-fsdp-main-params-dtype``
and ``--megatron-fsdp-main-grads-dtype``)."""


@functools.cache
def _installed_megatron_fsdp_has_main_dtype_fields() -> bool:
    config = _class(_DDP_CONFIG, "DistributedDataParallelConfig")
    return config is not None and all(_member(config.body, name) is not None for name in MAIN_DTYPE_FIELDS)


def megatron_fsdp_has_main_dtype_fields() -> bool:
    """Whether Megatron-FSDP's buffers take their dtypes from ``DistributedDataParallelConfig.
    megatron_fsdp_main_params_dtype`` (the main-weight buffer's; None: no main-weight buffer, the optimizer steps
    the model-weight buffer's shard) and ``megatron_fsdp_main_grads_dtype`` (the main-grad buffer's; None: the
    parameters' dtype), Megatron-LM's ``--megatron-fsdp-main-params-dtype`` / ``--megatron-fsdp-main-grads-dtype``
    (``fp32``/``bf16``/``fp16``/``auto``, ``auto`` being None). Read in the wheels: 0.17.1, 0.18.2 and 0.19.2 have
    both fields (the adapter builds its ``MixedPrecisionPolicy`` of them; 0.17 and 0.18 still make the gradients
    fp32 under ``grad_reduce_in_fp32``: :func:`megatron_fsdp_grads_follow_grad_reduce_in_fp32`); 0.16.1 has
    neither (``preserve_fp32_weights`` and ``grad_reduce_in_fp32`` decide). Checked as both fields declared on the
    dataclass; inside :func:`as_measured_on` the record's release answers (0.17 and later)."""
    if _recent:
        return _recent[-1].release >= (0, 17)
    return _installed_megatron_fsdp_has_main_dtype_fields()


def _compares_type_to_cuda_float(node: ast.AST) -> bool:
    """Whether ``node`` is ``<x>.grad.type() == 'torch.cuda.FloatTensor'``."""
    if not (isinstance(node, ast.Compare) and len(node.comparators) == 1 and isinstance(node.ops[0], ast.Eq)):
        return False
    left, right = node.left, node.comparators[0]
    called = isinstance(left, ast.Call) and isinstance(left.func, ast.Attribute) and left.func.attr == "type"
    return (
        called
        and _names_attribute(left.func.value, "grad")
        and isinstance(right, ast.Constant)
        and right.value == "torch.cuda.FloatTensor"
    )


@functools.cache
def _installed_clip_asserts_fp32_grads() -> bool:
    tree = _tree("optimizer/clip_grads.py")
    clip = _member(tree.body, "clip_grad_by_total_norm_fp32") if tree is not None else None
    if not isinstance(clip, ast.FunctionDef):
        return True  # not readable: 0.16's
    return any(isinstance(n, ast.Assert) and _compares_type_to_cuda_float(n.test) for n in ast.walk(clip))


def clip_asserts_fp32_grads() -> bool:
    """Whether megatron's gradient clipping (``clip_grad_by_total_norm_fp32``, optimizer/clip_grads.py, run at every
    step where ``--clip-grad`` > 0, Megatron-LM's default 1.0) asserts that each optimizer parameter's ``.grad`` is
    fp32 (``assert param.grad.type() == 'torch.cuda.FloatTensor'``; a parameter's ``.decoupled_grad`` may be fp32 or
    bf16). Read in 0.16.1, 0.17.1 and 0.19.2: all of them. Under Megatron-FSDP the ``.grad`` is the gradient shard
    cast to the main-weight buffer's dtype, or the main-grad buffer's own without one: a bf16 or fp16 main-weight
    buffer, or none (``auto``) over bf16 gradients, stops the first step there (compare, llama DP 2
    optim_grads_params ``--megatron-fsdp-main-params-dtype auto`` on 0.19.2: this AssertionError at the first
    step). Checked
    as that assert in the function; inside :func:`as_measured_on`, every release 0.16-0.19."""
    if _recent:
        return True
    return _installed_clip_asserts_fp32_grads()


@functools.cache
def _installed_megatron_fsdp_has_decoupled_grad_field() -> bool:
    config = _class(_DDP_CONFIG, "DistributedDataParallelConfig")
    return config is not None and _member(config.body, "megatron_fsdp_use_decoupled_grad") is not None


def megatron_fsdp_has_decoupled_grad_field() -> bool:
    """Whether Megatron-FSDP can hand the precision-aware optimizer its gradients:
    ``DistributedDataParallelConfig.megatron_fsdp_use_decoupled_grad`` (0.18.2, 0.19.2; Megatron-LM 0.18+ sets it to
    ``--use-precision-aware-optimizer``) makes ``update_main_grads`` write each shard, uncast, to the optimizer
    parameter's ``.decoupled_grad``, which the precision-aware Adam reads. 0.16.1 and 0.17.1 have no such field: their
    ``update_main_grads`` writes ``.decoupled_grad`` only where the buffer's ``use_precision_aware_optimizer``
    attribute is set, which nothing in megatron-core sets, so the precision-aware Adam (``use_decoupled_grad``) finds
    no gradient and updates no weight (megatron-fsdp-lean-state makes that link on those releases). Checked as the
    field declared on the dataclass; inside :func:`as_measured_on` the record's release answers (0.18 and later)."""
    if _recent:
        return _recent[-1].release >= (0, 18)
    return _installed_megatron_fsdp_has_decoupled_grad_field()
