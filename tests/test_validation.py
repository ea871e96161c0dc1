"""Option validation of every registered method: exact types and ranges that keep float32 finite. The matrix below
covers every option of every method by its declared type, so an option added later cannot escape it."""

from __future__ import annotations

import re
import types
import typing

import pytest
import torch

import hf_posenc
from hf_posenc import PosEncError
from hf_posenc.config import BIAS_MAX, FLOAT32_MAX, MAX_DISTANCE
from helpers import assert_same_fingerprint, model_fingerprint
from tiny_models import random_ids, tiny_model

# Options some methods require, with valid values (LongRoPE: one factor per frequency of the tiny models).
REQUIRED = {"factor": 2.0, "short_factor": [1.0] * 8, "long_factor": [1.5] * 8}

# Values every option of a type must refuse: bools are not numbers, numbers are not bools, and numbers must be
# finite in float32 (nan, inf, beyond float32's largest, or so small they round to 0).
BAD = {
    bool: [1, 0, 1.0, "True", None],
    int: [True, False, 2.5, 4.0, "3", float("nan"), None, 0, -1],
    float: [True, False, "1.0", None, float("nan"), float("inf"), -float("inf"), 1e39, -1e39, 1e-300],
    str: [1, True, None, "no-such-choice", ["no-such-choice"]],
    list[float]: [None, "1.0", 1.0, [], [True, False], [1.0, None], [float("nan")], [1e39], [1e-300], ["1.0"]],
    dict: [None, "{}", [], 1],
}


def bad_values(annotation) -> list:
    """The bad values for an option's declared type; None is valid where the type allows it."""
    parts = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    optional = type(None) in parts
    values = []
    for part in parts:
        if part is type(None):
            continue
        assert part in BAD, f"no bad values for options of type {part}: add them to BAD"
        values += [v for v in BAD[part] if not (optional and v is None)]
    return values


OPTIONS = [(method, name) for method in hf_posenc.available_methods()
           for name in hf_posenc.get_method(method).config_class.option_names()]


@pytest.mark.parametrize("method,name", OPTIONS)
def test_every_option_refuses_wrong_types_and_non_float32_values(method, name):
    config_class = hf_posenc.get_method(method).config_class
    base = {key: value for key, value in REQUIRED.items() if key in config_class.option_names()}
    config_class(**base)  # the base options are valid
    annotation = typing.get_type_hints(config_class)[name]
    for bad in bad_values(annotation):
        with pytest.raises(PosEncError) as refused:
            config_class(**{**base, name: bad})
        message = str(refused.value)
        assert f"{config_class.__name__}.{name}={bad!r}" in message, message  # names the option and the value
        assert "; pass " in message, message  # and what to pass


# --- the bounds come from the float32 formulas ----------------------------------------------------------------------
@pytest.mark.parametrize("method,options,message", [
    # xPos: the decay over one position, (gamma / (1 + gamma)) ** (1 / scale_base), must stay a normal float32 number.
    ("xpos", {"scale_base": 0.01}, r"XposConfig.scale_base=0.01 is out of range; pass a number from 0.01434408"),
    ("xpos", {"scale_base": 0.02, "gamma": 1e-30}, r"scale_base=0.02 is out of range; pass a number from 0.790935"),
    # ALiBi: slope * distance within the bias range up to 2^24.
    ("alibi", {"slopes": [1e39] * 4}, r"AlibiConfig.slopes=\[1e\+39, 1e\+39, 1e\+39, 1e\+39\] holds 1e\+39"),
    ("alibi", {"slopes": [1e32, 0.5, 0.25, 0.125]}, r"holds 1e\+32, which is out of range; pass a non-empty list"),
    ("alibi", {"slopes": [-0.5, 0.5, 0.25, 0.125]}, r"holds -0.5, which is out of range"),
    # linear: position / factor finite up to 2^24.
    ("linear", {"factor": 1e-300}, r"LinearConfig.factor=1e-300 is too small for float32"),
    ("linear", {"factor": 1e-33}, r"LinearConfig.factor=1e-33 is out of range; pass a number from 4.930380\d*e-32"),
    ("fire", {"c": 1e32}, r"FireConfig.c=1e\+32 is out of range; pass a number from 1.17549435e-38 to "
                          r"2.028240\d*e\+31"),
    ("fire", {"threshold": 2.0 ** 25}, r"FireConfig.threshold=33554432.0 is out of range"),
    ("t5", {"num_buckets": 10 ** 9}, r"T5Config.num_buckets=1000000000 is out of range; pass an integer from 2 to"),
    ("t5", {"init_std": 1e38}, r"T5Config.init_std=1e\+38 is out of range"),
    ("learned", {"init_std": 1e19}, r"LearnedConfig.init_std=1e\+19 is out of range"),
    ("rope", {"theta": 1.00000001}, r"RopeConfig.theta=1.00000001 is out of range; pass a number from 1.00000012"),
    ("sandwich", {"dim": 7}, r"SandwichConfig.dim=7 is out of range; pass an even integer from 2 to 16384"),
    ("yarn", {"factor": 4.0, "attention_factor": 1e20}, r"YarnConfig.attention_factor=1e\+20 is out of range"),
])
def test_values_that_break_float32_are_refused_with_the_bound(method, options, message):
    model = tiny_model("llama")
    before = model_fingerprint(model)
    with pytest.raises(PosEncError, match=message):
        hf_posenc.patch_model(model, method, **options)
    assert_same_fingerprint(before, model_fingerprint(model))


