"""Patched models under torch.compile: one graph (fullgraph), no recompilation on an identical second call, and the
numbers of the uncompiled model; `generate` with a fullgraph CompileConfig. The "eager" dynamo backend traces
exactly as inductor would (graph breaks and guards are dynamo's), without the C++ compile time."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from transformers import CompileConfig

import hf_posenc
from hf_posenc.engine import attention

from helpers import left_pad, max_diff
from tiny_models import random_ids, tiny_model

TOLERANCE = 1e-4


@pytest.mark.parametrize("model_type, method, options", [
    ("llama", "alibi", {}),
    ("llama", "rope", {}),
    ("llama", "yarn", {"factor": 2.0}),
    ("llama", "fire", {}),
    ("gpt2", "learned", {}),
    ("gpt2", "rope", {}),
])
def test_compiled_forward_is_one_graph_compiled_once(model_type, method, options):
    model = hf_posenc.patch_model(tiny_model(model_type), method, **options)
    ids = random_ids(2, 8)
    with torch.no_grad():
        expected = model(ids).logits
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    paths_before = attention.last_paths.copy()
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        first = compiled(ids).logits
        second = compiled(ids).logits  # raises if dynamo guarded on anything the first call changed
    assert max_diff(first, expected) < TOLERANCE
    assert max_diff(second, expected) < TOLERANCE
    assert attention.last_paths == paths_before  # no bookkeeping inside the traced region


@pytest.mark.parametrize("model_type, method, options", [
    ("llama", "alibi", {"trainable": True}),
    ("llama", "kerple", {}),
    ("llama", "yarn", {"factor": 2.0}),  # its frequencies come from transformers' rope functions, built at patch time
    ("llama", "liere", {}),  # exp(p A) by matrix_exp under tracing: the power table is sized by a position's value
    ("gpt2", "fire", {}),
    ("bloom", "t5", {}),
])
def test_a_compiled_training_step_is_one_graph_with_the_eager_gradients(model_type, method, options):
    """What accelerate's --dynamo_backend runs: forward, loss and backward of the compiled model, here traced before
    any uncompiled forward (the fine-tune's first step), as one graph (fullgraph), with the uncompiled gradients."""
    model = hf_posenc.patch_model(tiny_model(model_type), method, **options).train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):  # GPT-2's: the two runs would draw other masks
            module.p = 0.0
    ids = random_ids(2, 12)

    def gradients(forward):
        model.zero_grad(set_to_none=True)
        logits = forward(ids).logits  # the loss outside: GPT-2's own loss function logs, which dynamo cannot trace
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    torch._dynamo.reset()
    compiled_loss, compiled = gradients(torch.compile(model, fullgraph=True, backend="aot_eager"))
    loss, expected = gradients(model)
    assert float((compiled_loss - loss).abs()) < TOLERANCE
    assert compiled.keys() == expected.keys() and len(expected) == len(list(model.parameters()))
    assert max(max_diff(compiled[name], expected[name]) for name in expected) < TOLERANCE


@pytest.mark.parametrize("model_type, method", [("llama", "alibi"), ("bloom", "alibi")])
def test_generate_with_fullgraph_compile_config_matches_eager(model_type, method):
    model = hf_posenc.patch_model(tiny_model(model_type), method)
    ids, mask = left_pad([random_ids(1, 6)[0], random_ids(1, 4, seed=2)[0]])
    options = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static",
                   output_logits=True, return_dict_in_generate=True)
    expected = model.generate(ids, **options)
    compile_config = CompileConfig(fullgraph=True, backend="eager")
    compile_config._compile_all_devices = True  # transformers compiles on CPU only when told to
    compiled_calls = []
    compiled_call = model.get_compiled_call
    model.get_compiled_call = lambda config: compiled_calls.append(config) or compiled_call(config)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        result = model.generate(ids, compile_config=compile_config, **options)
    assert compiled_calls, "generate did not take its compiled path"
    assert torch.equal(result.sequences, expected.sequences)
    assert max(max_diff(a, b) for a, b in zip(result.logits, expected.logits)) < TOLERANCE


