"""Issue 28's resume fixes without Megatron-LM (default lane, every megatron-core of the version lane).

* ``fix-distopt-padding-flag`` (item 1): the bucket formats' ``padding`` flag never reaches a
  precision-aware optimizer as a state;
* ``fix-decoupled-lr-resume`` (item 2): parameter groups sharing megatron's pairing tuple are
  paired with their own checkpoint group;
* ``fix-training-log-first-iteration`` (item 8): a first iteration on the log interval resets the
  loss sums.

Each fix's ``versions=`` is checked against the installed megatron-core itself: the fix is
declared for this release exactly when this release has the bug (read from megatron's code or run
on a stand-in ``self``), and the engine applies it exactly then. The end-to-end acceptance (train,
save, resume through pretrain_gpt.py) is tests/reliability/test_megatron_lm_resume.py (opt-in).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import types

import pytest
import torch
import wrapt
from packaging.specifiers import SpecifierSet

from mindspeed_like import runtime
from mindspeed_like.fixes import decoupled_lr_resume, distopt_padding_flag, training_log_first_iteration
from mindspeed_like.megatron_version import megatron_core_version
from mindspeed_like.toolkit.targets import DISTRIB_OPTIMIZER, OPTIMIZER, TRAINING_LOOP

VERSION = megatron_core_version()


def claimed(fix) -> bool:
    """Whether ``fix`` declares itself for the installed megatron-core."""
    return SpecifierSet(fix.VERSIONS).contains(VERSION, prereleases=True)


def applied(feature: str, target: str) -> bool:
    return any(r.feature == feature and r.target == target and r.status == "applied" for r in runtime.ENGINE.report())


# --- item 1: fix-distopt-padding-flag -------------------------------------------------------------


class _Adam:
    """The precision-aware optimizer's interface megatron calls; records every state it is given."""

    def __init__(self, param):
        self.param_groups = [{"params": [param]}]
        self.state = {param: {}}
        self.given: dict[str, object] = {}

    def set_scaled_state(self, param, key, value):
        if not isinstance(value, torch.Tensor):
            raise KeyError(key)  # ours: PrecisionAwareAdam has no such state (TE: AttributeError on .dtype)
        self.given[key] = value


def _distopt_self(precision_aware: bool):
    """What megatron's ``_set_main_param_and_optimizer_states`` reads of ``self``, in every release."""
    model_param = torch.nn.Parameter(torch.zeros(4))
    return model_param, types.SimpleNamespace(
        config=types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=precision_aware),
        ddp_config=types.SimpleNamespace(use_custom_fsdp=False, use_megatron_fsdp=False),
        model_param_group_index_map={model_param: (0, 0)},
        optimizer=_Adam(torch.nn.Parameter(torch.zeros(4))),
    )


def _loaded_entry() -> dict:
    """One parameter's dict as the bucket formats load it: its tensors and the ``padding`` flag."""
    return {
        "param": torch.ones(4),
        "exp_avg": torch.full((4,), 2.0),
        "exp_avg_sq": torch.full((4,), 3.0),
        "padding": False,
    }


def _megatrons_method():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return inspect.unwrap(inspect.getattr_static(DistributedOptimizer, "_set_main_param_and_optimizer_states"))


def test_only_tensors_drops_the_flag_and_keeps_every_state():
    entry = _loaded_entry()
    kept = distopt_padding_flag.only_tensors(entry)
    assert list(kept) == ["param", "exp_avg", "exp_avg_sq"]
    assert all(kept[key] is entry[key] for key in kept)
    assert distopt_padding_flag.only_tensors({}) == {}


def test_megatron_hands_the_flag_to_the_optimizer_exactly_on_the_releases_the_fix_claims():
    """megatron's own method, on the installed release, with a stand-in ``self``: before 0.17 the
    ``padding`` flag reaches ``set_scaled_state`` (the KeyError of the issue); from 0.17 megatron
    skips it. The fix is declared for exactly the releases with the bug."""
    model_param, instance = _distopt_self(precision_aware=True)
    try:
        _megatrons_method()(instance, model_param, _loaded_entry())
        bug = False
    except KeyError as error:
        assert error.args == ("padding",)
        bug = True
    assert bug == claimed(distopt_padding_flag), (
        f"megatron-core {VERSION}: bug {bug}, fix declared {distopt_padding_flag.VERSIONS}"
    )