def test_values_at_the_derived_bounds_keep_the_logits_finite():
    """Beyond the bounds float32 broke (ALiBi slopes of 1e39 and a linear factor of 1e-300 gave all-NaN logits);
    at the bounds the logits stay finite."""
    from hf_posenc.methods.alibi import MAX_SLOPE
    from hf_posenc.methods.rope_scaling import LinearConfig

    assert MAX_SLOPE * MAX_DISTANCE == pytest.approx(BIAS_MAX)
    assert LinearConfig.min_factor * FLOAT32_MAX == pytest.approx(MAX_DISTANCE)
    ids = random_ids(2, 24)
    for method, options in [("alibi", {"slopes": [MAX_SLOPE, 1.0, 0.0, 0.5]}),
                            ("linear", {"factor": LinearConfig.min_factor}),
                            ("t5", {"init_std": BIAS_MAX / 8}), ("fire", {"c": FLOAT32_MAX / MAX_DISTANCE})]:
        model = hf_posenc.patch_model(tiny_model("llama"), method, **options)
        with torch.no_grad():
            assert torch.isfinite(model(ids).logits).all(), method


def test_ntk_base_must_fit_float32_for_the_model():
    model = tiny_model("llama")  # theta 10000, rotary dimension 16: base = 1e4 * factor ** (16 / 14)
    largest = (FLOAT32_MAX / 1e4) ** (14 / 16)
    with pytest.raises(PosEncError, match=r"NtkConfig.factor=1e\+31 makes the RoPE base .*; pass a factor up to "
                                          + re.escape(f"{largest:.4g}")):
        hf_posenc.patch_model(model, "ntk", factor=1e31)
    hf_posenc.patch_model(model, "ntk", factor=largest / 2)
    with torch.no_grad():
        assert torch.isfinite(model(random_ids(1, 10)).logits).all()


def test_partial_rotary_factor_must_leave_an_even_rotary_dimension():
    with pytest.raises(PosEncError, match=r"partial_rotary_factor=0.01 rotates 0 of this model's 16 head dimensions"):
        hf_posenc.patch_model(tiny_model("llama"), "yarn", factor=2.0, partial_rotary_factor=0.01)


@pytest.mark.parametrize("method,options", [
    ("learned", {"max_positions": True}), ("alibi", {"slopes": [True, False, True, False]}),
    ("fire", {"threshold": True}), ("linear", {"factor": 2.0, "original_max_position_embeddings": True}),
    ("alibi", {"trainable": 1}), ("t5", {"per_layer": 0}),
])
def test_bools_are_not_numbers_and_numbers_are_not_bools(method, options):
    (name, value), = [(k, v) for k, v in options.items() if k != "factor"]
    with pytest.raises(PosEncError, match=re.escape(f".{name}={value!r} ")):
        hf_posenc.patch_model(tiny_model("llama"), method, **options)


def test_lists_are_stored_as_floats_and_round_trip():
    config = hf_posenc.AlibiConfig(slopes=(1, 0.5, 0.25, 0.125))
    assert config.slopes == [1.0, 0.5, 0.25, 0.125] and all(type(s) is float for s in config.slopes)
    assert hf_posenc.AlibiConfig(**{k: v for k, v in config.to_dict().items() if k != "method"}) == config


# --- every size option has an upper bound (issue 51: mlp_width=10**9 tried to allocate about 40 GB) ----------------
TOO_LARGE = 2 ** 40  # beyond every bound; an unbounded option fails at once allocating it (terabytes)
def is_int_option(method: str, name: str) -> bool:
    hint = typing.get_type_hints(hf_posenc.get_method(method).config_class)[name]
    return int in (typing.get_args(hint) or (hint,))


SIZE_OPTIONS = [(method, name) for method, name in OPTIONS if is_int_option(method, name)]
# Options the bound of another depends on, at values that let that one reach its bound.
AT_BOUND_WITH = {("t5", "num_buckets"): {"max_distance": MAX_DISTANCE}}


def test_the_size_options_are_found():
    assert {("fire", "mlp_width"), ("t5", "num_buckets"), ("sinks", "window"), ("cope", "max_pos")} <= \
        set(SIZE_OPTIONS)


@pytest.mark.parametrize("method,name", SIZE_OPTIONS)
def test_every_size_option_is_bounded_and_the_bound_is_accepted(method, name):
    config_class = hf_posenc.get_method(method).config_class
    base = {key: value for key, value in REQUIRED.items() if key in config_class.option_names()}
    model = tiny_model("llama")
    before = model_fingerprint(model)
    with pytest.raises(PosEncError) as refused:
        hf_posenc.patch_model(model, method, **base, **{name: TOO_LARGE})
    message = str(refused.value)
    assert f"{config_class.__name__}.{name}={TOO_LARGE}" in message, message
    assert_same_fingerprint(before, model_fingerprint(model))
    bound = int(re.search(r"from \d+ to (\d+)", message).group(1))  # the bound is in the message
    assert bound < TOO_LARGE
    config_class(**{**base, **AT_BOUND_WITH.get((method, name), {}), name: bound})  # and accepted


def test_the_largest_width_patches_and_runs():
    from hf_posenc.config import SIZE_BOUNDS

    width = SIZE_BOUNDS["width"][0]
    model = hf_posenc.patch_model(tiny_model("llama"), "fire", mlp_width=width)
    with torch.no_grad():
        assert torch.isfinite(model(random_ids(1, 8)).logits).all()
