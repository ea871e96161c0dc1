"""The method protocol (hf_posenc/methods/base.py): what a method class may define, checked when it is defined, and
the capabilities the engine reads in place of the old getattr fallbacks."""

from __future__ import annotations

import pytest
import torch

import hf_posenc
from hf_posenc import PosEncError
from tiny_models import tiny_model


@pytest.mark.parametrize("body,message", [
    ("def alibi_slope(self, device):\n        return None", r"Misspelt\.alibi_slope is not a capability hf_posenc "
                                                            r"reads; did you mean 'alibi_slopes'\?"),
    ("def bias_tabel(self, layer_idx, n, max_position=None, device=None):\n        return None",
     r"did you mean 'bias_table'\?"),
    ("block_costs = 2.0", r"did you mean 'block_cost'\?"),
    ("rotates_in_attention = True", r"Misspelt\.rotates_in_attention is a capability of RotaryMethod methods, and "
                                    r"Misspelt derives from AttentionBiasMethod"),
])
def test_a_misspelt_or_misplaced_capability_is_refused(body, message):
    namespace = {"hf_posenc": hf_posenc}
    source = f"class Misspelt(hf_posenc.AttentionBiasMethod):\n    {body}\n"
    with pytest.raises(PosEncError, match=message):
        exec(source, namespace)
    assert "Misspelt" not in namespace


def test_an_optional_form_is_read_only_from_a_method_that_derives_from_it():
    """The SDPA forms of a method's scores (kernel_heads, separable_terms, block_near, ...) are mixins beside the kind,
    not capabilities every method carries: defining one without its mixin is refused, with it accepted."""
    from hf_posenc.methods.base import ContentMethod, DotProductForm, capabilities

    assert "kernel_heads" not in capabilities(ContentMethod) and "block_near" not in capabilities(hf_posenc.RotaryMethod)
    with pytest.raises(PosEncError, match=r"NoForm\.kernel_heads is a capability of DotProductForm methods, and NoForm "
                                          r"derives from ContentMethod: it would never be read"):
        class NoForm(ContentMethod):
            def kernel_heads(self, *arguments):
                return None

    class WithForm(DotProductForm, ContentMethod):
        def kernel_heads(self, *arguments):
            return None

    assert issubclass(WithForm, ContentMethod)


def test_a_method_of_two_kinds_and_a_config_that_is_not_a_posenc_config_are_refused():
    with pytest.raises(PosEncError, match="derives from AttentionBiasMethod and RotaryMethod; a method acts in one"):
        class Both(hf_posenc.AttentionBiasMethod, hf_posenc.RotaryMethod):
            pass
    with pytest.raises(PosEncError, match="the config class must be a dataclass subclassing hf_posenc.PosEncConfig"):
        hf_posenc.register_method("not-a-config", dict, hf_posenc.methods.Alibi)
    assert "not-a-config" not in hf_posenc.available_methods()


def test_the_engine_reads_what_the_protocol_declares():
    """Every capability the built-in methods override is declared on their protocol class, and the ALiBi slopes
    reach flash-attn only when fixed (the capability replaces a read of config.trainable)."""
    from hf_posenc.methods.base import capabilities, kind_of

    for name in hf_posenc.available_methods():
        cls = hf_posenc.get_method(name).module_class
        assert {"builds_on", "is_native", "native_config_update", "block_cost"} <= capabilities(kind_of(cls))
    fixed = hf_posenc.get_positional_module(hf_posenc.patch_model(tiny_model("llama"), "alibi"))
    trained = hf_posenc.get_positional_module(hf_posenc.patch_model(tiny_model("llama"), "alibi", trainable=True))
    assert torch.equal(fixed.alibi_slopes(torch.device("cpu")), fixed.head_slopes(torch.device("cpu")))
    assert trained.alibi_slopes(torch.device("cpu")) is None
    assert torch.equal(trained.bias_table(0, 5), -trained.head_slopes(None)[:, None] * torch.arange(5.0))