def test_with_the_fix_every_state_and_no_flag_reaches_the_optimizer():
    model_param, instance = _distopt_self(precision_aware=True)
    wrapped = functools.partial(_megatrons_method(), instance)
    distopt_padding_flag._set_states_without_flags(wrapped, instance, (model_param, _loaded_entry()), {})
    assert sorted(instance.optimizer.given) == ["exp_avg", "exp_avg_sq", "master_param"]
    assert torch.equal(instance.optimizer.given["master_param"], torch.ones(4))


def test_without_precision_aware_states_megatron_gets_the_entry_unchanged():
    """megatron's fp32-master branch copies only its own state's keys: the dict is passed as loaded."""
    seen = []
    _, instance = _distopt_self(precision_aware=False)
    entry = _loaded_entry()
    distopt_padding_flag._set_states_without_flags(lambda p, t: seen.append(t), instance, ("p", entry), {})
    assert seen == [entry] and seen[0] is entry


def test_padding_fix_is_applied_exactly_on_its_releases(adaptor):
    import megatron.core.optimizer.distrib_optimizer  # noqa: F401  (the target's module, imported)

    target = f"{distopt_padding_flag.DISTOPT}._set_main_param_and_optimizer_states"
    assert applied(distopt_padding_flag.FEATURE.name, target) == claimed(distopt_padding_flag)


# --- item 2: fix-decoupled-lr-resume --------------------------------------------------------------

# megatron-core 0.16's pairing keys and 0.19's (ParamGroupOverride's fields, then the flags): fixed
# here so the pairing is tested on every release; the installed ones are checked below.
KEYS_0_16 = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
IDENTITY_0_19 = (
    "end_wd",
    "max_lr",
    "min_lr",
    "start_wd",
    "wd_mult",
    "lr_mult",
    "is_expert_parallel",
    "is_decoupled_lr",
)
FLAGS = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}


def _group(max_lr, min_lr, params, wd_mult=1.0, **extra):
    return {**FLAGS, "wd_mult": wd_mult, "max_lr": max_lr, "min_lr": min_lr, "params": params, **extra}


@pytest.fixture
def keys_0_16(monkeypatch):
    monkeypatch.setattr(decoupled_lr_resume, "megatron_keys", lambda: KEYS_0_16)
    monkeypatch.setattr(decoupled_lr_resume, "identity_keys", lambda: IDENTITY_0_19)


def test_pair_groups_tells_colliding_tuples_apart_by_their_learning_rates(keys_0_16):
    """0.16's decoupled group: the default group's tuple with another max_lr/min_lr."""
    saved = [_group(1e-3, 0.0, [0, 1]), _group(5e-4, 4.5e-5, [2]), _group(1e-3, 0.0, [3], wd_mult=0.0)]
    current = [_group(1e-3, 0.0, ["a", "b"]), _group(5e-4, 4.5e-5, ["c"]), _group(1e-3, 0.0, ["d"], wd_mult=0.0)]
    assert decoupled_lr_resume.pair_groups(current, saved) == [0, 1, 2]
    assert decoupled_lr_resume.pair_groups(current[::-1], saved) == [2, 1, 0]


def test_pair_groups_leaves_unambiguous_checkpoints_to_megatron(keys_0_16):
    saved = [_group(1e-3, 0.0, [0]), _group(1e-3, 0.0, [1], wd_mult=0.0)]
    assert decoupled_lr_resume.pair_groups([_group(1e-3, 0.0, []), _group(1e-3, 0.0, [], wd_mult=0.0)], saved) is None
    assert decoupled_lr_resume.pair_groups([], []) is None


def test_pair_groups_accepts_nemos_pre_spelling(keys_0_16):
    nemo = {k: v for k, v in _group(5e-4, 4.5e-5, [1]).items() if k not in ("wd_mult", "lr_mult")}
    nemo.update(pre_wd_mult=1.0, pre_lr_mult=1.0)
    saved = [_group(1e-3, 0.0, [0]), nemo]
    assert decoupled_lr_resume.pair_groups([nemo, _group(1e-3, 0.0, [])], saved) == [1, 0]


def test_pair_groups_refuses_a_changed_learning_rate_by_name(keys_0_16):
    saved = [_group(1e-3, 0.0, [0]), _group(5e-4, 4.5e-5, [1])]
    with pytest.raises(ValueError, match="--decoupled-lr"):
        decoupled_lr_resume.pair_groups([_group(1e-3, 0.0, []), _group(2e-4, 4.5e-5, [])], saved)


