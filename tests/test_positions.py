"""Every token reads its own position id: gapped, restarted and padded ids against a materialised reference,
under caches; xPos finite at any length; per-call state under threads; one model's patch never touches another."""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch
from transformers import AttentionInterface, DynamicCache, StaticCache
from transformers.models.bloom import modeling_bloom

import hf_posenc
from hf_posenc.families import bloom as bloom_family
from hf_posenc.engine.state import STATE_ATTR
from helpers import TOL, max_diff
from tiny_models import FAMILIES, VOCAB, random_ids, tiny_model

# Methods that act inside attention (positions of keys matter); FIRE with a small threshold runs past it.
IN_ATTENTION = [("alibi", {}), ("t5", {}), ("kerple", {}), ("sandwich", {}), ("fire", {}),
                ("fire", {"threshold": 6.0}), ("xpos", {}), ("xpos", {"extrapolation": "bca", "window": 8})]
GAPPED = torch.cat([torch.arange(10), torch.arange(1000, 1010)])[None]
RESTARTED = torch.cat([torch.arange(10), torch.arange(10)])[None]


def reference_attention(positions: torch.Tensor):
    """An attention function that materialises everything from the given positions (not from hf_posenc's state):
    the full bias (or xPos rotation) at each token's position id, causal and padding masks, softmax in float64."""

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        method = getattr(module, STATE_ATTR).method
        layer = getattr(module, "layer_idx", 0) or 0
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        query, key, value = query.double(), key.double(), value.double()
        if isinstance(method, hf_posenc.RotaryMethod):
            query, key = method.rotate_query_key(query, key, positions, positions, int(positions.max()) + 1)
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        scores = query @ key.transpose(2, 3) * scaling
        if isinstance(method, hf_posenc.AttentionBiasMethod):
            scores = scores + method.bias(layer, positions, positions).double()
        length = scores.shape[-1]
        allowed = torch.ones(length, length, dtype=torch.bool).tril()
        extra = method.allowed_keys(positions, positions)
        if extra is not None:
            allowed = allowed & extra
        if attention_mask is not None:
            if attention_mask.dtype == torch.bool:
                allowed = allowed & attention_mask
            else:
                scores = scores + attention_mask.double()
        scores = scores.masked_fill(~allowed, -math.inf)
        probs = scores.softmax(-1).nan_to_num(0.0)  # a fully masked (padding) row
        return (probs @ value).transpose(1, 2).to(torch.float32), None

    return attend


def reference_logits(model, ids, positions, monkeypatch, **kwargs):
    """The patched model's logits with attention computed by `reference_attention` (full forward, no cache)."""
    attend = reference_attention(positions.expand(ids.shape[0], -1))
    with monkeypatch.context() as patch:
        patch.setitem(AttentionInterface._global_mapping, "hf_posenc", attend)
        patch.setattr(bloom_family, "posenc_attention", attend)
        with torch.no_grad():
            return model(ids, **kwargs).logits


def decode_with_positions(model, ids, positions, cache, attention_mask=None):
    steps = []
    for i in range(ids.shape[1]):
        mask = attention_mask[:, :i + 1] if attention_mask is not None else None
        steps.append(model(ids[:, i:i + 1], position_ids=positions[:, i:i + 1], attention_mask=mask,
                           past_key_values=cache, use_cache=True).logits)
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("method,options", IN_ATTENTION)
@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
@pytest.mark.parametrize("pattern", ["gapped", "restarted"])
def test_gapped_and_restarted_ids_equal_the_materialised_reference(model_type, method, options, pattern, monkeypatch):
    model = hf_posenc.patch_model(tiny_model(model_type), method, **options)
    positions = GAPPED if pattern == "gapped" else RESTARTED
    ids = random_ids(2, positions.shape[1])
    # An explicit mask: without one, transformers reads ids that do not step by 1 as packed documents and masks
    # attention across them (tested below); here every token sees every earlier one.
    ones = torch.ones_like(ids)
    with torch.no_grad():
        logits = model(ids, position_ids=positions, attention_mask=ones).logits
        cached = decode_with_positions(model, ids, positions, DynamicCache(config=model.config), ones)
        static = decode_with_positions(model, ids, positions, StaticCache(config=model.config, max_cache_len=24), ones)
    expected = reference_logits(model, ids, positions, monkeypatch, position_ids=positions, attention_mask=ones)
    assert max_diff(logits, expected) <= TOL
    assert max_diff(cached, expected) <= TOL
    assert max_diff(static, expected) <= TOL


