"""hybrid_cp_algo's process groups from ``--ulysses-degree-in-cp N`` alone (groups.py): the sizes
and their validation, the initialize_model_parallel wrapper, the Megatron-LM validate_args hook,
configure() before and after megatron's parallel state. CP=4 hybrid 2x2 equal to CP=1 with no
hierarchical sizes passed: test_context_parallel_gpt.py; Megatron-LM's command line:
test_context_parallel_megatron_lm.py."""

from __future__ import annotations

import argparse

import pytest

import mindspeed_like
from mindspeed_like.features.context_parallel import FEATURE, groups
from mindspeed_like.testing import destroy_parallel, init_parallel, run_distributed
from mindspeed_like.toolkit.errors import ConfigError

HYBRID = "hybrid_cp_algo"


@pytest.fixture(autouse=True)
def _reset():
    yield
    mindspeed_like.reset()


@pytest.mark.parametrize(("degree", "cp", "sizes"), [(2, 4, [2, 2]), (1, 4, [1, 4]), (4, 4, [4, 1]), (2, 8, [2, 4])])
def test_sizes_from_the_degree(degree, cp, sizes):
    assert groups.hierarchical_sizes(degree, cp) == sizes
    assert groups.check_sizes(degree, cp, None) == sizes
    assert groups.check_sizes(degree, cp, sizes) == sizes  # megatron's own flag, agreeing


@pytest.mark.parametrize(("degree", "cp"), [(3, 4), (8, 4), (0, 4)])
def test_a_degree_that_does_not_divide_cp_names_the_divisors(degree, cp):
    with pytest.raises(ConfigError, match=rf"--ulysses-degree-in-cp {degree} does not divide.*one of 1, 2, 4"):
        groups.hierarchical_sizes(degree, cp)


def test_megatrons_sizes_that_disagree_are_refused():
    with pytest.raises(ConfigError, match="--hierarchical-context-parallel-sizes 4 1 disagrees"):
        groups.check_sizes(2, 4, [4, 1])


def test_missing_einops_is_a_config_error(monkeypatch):
    find_spec = groups.importlib.util.find_spec
    monkeypatch.setattr(groups.importlib.util, "find_spec", lambda name: None if name == "einops" else find_spec(name))
    with pytest.raises(ConfigError, match="pip install einops"):
        groups.check_sizes(2, 4, None)


def _initialize(context_parallel_size=1, hierarchical_context_parallel_sizes=None):
    return hierarchical_context_parallel_sizes


def _initialize_without_sizes(context_parallel_size=1):
    return "megatron's own"


def test_wrapper_passes_the_sizes_megatron_was_not_given():
    wrapper = groups.HierarchicalGroups(2)
    assert wrapper(_initialize, None, (), dict(context_parallel_size=4)) == [2, 2]
    assert wrapper(_initialize, None, (4,), {}) == [2, 2]  # by position too
    agreeing = dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
    assert wrapper(_initialize, None, (), agreeing) == [2, 2]
    assert wrapper(_initialize, None, (), dict(context_parallel_size=1)) is None  # CP=1: untouched
    assert wrapper(_initialize_without_sizes, None, (), dict(context_parallel_size=4)) == "megatron's own"
    with pytest.raises(ConfigError, match="does not divide --context-parallel-size 4"):
        groups.HierarchicalGroups(3)(_initialize, None, (), dict(context_parallel_size=4))


def _megatron_args(**values):
    base = dict(context_parallel_algo=HYBRID, ulysses_degree_in_cp=2, context_parallel_size=4)
    base["hierarchical_context_parallel_sizes"] = None
    return argparse.Namespace(**{**base, **values})


def test_validate_args_hook_sets_megatrons_sizes_before_validation():
    args = _megatron_args()
    with groups.check_megatron_args(args):
        assert args.hierarchical_context_parallel_sizes == [2, 2]  # what megatron validates, logs and passes
    for untouched in (_megatron_args(context_parallel_algo="megatron_cp_algo", ulysses_degree_in_cp=None),
                      _megatron_args(context_parallel_size=1)):  # fmt: skip
        with groups.check_megatron_args(untouched):
            assert untouched.hierarchical_context_parallel_sizes is None


def test_validate_args_hook_refuses_a_bad_degree_before_validation():
    entered = []
    with pytest.raises(ConfigError, match="--ulysses-degree-in-cp 3 does not divide --context-parallel-size 4"):
        with groups.check_megatron_args(_megatron_args(ulysses_degree_in_cp=3)):
            entered.append(True)  # megatron's validate_args would run here
    assert not entered
    with pytest.raises(ConfigError, match="disagrees"):
        with groups.check_megatron_args(_megatron_args(hierarchical_context_parallel_sizes=[1, 4])):
            pass


def test_declaration_wires_the_wrapper_the_hook_and_the_help():
    from types import SimpleNamespace

    from megatron.core import parallel_state

    from mindspeed_like.features.context_parallel import megatron_args_hook

    assert FEATURE.validate_args_hook is megatron_args_hook  # groups.check_megatron_args inside it
    args = SimpleNamespace(
        context_parallel_algo=HYBRID,
        context_parallel_size=4,
        ulysses_degree_in_cp=2,
        hierarchical_context_parallel_sizes=None,
    )
    with megatron_args_hook(args):
        assert args.hierarchical_context_parallel_sizes == [2, 2]
    help_text = {f.name: f.help for f in FEATURE.flags}["ulysses_degree_in_cp"]
    assert "built from it" in help_text and "needed" in help_text
    original = parallel_state.initialize_model_parallel
    mindspeed_like.configure(device="cpu", context_parallel_algo="megatron_cp_algo")
    assert parallel_state.initialize_model_parallel is original  # only hybrid wraps it
    mindspeed_like.configure(device="cpu", context_parallel_algo=HYBRID, ulysses_degree_in_cp=2)
    assert parallel_state.initialize_model_parallel._self_wrapper == groups.HierarchicalGroups(2)
    mindspeed_like.reset()
    assert parallel_state.initialize_model_parallel is original