def test_pair_groups_unknown_tuple_is_left_to_megatrons_error(keys_0_16):
    saved = [_group(1e-3, 0.0, [0]), _group(5e-4, 4.5e-5, [1])]
    assert decoupled_lr_resume.pair_groups([_group(1e-3, 0.0, [], wd_mult=0.5)], saved) is None


def _megatron_reorder(current, saved):
    """0.16's ``_filter_and_reorder_param_groups``: pairs through a dict keyed by the tuple (last wins)."""
    key = functools.partial(decoupled_lr_resume.group_key, keys=KEYS_0_16)
    loaded = {key(group): group for group in saved}
    result = []
    for needed, params in zip([key(g) for g in current], [g["params"] for g in saved]):
        group = loaded[needed]
        group["params"] = params
        result.append(group)
    return result


def test_float16_optimizer_groups_get_their_own_hyperparameters_in_distinct_dicts(keys_0_16):
    current = [_group(1e-3, 0.0, ["a", "b"]), _group(5e-4, 4.5e-5, ["c"])]
    wrong = _megatron_reorder(current, [_group(1e-3, 0.0, [0, 1]), _group(5e-4, 4.5e-5, [2])])
    assert wrong[0] is wrong[1]  # megatron's: one dict twice (torch: "doesn't match the size")
    saved = [_group(1e-3, 0.0, [0, 1]), _group(5e-4, 4.5e-5, [2])]
    right = decoupled_lr_resume._reorder_groups(_megatron_reorder, None, (current, saved), {})
    assert right[0] is not right[1]
    assert [(g["max_lr"], g["min_lr"], g["params"]) for g in right] == [(1e-3, 0.0, [0, 1]), (5e-4, 4.5e-5, [2])]


def test_distributed_optimizer_groups_get_their_own_hyperparameters_after_megatrons_load(keys_0_16):
    saved = [_group(1e-3, 0.0, None, lr=7e-4), _group(5e-4, 4.5e-5, None, lr=3e-4)]
    instance = types.SimpleNamespace(
        ddp_config=types.SimpleNamespace(use_megatron_fsdp=False),
        optimizer=types.SimpleNamespace(param_groups=[_group(1e-3, 0.0, ["a"]), _group(5e-4, 4.5e-5, ["b"])]),
    )

    def megatron_load(state_dict):  # 0.16: the running group takes the dict-picked checkpoint group's values
        key = functools.partial(decoupled_lr_resume.group_key, keys=KEYS_0_16)
        picked = {key(g): g for g in state_dict["optimizer"]["param_groups"]}
        for group in instance.optimizer.param_groups:
            group.update({k: v for k, v in picked[key(group)].items() if k != "params"})

    state_dict = {"optimizer": {"param_groups": saved}}
    decoupled_lr_resume._load_with_own_groups(megatron_load, instance, (state_dict,), {})
    groups = instance.optimizer.param_groups
    assert [(g["max_lr"], g["min_lr"], g["lr"], g["params"]) for g in groups] == [
        (1e-3, 0.0, 7e-4, ["a"]),
        (5e-4, 4.5e-5, 3e-4, ["b"]),
    ]


def test_decoupled_lr_groups_collide_exactly_on_the_releases_the_fix_claims():
    """The bug needs both: the decoupled group no longer marked ``is_decoupled_lr`` (0.16: a max_lr
    override) and a pairing tuple without ``max_lr`` (added in 0.19)."""
    from megatron.core import optimizer

    optimizer_module = sys.modules[OPTIMIZER]
    unmarked = "is_decoupled_lr = True" not in inspect.getsource(optimizer._get_param_groups)
    pairs_by_lr = "max_lr" in optimizer_module.param_group_identifier_keys
    bug = unmarked and not pairs_by_lr
    assert bug == claimed(decoupled_lr_resume), (
        f"megatron-core {VERSION}: bug {bug}, fix declared {decoupled_lr_resume.VERSIONS}"
    )
    if bug:  # the fix reads both key lists from the installed megatron
        assert decoupled_lr_resume.megatron_keys() == KEYS_0_16
        assert {"max_lr", "min_lr"} <= set(decoupled_lr_resume.identity_keys())


def test_decoupled_lr_fix_is_applied_exactly_on_its_releases(adaptor):
    import megatron.core.optimizer.distrib_optimizer  # noqa: F401

    name = decoupled_lr_resume.FEATURE.name
    assert applied(name, f"{OPTIMIZER}.MegatronOptimizer._filter_and_reorder_param_groups") == claimed(
        decoupled_lr_resume
    )
    assert applied(name, f"{DISTRIB_OPTIMIZER}.DistributedOptimizer.load_state_dict") == claimed(decoupled_lr_resume)


