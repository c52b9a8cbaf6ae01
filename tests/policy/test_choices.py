"""`canzona.choices.check_choice`: the one "unknown X 'y'; choose one of a, b, c" check, and the
options that use it keep their messages word for word."""

from __future__ import annotations

import re

import pytest

from canzona.choices import check_choice
from canzona.errors import CanzonaError, PlanError, SpecError


def test_a_known_value_comes_back_unchanged():
    assert check_choice("b", ("a", "b", "c"), "mode") == "b"
    assert check_choice("y", {"x": 1, "y": 2}, "policy") == "y"  # a dict: its keys


def test_an_unknown_value_names_the_option_the_value_and_every_choice_in_order():
    with pytest.raises(SpecError) as e:
        check_choice("d", ("c", "a", "b"), "TP mode")
    assert str(e.value) == "unknown TP mode 'd'; choose one of c, a, b"
    with pytest.raises(SpecError) as e:
        check_choice("z", {"x": 1, "y": 2}, "DP policy")
    assert str(e.value) == "unknown DP policy 'z'; choose one of x, y"


def test_the_error_type_the_place_and_a_note():
    with pytest.raises(PlanError) as e:
        check_choice("q", ("a",), "DP policy", error=PlanError, where="dp_plan", note=" or all")
    assert str(e.value) == "dp_plan: unknown DP policy 'q'; choose one of a or all"
    with pytest.raises(CanzonaError) as e:
        check_choice("tpu", ("cpu", "cuda"), "device", error=CanzonaError)
    assert type(e.value) is CanzonaError


def test_a_value_of_another_type_is_refused_with_its_repr():
    with pytest.raises(SpecError, match=re.escape("unknown kernels 3; choose one of fused, eager")):
        check_choice(3, ("fused", "eager"), "kernels")
    with pytest.raises(SpecError, match=re.escape("unknown kernels None;")):
        check_choice(None, ("fused", "eager"), "kernels")


# each option's check, a bad value, and the message it gave before it used `check_choice`, written
# out with the option's own list of names
@pytest.mark.parametrize("check, bad, names, message", [
    ("canzona.reductions:check_reduce_scatter", "ring", "canzona.reductions:REDUCE_SCATTER_IMPLS",
     "unknown reduce_scatter 'ring'; choose one of {} ({HELP})"),
    ("canzona.recompute:check_recompute", "half", "canzona.recompute:RECOMPUTE_MODES",
     "unknown recompute mode 'half'; choose one of {}"),
    ("canzona.tp:check_tp_policy", "x", "canzona.tp:TP_REGISTRY", "unknown TP policy 'x'; choose one of {}"),
    ("canzona.dp.policies:check_dp_policy", "x", "canzona.dp.policies:DP_REGISTRY",
     "unknown DP policy 'x'; choose one of {}"),
    ("canzona.dp.layout:check_expert_buckets", "x", "canzona.dp.layout:EXPERT_BUCKETS",
     "unknown expert bucket sizing 'x'; choose one of {}"),
    ("canzona.plan:check_geometry", "x", "canzona.plan:GEOMETRIES", "unknown geometry 'x'; choose one of {}"),
    ("canzona.optimizers:check_matrix_optimizer", "SGD", "canzona.optimizers:MATRIX_REGISTRY",
     "unknown optimizer 'sgd'; choose one of {}"),
    ("canzona.step_schedule:check_tp_mode", "x", "canzona.step_schedule:TP_MODES", "unknown TP mode 'x'; choose one of {}"),
    ("canzona.step_policies:get_step_policy", "x", "canzona.step_policies:STEP_POLICIES",
     "unknown policy 'x'; choose one of {}"),
    ("sim.eager_kernels:check_kernels", "x", "sim.eager_kernels:KERNEL_MODES", "unknown kernels 'x'; choose one of {}"),
    ("sim.fsdp_copies:check_fsdp_impl", "x", "sim.fsdp_copies:FSDP_IMPLS",
     "unknown fsdp implementation 'x'; choose one of {}"),
])
def test_the_options_that_use_it_keep_their_messages(check, bad, names, message):
    import importlib

    def get(where):
        module, name = where.split(":")
        return getattr(importlib.import_module(module), name)

    with pytest.raises(SpecError) as e:
        get(check)(bad)
    help_text = get("canzona.reductions:HELP")
    assert str(e.value) == message.replace("{}", ", ".join(get(names))).replace("{HELP}", help_text)
    assert ", " in str(e.value)  # more than one name listed