@pytest.mark.parametrize("method", ["alibi", "t5", "kerple", "xpos"])
def test_a_gap_is_not_read_as_consecutive_positions(method):
    """The bug this guards against: with only the last position of each row used as a shift, [0..9, 1000..1009]
    gave exactly the logits of 990..1009."""
    model = hf_posenc.patch_model(tiny_model("llama"), method)
    ids = random_ids(1, 20)
    ones = torch.ones_like(ids)
    with torch.no_grad():
        gapped = model(ids, position_ids=GAPPED, attention_mask=ones).logits
        consecutive = model(ids, position_ids=torch.arange(990, 1010)[None], attention_mask=ones).logits
    assert max_diff(gapped[:, 10:], consecutive[:, 10:]) > 1e-3


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_restarted_ids_without_a_mask_are_documents_run_alone(model_type):
    """transformers reads position ids that restart as packed documents when there is no attention mask and no cache
    (use_cache=False, as in training): each one then equals itself run alone, whatever the method."""
    model = hf_posenc.patch_model(tiny_model(model_type), "alibi")
    first, second = random_ids(1, 10, seed=3), random_ids(1, 10, seed=4)
    with torch.no_grad():
        packed = model(torch.cat([first, second], 1), position_ids=RESTARTED, use_cache=False).logits
        assert max_diff(packed[:, :10], model(first).logits) <= TOL
        assert max_diff(packed[:, 10:], model(second).logits) <= TOL


def right_pad(sequences):
    length = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros(len(sequences), length, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, :len(seq)], mask[row, :len(seq)] = seq, 1
    return ids, mask


def assert_right_padded_batch_equals_sequences_alone(model, with_ids):
    sequences = [random_ids(1, 12, seed=3)[0], random_ids(1, 7, seed=4)[0]]
    ids, mask = right_pad(sequences)
    kwargs = {"position_ids": (mask.cumsum(-1) - 1).clamp_min(0)} if with_ids else {}
    with torch.no_grad():
        batch = model(ids, attention_mask=mask, **kwargs).logits
        for row, seq in enumerate(sequences):
            alone = model(seq[None]).logits[0]
            assert max_diff(batch[row, :len(seq)], alone) <= TOL


@pytest.mark.parametrize("method,options", IN_ATTENTION)
@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("with_ids", [False, True])
def test_right_padded_batch_equals_sequences_alone(model_type, method, options, with_ids):
    """Right padding: the padding tokens' ids (the last real one repeated, or counting on) never shift the real
    tokens' positions (FIRE past its threshold was 0.022 off)."""
    model = hf_posenc.patch_model(tiny_model(model_type), method, **options)
    assert_right_padded_batch_equals_sequences_alone(model, with_ids)


@pytest.mark.parametrize("with_ids", [False, True])
def test_bloom_right_padded_batch_with_its_own_alibi(with_ids):
    """BLOOM counts positions from its padding mask; right padding without ids was 3.5e-4 off."""
    assert_right_padded_batch_equals_sequences_alone(hf_posenc.patch_model(tiny_model("bloom"), "alibi"), with_ids)


# xPos: finite at any length ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,scale_base,length", [(torch.float32, 1.0, 400), (torch.float16, 2.0, 300),
                                                     (torch.bfloat16, 1.0, 300), (torch.float16, 512.0, 5000)])
def test_xpos_prefill_is_finite_and_equals_decoding_at_any_length(dtype, scale_base, length):
    """One centre for the whole prefill overflowed: fp16 all-NaN from about 4,600 tokens (scale_base 512), fp32 at
    1,300 with scale_base 16; a small scale_base reaches the same exponents within a few hundred tokens."""
    model = hf_posenc.patch_model(tiny_model("llama"), "xpos", scale_base=scale_base)
    ids = random_ids(1, length)
    with torch.no_grad():
        reference = model(ids).logits
        assert torch.isfinite(reference).all()
        model.to(dtype)
        logits = model(ids).logits
        assert torch.isfinite(logits).all()
        tolerance = TOL if dtype == torch.float32 else 0.05 * max(1.0, reference.abs().max().item())
        assert max_diff(logits, reference) <= tolerance
        cache = DynamicCache(config=model.config)
        model(ids[:, :-3], past_key_values=cache, use_cache=True)
        steps = [model(ids[:, i:i + 1], past_key_values=cache, use_cache=True).logits for i in range(length - 3, length)]
        assert max_diff(torch.cat(steps, 1), reference[:, -3:]) <= tolerance


# per-call state: threads, shared configs, replaced embeddings, pickling ------------------------------------------------
@pytest.mark.parametrize("model_type,method,options", [("llama", "fire", {"threshold": 6.0}), ("gpt2", "rope", {}),
                                                       ("bloom", "rope", {}), ("llama", "alibi", {})])
def test_one_model_from_two_threads(model_type, method, options):
    model = hf_posenc.patch_model(tiny_model(model_type), method, **options)
    inputs = [random_ids(1, length, seed=length) for length in (9, 23, 14, 31)]
    with torch.no_grad():
        expected = [model(ids).logits for ids in inputs]
    results, errors = {}, []

    def worker(index):
        try:
            with torch.no_grad():
                for _ in range(15):
                    for k in range(index % 2, len(inputs), 2):
                        results.setdefault(k, []).append(model(inputs[k]).logits)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for k, outputs in results.items():
        assert all(torch.equal(out, expected[k]) for out in outputs), k