@pytest.mark.parametrize("model_type, method, cache_class", [
    ("llama", "alibi", "DynamicCache"),
    ("gpt2", "fire", "DynamicCache"),
    ("llama", "alibi", "StaticCache"),
    ("bloom", "alibi", "StaticCache"),
])
def test_eager_calls_after_a_compiled_forward_know_the_cached_positions(model_type, method, cache_class):
    """A compiled forward records where its cached tokens sit (each at its slot plus one shift per row), so a later
    eager call on the same cache with a gap in its positions (position_ids 20 after 0..7) computes what an
    all-eager run computes, not positions 12..19 inferred as consecutive before the query."""
    import transformers

    model = hf_posenc.patch_model(tiny_model(model_type), method).eval()
    ids, next_id = random_ids(2, 8), random_ids(2, 1, seed=3)
    gap = torch.full((2, 1), 20)

    def new_cache():
        if cache_class == "StaticCache":
            return transformers.StaticCache(config=model.config, max_cache_len=16)
        return transformers.DynamicCache(config=model.config)

    def decode(cache):
        options = {"position_ids": gap} if model_type != "bloom" else {
            "attention_mask": torch.ones(2, 9, dtype=torch.long)}
        return model(next_id, past_key_values=cache, use_cache=True, **options).logits

    with torch.no_grad():
        cache = new_cache()
        model(ids, past_key_values=cache, use_cache=True)
        expected = decode(cache)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        cache = new_cache()
        compiled(ids, past_key_values=cache, use_cache=True)
        after_compiled = decode(cache)
        if model_type != "bloom":  # the gap is what tells a recorded position from one inferred from the query
            cache = new_cache()
            model(ids, past_key_values=cache, use_cache=True)
            for name in ("hf_posenc_key_positions", "hf_posenc_key_shift"):
                setattr(cache, name, None)  # as if nothing recorded them
            assert max_diff(decode(cache), expected) > 1e-3
    assert max_diff(after_compiled, expected) < TOLERANCE


CONTENT_METHODS = [("fox", {"key_shift": True, "value_shift": True}), ("stick-breaking", {}), ("cope", {}),
                   ("transformer-xl", {}), ("cape", {})]


@pytest.mark.parametrize("method, options", CONTENT_METHODS)
def test_content_methods_refuse_a_fullgraph_compile_by_name(method, options):
    """Content methods carry Python-side per-token state on the KV cache (engine/content.py): one graph cannot hold
    it, so a fullgraph compile stops at the base model's pre-hook with hf_posenc's reason (inside dynamo's error)."""
    model = hf_posenc.patch_model(tiny_model("llama"), method, **options)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad(), pytest.raises(Exception) as raised:
        compiled(random_ids(2, 8))
    assert f"{method!r} carries per-token state on the KV cache" in str(raised.value)
    assert "run the model uncompiled" in str(raised.value)


def test_the_fine_tune_names_a_content_methods_refusal_when_dynamo_drops_its_message():
    """dynamo before torch 2.13 reports a refusal raised in traced code, at the root of its error chain, without the
    refusal's message (seen with torch 2.11 on an H200: the fine-tune's warning said only that a PosEncError was
    raised). The fine-tune's verdict still says which method refused and why; other errors pass as they are."""
    from hf_posenc.tools.finetune import compile_error_text

    opaque = RuntimeError("ObservedPosEncErrorError: raised exception UserDefinedExceptionObjectVariable(PosEncError)")
    fox = hf_posenc.patch_model(tiny_model("llama"), "fox")
    text = compile_error_text(opaque, fox)
    assert text.startswith("PosEncError: 'fox' carries per-token state on the KV cache")
    assert "Variable(PosEncError)" in text
    failure = RuntimeError("InductorError: no C compiler")
    assert compile_error_text(failure, fox) == "RuntimeError: InductorError: no C compiler"
    alibi = hf_posenc.patch_model(tiny_model("llama"), "alibi")  # not a content method: nothing to add
    assert compile_error_text(opaque, alibi) == f"RuntimeError: {opaque}"
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception) as raised:  # the refusal as this torch reports it: said once
        torch.compile(fox, fullgraph=True, backend="eager")(random_ids(1, 8))
    assert compile_error_text(raised.value, fox).count("carries per-token state") == 1


@pytest.mark.slow
def test_content_method_compiled_with_graph_breaks_matches_eager_forward_and_cached_decoding():
    """Without fullgraph, dynamo breaks the graph at the content hooks and runs them uncompiled: the numbers are
    the eager ones, for a full forward and for decoding on a cache (FoX with its token shifts: the most state)."""
    from transformers import DynamicCache

    from helpers import decode_token_by_token

    model = hf_posenc.patch_model(tiny_model("llama"), "fox", key_shift=True, value_shift=True)
    ids = random_ids(2, 8)
    with torch.no_grad():
        expected = model(ids).logits
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        assert max_diff(compiled(ids).logits, expected) < TOLERANCE
        assert max_diff(decode_token_by_token(compiled, ids, DynamicCache(config=model.config)), expected) < TOLERANCE