def configure_worker() -> dict:
    """2 processes, no model: configure() before and after megatron's parallel state at CP=2."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    out = {}

    def error_of(action):
        try:
            action()
        except ConfigError as error:
            return str(error)
        return None

    # configured first: initialize_model_parallel builds the groups from the degree alone
    mindspeed_like.configure(device="cpu", context_parallel_algo=HYBRID, ulysses_degree_in_cp=2)
    init_parallel(context_parallel_size=2)
    out["built"] = [dist.get_world_size(g) for g in parallel_state.get_hierarchical_context_parallel_groups()]
    out["configure_again"] = error_of(lambda: mindspeed_like.configure(ulysses_degree_in_cp=2))
    out["configure_bad_degree_after"] = error_of(lambda: mindspeed_like.configure(ulysses_degree_in_cp=3))
    destroy_parallel()
    # a bad degree configured first: initialize_model_parallel refuses it, before any group or model
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu", context_parallel_algo=HYBRID, ulysses_degree_in_cp=3)
    out["init_bad_degree"] = error_of(lambda: init_parallel(context_parallel_size=2))
    out["initialized_after_refusal"] = parallel_state.model_parallel_is_initialized()
    # initialized without hybrid (so without the groups; megatron keeps its destroyed list): configure() says so
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    init_parallel(context_parallel_size=2)
    out["configure_after_plain_init"] = error_of(
        lambda: mindspeed_like.configure(context_parallel_algo=HYBRID, ulysses_degree_in_cp=2)
    )
    destroy_parallel()
    mindspeed_like.reset()
    return out


@pytest.mark.slow
def test_configure_before_and_after_megatrons_parallel_state():
    for rank in run_distributed(configure_worker, 2, timeout=300):
        assert rank["built"] == [2, 1]  # Ulysses over both CP ranks, a ring of one
        assert rank["configure_again"] is None
        bad = "--ulysses-degree-in-cp 3 does not divide --context-parallel-size 2"
        assert bad in rank["configure_bad_degree_after"] and bad in rank["init_bad_degree"]
        assert not rank["initialized_after_refusal"]
        assert "initialized before mindspeed_like was configured" in rank["configure_after_plain_init"]
        assert "sizes none" in rank["configure_after_plain_init"]


def test_bind_reads_a_method_called_through_its_class():
    """``Base.forward(self, q, k, ...)`` (te_backend's TEDotProductAttention calls megatron's this
    way) reaches a wrapper as wrapt's partial holding the instance: arguments bind by name unshifted."""
    import wrapt

    from mindspeed_like.features.context_parallel.attention import bind

    seen = []

    def wrapper(wrapped, instance, args, kwargs):
        call = bind(wrapped, args, kwargs)
        seen.append((instance, call["query"], call["key"], call["mask"]))
        return call(key="k2")

    class Base:
        def forward(self, query, key, mask=None):
            return (self, query, key, mask)

    Base.forward = wrapt.FunctionWrapper(Base.forward, wrapper)

    class Sub(Base):
        def forward(self, query, key, mask=None):
            return Base.forward(self, query, key, mask=mask)

    sub = Sub()
    assert sub.forward("q", "k", mask="m") == (sub, "q", "k2", "m")
    assert Base.forward(sub, "q", key="k") == (sub, "q", "k2", None)
    assert seen == [(sub, "q", "k", "m"), (sub, "q", "k", None)]


def test_subclass_constructs_megatrons_attention_at_cp2_through_its_class():
    """A subclass calling ``DotProductAttention.__init__(self, ...)`` at context_parallel_size=2 (as
    te_backend's TEDotProductAttention under Megatron-LM) gets past megatron's CP assertion."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    mindspeed_like.configure(device="cpu")
    init_parallel()
    try:

        class Sub(DotProductAttention):
            def __init__(self, config):
                DotProductAttention.__init__(
                    self, config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
                )

        config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, context_parallel_size=2)
        module = Sub(config)
        assert module.config is config and module.config.context_parallel_size == 2
    finally:
        destroy_parallel()


def test_the_wrapped_target_takes_hierarchical_sizes_in_the_installed_megatron():
    """The version audit reads default flags; hybrid's extra target is checked here, in every
    version lane: it exists and takes the sizes (else hybrid would silently get no groups)."""
    import inspect

    from megatron.core import parallel_state

    from mindspeed_like.testing.declarations import declared_patches

    hybrid = declared_patches("context-parallel", context_parallel_algo=HYBRID, ulysses_degree_in_cp=2)
    targets = [p.target for p in hybrid]
    assert groups.INITIALIZE_MODEL_PARALLEL in targets
    assert groups.INITIALIZE_MODEL_PARALLEL not in [p.target for p in declared_patches("context-parallel")]
    parameters = inspect.signature(parallel_state.initialize_model_parallel).parameters
    assert "hierarchical_context_parallel_sizes" in parameters and "context_parallel_size" in parameters
    assert callable(parallel_state.get_hierarchical_context_parallel_groups)
