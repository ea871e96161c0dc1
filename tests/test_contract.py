"""The contract every positional method keeps, checked for every registered method on every tiny model type (so a
newly registered method cannot escape it): full forward == cached decoding (DynamicCache, StaticCache, a prompt then
decoding); a left-padded batch == each sequence alone (forward and generate); unpatch restores the original bit for
bit; gradients reach the model and the method's parameters, and gradient checkpointing (reentrant or not) keeps them;
bf16 and fp16 stay finite; save_pretrained / from_pretrained and standalone checkpoints give the same logits.

How each method is patched, and any check it cannot support (with the reason), is declared in one place:
helpers.CONTRACT."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from transformers import DynamicCache, StaticCache

import hf_posenc
from helpers import (CHECKS, CONTRACT, TOL, assert_same_fingerprint, contract_cases as cases, count_hooks,
                     decode_token_by_token, left_pad, max_diff, model_fingerprint, patch_for_contract,
                     positions_from_mask)
from tiny_models import random_ids, tiny_model

def test_the_contract_table_covers_every_method():
    assert set(CONTRACT) == set(hf_posenc.available_methods())
    for method, case in CONTRACT.items():
        assert set(case.unsupported) <= set(CHECKS), method
        assert all(isinstance(reason, str) and reason for reason in case.unsupported.values()), method


@pytest.mark.parametrize("method,model_type", cases("cached_decoding"))
def test_full_forward_equals_cached_decoding(method, model_type):
    model = patch_for_contract(tiny_model(model_type), method)
    ids = random_ids(2, 12)
    with torch.no_grad():
        full = model(ids).logits
        dynamic = decode_token_by_token(model, ids, DynamicCache(config=model.config))
        static = decode_token_by_token(model, ids, StaticCache(config=model.config, max_cache_len=20))
        cache = DynamicCache(config=model.config)  # a prompt in one chunk, then decoding
        prefix = model(ids[:, :7], past_key_values=cache, use_cache=True).logits
        rest = decode_token_by_token(model, ids[:, 7:], cache)
    assert max_diff(full, dynamic) <= TOL
    assert max_diff(full, static) <= TOL
    assert max_diff(full, torch.cat([prefix, rest], dim=1)) <= TOL


@pytest.mark.parametrize("method,model_type", cases("left_padding"))
def test_left_padded_batch_equals_sequences_alone(method, model_type):
    model = patch_for_contract(tiny_model(model_type), method)
    sequences = [random_ids(1, 9, seed=3)[0], random_ids(1, 5, seed=4)[0]]
    ids, mask = left_pad(sequences)
    generate = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True,
                    pad_token_id=0)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
        generated = model.generate(ids, attention_mask=mask, **generate)
        for row, seq in enumerate(sequences):
            assert max_diff(batch[row, -len(seq):], model(seq[None]).logits[0]) <= TOL
            alone = model.generate(seq[None], attention_mask=torch.ones_like(seq[None]), **generate)
            assert torch.equal(generated.sequences[row, ids.shape[1]:], alone.sequences[0, len(seq):])
            for step_batch, step_alone in zip(generated.scores, alone.scores):
                assert max_diff(step_batch[row], step_alone[0]) <= TOL


@pytest.mark.parametrize("method,model_type", cases("unpatch"))
def test_unpatch_restores_bit_identical_logits(method, model_type):
    model = tiny_model(model_type)
    ids = random_ids(2, 10)
    with torch.no_grad():
        original = model(ids).logits
    before = model_fingerprint(model)
    patch_for_contract(model, method)
    other = "alibi" if method != "alibi" else "nope"
    hf_posenc.patch_model(model, other)  # replaces, does not stack
    assert type(hf_posenc.get_posenc_config(model)) is hf_posenc.get_method(other).config_class
    hooks = count_hooks(model)
    hf_posenc.patch_model(model, other)
    assert count_hooks(model) == hooks
    patch_for_contract(model, method)
    hf_posenc.unpatch_model(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original)
    assert_same_fingerprint(before, model_fingerprint(model))
    assert hf_posenc.get_posenc_config(model) is None


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["checkpointing-non-reentrant", "checkpointing-reentrant"])
@pytest.mark.parametrize("method,model_type", cases("gradients"))
def test_gradients_reach_the_model_and_checkpointing_keeps_them(method, model_type, use_reentrant):
    """Gradients reach every attention projection and the method's parameters; with gradient checkpointing of each
    mode they equal those without. The checkpointed backward runs on a thread of its own, as CUDA's does (autograd's
    device thread recomputes the layers there, not in the caller's thread)."""
    ids = random_ids(2, 10)
    model = patch_for_contract(tiny_model(model_type), method)
    model.train()
    model(ids, labels=ids).loss.backward()
    family = hf_posenc.registry.get_family(model.config)
    projections = dict(model.named_modules())
    for name in family.lora_target_modules(model):  # every attention projection of every layer
        grad = projections[name].weight.grad
        assert grad is not None and grad.abs().sum() > 0, name
    positional = dict(hf_posenc.get_positional_module(model).named_parameters())
    for name, param in positional.items():
        if param.requires_grad:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
    # the positional parameters are part of the model, so optimisers and state dicts see them
    assert all(any(p is q for q in model.parameters()) for p in positional.values())
    plain = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    model = patch_for_contract(tiny_model(model_type), method)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.train()
    loss = model(ids, labels=ids).loss
    errors = []
    thread = threading.Thread(target=lambda: _backward(loss, errors))
    thread.start()
    thread.join()
    assert not errors, errors[0]
    checkpointed = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert set(checkpointed) == set(plain)
    for name, grad in plain.items():  # float32 rounding: reentrant mode sums a shared parameter's layers apart
        assert max_diff(checkpointed[name], grad) <= 1e-5 * grad.abs().max().item() + 1e-8, name