@pytest.mark.parametrize("method,options", [("alibi", {}), ("yarn", {"factor": 4.0}), ("learned", {"init": "normal"})])
def test_two_models_sharing_one_config_object(method, options):
    """transformers 5 gives Model(config) twice the same config object: a patch changes only its own model."""
    from transformers import AutoModelForCausalLM

    from tiny_models import CONFIGS

    config = CONFIGS["llama"]()
    torch.manual_seed(0)
    first = AutoModelForCausalLM.from_config(config).eval()
    torch.manual_seed(0)
    second = AutoModelForCausalLM.from_config(config).eval()
    assert first.config is second.config
    before = config.to_json_string()
    ids = random_ids(1, 12)
    with torch.no_grad():
        original = second(ids).logits
        hf_posenc.patch_model(first, method, **options)
        assert torch.equal(second(ids).logits, original)
        assert config.to_json_string() == before and second.config._attn_implementation == "sdpa"
        hf_posenc.unpatch_model(first)
        assert torch.equal(first(ids).logits, original)
    assert first.config is config


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("method", ["learned", "sinusoidal"])
def test_absolute_methods_use_the_current_input_embeddings(model_type, method):
    model = hf_posenc.patch_model(tiny_model(model_type), method, **({"init": "normal"} if method == "learned" else {}))
    ids = random_ids(1, 10)
    old = model.get_input_embeddings()
    new = torch.nn.Embedding(VOCAB + 8, old.weight.shape[1])
    with torch.no_grad():
        new.weight[:VOCAB] = old.weight * 2
    model.set_input_embeddings(new)
    with torch.no_grad():
        logits = model(ids).logits
        fed = model(inputs_embeds=new(ids)).logits
    assert torch.equal(logits, fed)
    model.train()
    loss = model(torch.tensor([[VOCAB + 3, 5, 6]]), labels=torch.tensor([[VOCAB + 3, 5, 6]]).clamp_max(VOCAB - 1)).loss
    loss.backward()
    assert new.weight.grad is not None and new.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("model_type,method", [("llama", "alibi"), ("gpt2", "rope"), ("bloom", "rope"),
                                               ("llama", "learned"), ("gpt2", "fire"), ("llama", "dynamic")])
def test_pickled_model_keeps_its_patch_and_unpatches(model_type, method, tmp_path):
    model = tiny_model(model_type)
    ids = random_ids(1, 10)
    with torch.no_grad():
        original = model(ids).logits
    hf_posenc.patch_model(model, method, **({"factor": 2.0} if method == "dynamic" else {}))
    with torch.no_grad():
        patched = model(ids).logits
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, patched)
        assert type(hf_posenc.get_posenc_config(loaded)) is type(hf_posenc.get_posenc_config(model))
        hf_posenc.unpatch_model(loaded)
        assert torch.equal(loaded(ids).logits, original)
    assert hf_posenc.get_posenc_config(loaded) is None
    # the original is untouched by all this
    with torch.no_grad():
        assert torch.equal(model(ids).logits, patched)
    twin = copy.deepcopy(loaded)
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, original)


@pytest.mark.parametrize("method,options", [("dynamic", {"factor": 4.0}), ("alibi", {})])
def test_two_caches_used_in_turn_on_one_model(method, options):
    """What a cache needs to know (its tokens' positions; for exact dynamic scaling, the text it holds) lives on the
    cache, so two generations interleaved on one model each equal a full forward of their own text."""
    model = hf_posenc.patch_model(tiny_model("llama"), method, **options)
    texts = [random_ids(1, 80, seed=7), random_ids(1, 80, seed=8)]
    caches = [DynamicCache(config=model.config), DynamicCache(config=model.config)]
    with torch.no_grad():
        for text, cache in zip(texts, caches):
            model(text[:, :60], past_key_values=cache, use_cache=True)
        last = [None, None]
        for t in range(60, 80):
            for k in (0, 1):
                last[k] = model(texts[k][:, t:t + 1], past_key_values=caches[k], use_cache=True).logits[0, -1]
        for k in (0, 1):
            assert max_diff(last[k], model(texts[k], use_cache=False).logits[0, -1]) <= TOL


def test_peft_lora_on_the_embeddings_reaches_absolute_methods():
    from peft import LoraConfig, get_peft_model

    model = hf_posenc.patch_model(tiny_model("llama"), "learned", init="normal")
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["embed_tokens"], init_lora_weights=False))
    ids = random_ids(1, 10)
    with torch.no_grad():
        through_ids = peft_model(input_ids=ids).logits
        through_embeds = peft_model(inputs_embeds=peft_model.get_input_embeddings()(ids)).logits
        plain = peft_model.get_base_model().model.embed_tokens.base_layer(ids)
        without_adapter = peft_model(inputs_embeds=plain).logits
    assert torch.equal(through_ids, through_embeds) and max_diff(through_ids, without_adapter) > 1e-4
    peft_model.train()
    peft_model(input_ids=ids, labels=ids).loss.backward()
    lora = [p for name, p in peft_model.named_parameters() if "lora_" in name]
    assert lora and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora)
