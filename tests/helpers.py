"""Helpers shared by the engine and checkpoint tests (tests/ is on sys.path under pytest's default import mode, as
for tiny_models.py), and the one declared table of how the contract suite (test_contract.py) patches each method."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import torch

import hf_posenc
from tiny_models import CONFIGS

TOL = 1e-4
MODEL_TYPES = list(CONFIGS)  # llama, mistral, qwen2, qwen3, gpt2, bloom
# The window each tiny model was "trained" with; BLOOM's config states none, so tests that need one pass this.
WINDOW = {"llama": 64, "mistral": 64, "qwen2": 64, "qwen3": 64, "gpt2": 32, "bloom": 32}
HALF = 8  # rotary_dim / 2 of the tiny models (head_dim 16)


# --- how each method is patched in the contract suite -------------------------------------------------------------
@dataclass(frozen=True)
class ContractCase:
    """How the contract suite patches a model with a method, and the checks the method cannot support.

    options: what the method needs (RoPE scalings: a factor; LongRoPE: one rescale per frequency) or what makes a
    check meaningful (ALiBi's trainable slopes, so gradients reach them).
    scales_rope: the method scales a RoPE; on a model without one of its own (GPT-2, BLOOM) the suite patches `rope`
    first, as users must, and states the trained window (BLOOM's config has none).
    unsupported: check name (see test_contract.CHECKS) -> why the method cannot support it; the suite skips those.
    """

    options: dict = field(default_factory=dict)
    scales_rope: bool = False
    unsupported: dict = field(default_factory=dict)


CONTRACT = {
    "nope": ContractCase(),
    "alibi": ContractCase(options={"trainable": True}),
    "learned": ContractCase(),
    "sinusoidal": ContractCase(),
    "rope": ContractCase(),
    "fire": ContractCase(),
    "t5": ContractCase(),
    "kerple": ContractCase(),
    "sandwich": ContractCase(),
    "xpos": ContractCase(),
    "comrope-ap": ContractCase(),
    "comrope-ld": ContractCase(options={"per_head": True}),  # the per-head generators (comrope-ap: shared ones)
    "liere": ContractCase(),
    "fope": ContractCase(),
    "rope-2d": ContractCase(unsupported={
        "left_padding": "it takes 2-D position_ids [B, L, 2] and refuses the 1-D ones this check (and generate) pass; "
                        "test_rotations.py checks padding with 2-D positions",
        "gradients": "on the 1 x L grid a call without position_ids gets, every row is 0, so the row rates get no "
                     "gradient; test_rotations.py checks gradients on a 2-D grid"}),
    "linear": ContractCase(options={"factor": 2.0}, scales_rope=True),
    "ntk": ContractCase(options={"factor": 4.0}, scales_rope=True),
    "dynamic": ContractCase(options={"factor": 4.0}, scales_rope=True),
    "yarn": ContractCase(options={"factor": 4.0}, scales_rope=True),
    "dynamic-yarn": ContractCase(options={"factor": 4.0}, scales_rope=True),
    "llama3": ContractCase(options={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}, scales_rope=True),
    "longrope": ContractCase(options={"factor": 4.0, "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
                                      "long_factor": [1.0 + 0.5 * i for i in range(HALF)]}, scales_rope=True),
    # A window shorter than the contract's texts, so that the remapped positions are exercised.
    "self-extend": ContractCase(options={"window": 4, "group": 2}, scales_rope=True),
    "rerope": ContractCase(options={"window": 4, "log_scaling": True}, scales_rope=True),
    # Sinks and a window shorter than the contract's texts, so that keys are hidden and the sinks' positions moved.
    "sinks": ContractCase(options={"num_sinks": 2, "window": 4}, scales_rope=True),
    # Content-dependent attention (methods/base.py ContentMethod), alone (base="none"); base="native" and the
    # options are checked in test_content_methods.py.
    "fox": ContractCase(options={"key_shift": True, "value_shift": True}),  # FoX-Pro's token shift: state and cache
    "stick-breaking": ContractCase(),
    "cope": ContractCase(),
    "transformer-xl": ContractCase(),
    "drope": ContractCase(),  # QK-norm on (the authors' qk_norm_nope), so gradients reach the norms' weights
    "cape": ContractCase(options={"bias": "kerple"}),  # a bias with parameters, so gradients reach them too
    # Updates of the position features drawn at random (init="rope" starts them at zero, where the products of the
    # update's maps give no gradient to D and W, and the cache would carry RoPE's features only); init="rope"
    # reproducing RoPE is checked in test_rotations.py.
    "tape": ContractCase(options={"init": "random", "init_std": 0.3}),
}


# What the contract suite checks (test_contract.py); CONTRACT's `unsupported` names some of these.
CHECKS = ("cached_decoding", "left_padding", "unpatch", "gradients", "low_precision", "save_load", "standalone")


def contract_cases(check: str) -> list[tuple[str, str]]:
    """(method, model type) for every registered method and model type, but those CONTRACT declares unsupported."""
    return [(method, model_type) for method in hf_posenc.available_methods() for model_type in MODEL_TYPES
            if check not in CONTRACT.get(method, ContractCase()).unsupported]


def has_rope(model) -> bool:
    return hf_posenc.registry.get_family(model.config).native_method == "rope"


def patch_for_contract(model, method: str, **extra):
    """Patch `model` with `method` as CONTRACT says (a method missing from it gets its defaults)."""
    case = CONTRACT.get(method, ContractCase())
    options = {**case.options, **extra}
    if case.scales_rope and not has_rope(model):
        hf_posenc.patch_model(model, "rope")
        options.setdefault("original_max_position_embeddings", WINDOW[model.config.model_type])
    return hf_posenc.patch_model(model, method, **options)


# --- comparing and running models ----------------------------------------------------------------------------------
def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def decode_token_by_token(model, ids, cache):
    steps = [model(ids[:, i:i + 1], past_key_values=cache, use_cache=True).logits for i in range(ids.shape[1])]
    return torch.cat(steps, dim=1)


def left_pad(sequences: list[torch.Tensor], pad_id: int = 0):
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, length - len(seq):] = seq
        mask[row, length - len(seq):] = 1
    return ids, mask


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def count_hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def model_fingerprint(model):
    """Everything a patch could leave behind: modules, parameters, buffers, hooks, attention backend."""
    return (
        [(name, type(m).__name__) for name, m in model.named_modules()],
        {k: v.clone() for k, v in model.state_dict().items()},
        count_hooks(model),
        model.config._attn_implementation,
        model.config.to_json_string(),
    )


def assert_same_fingerprint(a, b):
    assert a[0] == b[0], "module tree changed"
    assert a[1].keys() == b[1].keys(), "state dict keys changed"
    assert all(torch.equal(a[1][k], b[1][k]) for k in a[1]), "weights changed"
    assert a[2:] == b[2:], "hooks, attention backend or config changed"


def perturb_positional_state(model):
    """Move every positional parameter and float buffer off its initial value, so only a checkpoint that really
    carries them can reproduce the logits."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for tensor in hf_posenc.get_positional_module(model).state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(0.05 * torch.randn(tensor.shape, generator=generator).to(tensor.dtype))


# --- loading checkpoints where hf_posenc cannot be imported ---------------------------------------------------------
WITHOUT_HF_POSENC = textwrap.dedent('''
    import importlib.abc, json, os, sys

    HIDDEN = ["hf_posenc", *json.loads(os.environ.get("POSENC_TEST_HIDDEN", "[]"))]

    class HideHfPosenc(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == hidden or name.startswith(hidden + ".") for hidden in HIDDEN):
                raise ImportError(f"{name} is hidden in this test")

    sys.meta_path.insert(0, HideHfPosenc())
    import torch
    from transformers import AutoModelForCausalLM

    results = {}
    for directory in sys.argv[1:]:
        reference = torch.load(directory + "/reference.pt")
        model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
        with torch.no_grad():
            diff = (model(reference["ids"]).logits - reference["logits"]).abs().max().item()
        results[directory] = [type(model).__module__, diff]
    try:
        import hf_posenc  # noqa: F401
        results["hf_posenc importable"] = True
    except ImportError:
        results["hf_posenc importable"] = False
    print(json.dumps(results))
''')


def load_without_hf_posenc(directories: list[Path], workdir: Path, hidden: tuple[str, ...] = ()) -> dict:
    """{directory: [module of the loaded model's class, max |logits - reference.pt logits|]} for checkpoints loaded
    with trust_remote_code=True in one process where `import hf_posenc` fails (and importing the `hidden` modules)."""
    env = {**os.environ, "HF_HOME": str(workdir / "hf_home"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": "",
           "POSENC_TEST_HIDDEN": json.dumps(list(hidden))}
    result = subprocess.run([sys.executable, "-c", WITHOUT_HF_POSENC, *map(str, directories)], capture_output=True,
                            text=True, env=env, cwd=workdir, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.strip().splitlines()[-1])
    assert results.pop("hf_posenc importable") is False
    return results


def padded_and_cached_outputs_and_gradients(model, padded, mask, ids, split: int) -> list:
    """A left-padded forward and a cached forward of `ids` in two chunks (at `split`), backpropagated together:
    [padded logits, second chunk's logits, every parameter's gradient], to compare two attention paths."""
    from transformers import DynamicCache

    model.zero_grad()
    padded_logits = model(padded, attention_mask=mask).logits[mask.bool()]
    cache = DynamicCache(config=model.config)
    model(ids[:, :split], past_key_values=cache, use_cache=True)
    chunk = model(ids[:, split:], past_key_values=cache, use_cache=True).logits
    (padded_logits.sin().sum() + chunk.cos().sum()).backward()
    return [padded_logits, chunk] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


def without_kernel(monkeypatch, module, **entry_fields):
    """Take one kind of the method's kernels out of the engine's table (engine/kernels/by_method.py) for this test:
    `causal=None`, `heads=None` or `near_far=False`."""
    import dataclasses

    from hf_posenc.engine.kernels import by_method

    name = module.config.method
    monkeypatch.setitem(by_method.KERNELS, name, dataclasses.replace(by_method.kernels_for(module), **entry_fields))