def _backward(loss, errors: list) -> None:
    try:
        loss.backward()
    except Exception as error:  # noqa: BLE001 (reported by the test's thread)
        errors.append(error)


@pytest.mark.parametrize("method,model_type", cases("low_precision"))
def test_low_precision_forward_is_finite(method, model_type):
    ids = random_ids(2, 16)
    padded, mask = left_pad([ids[0], ids[1, :9]])
    for dtype in (torch.bfloat16, torch.float16):
        model = patch_for_contract(tiny_model(model_type).to(dtype), method)
        with torch.no_grad():
            assert torch.isfinite(model(ids).logits).all(), dtype
            assert torch.isfinite(model(padded, attention_mask=mask).logits[mask.bool()]).all(), dtype


@pytest.mark.parametrize("method,model_type", cases("save_load"))
def test_save_and_from_pretrained_give_identical_logits(contract_checkpoints, method, model_type):
    saved = contract_checkpoints[method, model_type]
    metadata = json.loads((saved.directory / "posenc_config.json").read_text())
    assert metadata["method"] == method and metadata["hf_posenc_version"] == hf_posenc.__version__
    assert metadata["model"]["num_heads"] == 4 and metadata["model"]["model_type"] == model_type
    model = hf_posenc.from_pretrained(saved.directory)
    assert hf_posenc.get_posenc_config(model) == saved.config
    with torch.no_grad():
        assert torch.equal(model(saved.ids).logits, saved.logits)


@pytest.mark.parametrize("method,model_type", cases("standalone"))
def test_standalone_checkpoint_loads_without_hf_posenc(standalone_results, contract_checkpoints, method, model_type):
    """Each checkpoint saved with standalone=True, loaded in a process where `import hf_posenc` fails (one process
    loads them all: see conftest.standalone_results)."""
    module, diff = standalone_results[str(contract_checkpoints[method, model_type].directory)]
    assert module.startswith("transformers_modules."), module  # the checkpoint's own code ran
    assert diff <= 1e-6