# --- item 8: fix-training-log-first-iteration -----------------------------------------------------


def test_regular_print():
    regular = training_log_first_iteration.regular_print
    assert regular(4, 1) and regular(10, 5) and not regular(4, 3) and not regular(1, 100)
    assert not regular(4, 0) and not regular(4, None)  # no interval: never a regular print


class _Log:
    """megatron's (0.16+) ``training_log`` accounting: sums every iteration's loss, prints their
    mean on the interval or on the first iteration, resets unless it was the first iteration."""

    def __init__(self, log_interval: int):
        self.log_interval, self.printed, self.sums = log_interval, {}, {}

    def training_log(self, loss_dict, total_loss_dict, iteration, is_first_iteration=False):
        for key, value in loss_dict.items():
            total_loss_dict[key] = total_loss_dict.get(key, 0.0) + value
        total_loss_dict["iterations"] = total_loss_dict.get("iterations", 0) + 1
        if iteration % self.log_interval == 0 or is_first_iteration:
            self.printed[iteration] = total_loss_dict["lm loss"] / total_loss_dict["iterations"]
            if not is_first_iteration:  # megatron: should_reset = not is_first_iteration
                total_loss_dict.clear()


LOSSES = {1: 5.5, 2: 5.25, 3: 5.0, 4: 4.5, 5: 4.25, 6: 4.0}


def _train(log: _Log, first: int, last: int, fixed: bool, monkeypatch) -> dict:
    monkeypatch.setitem(
        sys.modules,
        TRAINING_LOOP,
        types.SimpleNamespace(get_args=lambda: types.SimpleNamespace(log_interval=log.log_interval)),
    )
    fn = log.training_log
    if fixed:
        fn = wrapt.FunctionWrapper(fn, training_log_first_iteration._first_iteration_on_the_interval_resets)
    total: dict = {}
    for iteration in range(first, last + 1):
        fn({"lm loss": LOSSES[iteration]}, total, iteration, is_first_iteration=iteration == first)
    return log.printed


def test_resumed_run_prints_each_iterations_own_loss(monkeypatch):
    """Resumed from 3 at --log-interval 1: megatron prints iteration 5 as the mean of 4 and 5."""
    assert _train(_Log(1), 4, 6, fixed=False, monkeypatch=monkeypatch)[5] == (LOSSES[4] + LOSSES[5]) / 2
    assert _train(_Log(1), 4, 6, fixed=True, monkeypatch=monkeypatch) == {i: LOSSES[i] for i in (4, 5, 6)}


def test_first_iteration_off_the_interval_keeps_megatrons_extra_print(monkeypatch):
    """Iteration 1 at --log-interval 2 is an extra print; the regular one at 2 averages 1-2, as megatron meant."""
    expected = {1: LOSSES[1], 2: (LOSSES[1] + LOSSES[2]) / 2, 4: (LOSSES[3] + LOSSES[4]) / 2}
    assert _train(_Log(2), 1, 4, fixed=True, monkeypatch=monkeypatch) == expected
    assert _train(_Log(2), 1, 4, fixed=False, monkeypatch=monkeypatch) == expected


def _training_py() -> str | None:
    """megatron.training's training.py: in the wheel from 0.17, else the MEGATRON_LM_PATH checkout."""
    import megatron.core

    candidates = [os.path.join(os.path.dirname(os.path.dirname(megatron.core.__file__)), "training", "training.py")]
    if os.environ.get("MEGATRON_LM_PATH"):
        candidates.append(os.path.join(os.environ["MEGATRON_LM_PATH"], "megatron", "training", "training.py"))
    return next((path for path in candidates if os.path.isfile(path)), None)


def test_first_iteration_is_counted_twice_exactly_on_the_releases_the_fix_claims():
    path = _training_py()
    if path is None:
        pytest.skip(f"megatron-core {VERSION} has no megatron.training (a Megatron-LM checkout: MEGATRON_LM_PATH)")
    with open(path, encoding="utf-8") as handle:
        source = handle.read()
    bug = "should_reset = not is_first_iteration" in source and "or is_first_iteration" in source
    claim = claimed(training_log_first_iteration)
    assert bug == claim, f"{path}: bug {bug}, fix declared {training_log_first_iteration.VERSIONS}"
