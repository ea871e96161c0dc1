"""attention_path("triton"): patched tiny models whose bias is a distance table, forward and backward, equal the
blocked path with the Triton kernel serving their calls (through Triton's interpreter on the CPU: tests/conftest.py),
also for a left-padded batch, packed documents (position restarts) and queries after a cache; "auto" leaves the CPU
to the blocked path; forcing the path without triton names the fix."""

import pytest
import torch

pytest.importorskip("triton")

import hf_posenc  # noqa: E402
from hf_posenc import attention  # noqa: E402
from hf_posenc.engine.kernels import triton as triton_kernels  # noqa: E402
from hf_posenc.errors import PosEncError  # noqa: E402
from helpers import left_pad  # noqa: E402
from tiny_models import random_ids, tiny_model  # noqa: E402

METHODS = {"kerple": {}, "t5": {}, "alibi": {}, "trainable alibi": {"trainable": True}, "fire": {}, "sandwich": {}}


def _outputs_and_gradients(model, path, **inputs):
    model.zero_grad()
    inputs = {name: value.to(model.device) if torch.is_tensor(value) else value for name, value in inputs.items()}
    with attention.attention_path(path):
        logits = model(**inputs).logits
    keep = inputs["attention_mask"].bool() if "attention_mask" in inputs else torch.ones(logits.shape[:2], dtype=bool,
                                                                                         device=logits.device)
    (logits[keep] * torch.linspace(-1, 1, logits.shape[-1], device=logits.device)).sum().backward()
    grads = {name: p.grad.cpu() for name, p in model.named_parameters() if p.grad is not None}
    return logits[keep].detach().cpu(), grads


def _assert_paths_agree(model, **inputs):
    attention.last_paths.clear()
    blocked = _outputs_and_gradients(model, "blocked", **inputs)
    assert attention.last_paths["triton"] == 0
    triton = _outputs_and_gradients(model, "triton", **inputs)
    layers = model.config.num_hidden_layers
    assert attention.last_paths["triton"] == layers, attention.last_paths
    assert (triton[0] - blocked[0]).abs().max() <= 1e-4 * blocked[0].abs().max()
    assert blocked[1].keys() == triton[1].keys()
    # A gradient that is zero in exact arithmetic (FIRE's output bias shifts every logit of a row) is rounding noise
    # on both paths: errors count against at least 1% of the largest gradient (as kernels/check.py does).
    largest = max(grad.abs().max() for grad in blocked[1].values())
    for name, grad in blocked[1].items():
        assert (triton[1][name] - grad).abs().max() <= 1e-4 * max(grad.abs().max(), 1e-2 * largest), name


def _patched(method, device, family="llama"):
    name = method.split()[-1]
    model = hf_posenc.patch_model(tiny_model(family).float(), name, **METHODS[method])
    return model.to(device).eval()  # eval: no dropout (GPT-2)


@pytest.mark.parametrize("method", METHODS)
def test_triton_path_equals_blocked_on_llama(method, device):
    _assert_paths_agree(_patched(method, device), input_ids=random_ids(2, 40))


@pytest.mark.parametrize("method", ["kerple", "t5"])
def test_triton_path_equals_blocked_on_a_left_padded_batch(method, device):
    padded, mask = left_pad([random_ids(1, 37, seed=3)[0], random_ids(1, 22, seed=4)[0]])
    _assert_paths_agree(_patched(method, device), input_ids=padded, attention_mask=mask)


@pytest.mark.parametrize("method", ["trainable alibi", "t5"])
def test_triton_path_equals_blocked_on_packed_documents(method, device):
    """Both with transformers' packed-documents mask (built from restarting position ids where no cache is used) and
    with the plain causal mask over restarting positions (a cache in use: distances restart, documents see earlier
    ones)."""
    positions = torch.cat([torch.arange(14), torch.arange(19), torch.arange(7)])[None]
    model = _patched(method, device)
    for use_cache in (False, True):
        _assert_paths_agree(model, input_ids=random_ids(1, 40), position_ids=positions, use_cache=use_cache)
    with torch.no_grad():  # the two masks differ: the packed one keeps each document to itself
        packed, plain = (model(random_ids(1, 40).to(device), position_ids=positions.to(device),
                               use_cache=use_cache).logits for use_cache in (False, True))
    assert torch.allclose(packed[:, :14], plain[:, :14]) and not torch.allclose(packed[:, 14:], plain[:, 14:])


def test_triton_path_equals_blocked_on_gpt2(device):
    _assert_paths_agree(_patched("kerple", device, "gpt2"), input_ids=random_ids(2, 24))


@pytest.mark.parametrize("method", ["kerple", "trainable alibi"])
def test_triton_path_equals_blocked_on_bloom(method, device):
    # BLOOM's config always says "eager"; without output_attentions its calls take the kernels (its float mask
    # read as padding), with them the blocked path that returns the weights.
    model = _patched(method, device, "bloom")
    ids, mask = left_pad([random_ids(1, 24)[0], random_ids(1, 17)[0]])
    _assert_paths_agree(model, input_ids=ids, attention_mask=mask)
    attention.last_paths.clear()
    with torch.no_grad(), attention.attention_path("triton"):
        weights = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_attentions=True).attentions
    assert attention.last_paths["triton"] == 0 and len(weights) == model.config.num_hidden_layers


def test_triton_path_serves_queries_after_a_cache(device):
    model = _patched("kerple", device)
    ids = random_ids(2, 30).to(device)
    outputs = {}
    for path in ("blocked", "triton"):
        with torch.no_grad(), attention.attention_path(path):
            cache = model(ids[:, :18], use_cache=True).past_key_values
            attention.last_paths.clear()
            outputs[path] = model(ids[:, 18:], past_key_values=cache, use_cache=True).logits
            assert attention.last_paths[path] == model.config.num_hidden_layers
    assert (outputs["triton"] - outputs["blocked"]).abs().max() <= 1e-4 * outputs["blocked"].abs().max()


def test_auto_leaves_the_cpu_to_the_blocked_path():
    model = _patched("kerple", "cpu")
    attention.last_paths.clear()
    with torch.no_grad():
        model(random_ids(1, 16))
    assert attention.last_paths["triton"] == 0 and attention.last_paths["blocked"] == 2


def test_forcing_triton_without_triton_names_the_fix(monkeypatch):
    model = _patched("kerple", "cpu")
    monkeypatch.setattr(triton_kernels, "triton_installed", lambda: False)
    with pytest.raises(PosEncError, match=r"hf_posenc\[gpu\]"), torch.no_grad(), attention.attention_path("triton"):
        model(random_ids(1, 16))
    monkeypatch.undo()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(PosEncError, match="TRITON_INTERPRET=1"), torch.no_grad(), attention.attention_path("triton"):
        model(random_ids(1, 16))


def test_triton_is_imported_only_where_a_triton_path_is_chosen():
    """Patching and running a table method on "auto" on the CPU does not import the kernel module (nor triton
    through it: transformers' model classes may import triton themselves, where it is installed); forcing "triton"
    does."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = """
import sys
sys.path.insert(0, "tests")
import torch, hf_posenc
from hf_posenc import attention
from tiny_models import random_ids, tiny_model
model = hf_posenc.patch_model(tiny_model("llama"), "kerple")
with torch.no_grad():
    model(random_ids(1, 8))
print("auto", "hf_posenc.engine.kernels.triton.table_attention" in sys.modules)
with torch.no_grad(), attention.attention_path("triton"):
    model(random_ids(1, 8))
print("triton", "hf_posenc.engine.kernels.triton.table_attention" in sys.modules, attention.last_paths["triton"])
"""
    root = Path(__file__).resolve().parent.parent
    environment = {**os.environ, "PYTHONPATH": str(root), "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", script], cwd=root, env=environment, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[-3:-1] == ["auto False", "triton True 2"], result.stdout


def test_triton_path_equals_blocked_in_float16(device):
    """Half precision through the kernel (bf16's tl.dot is wrong under the interpreter: checked on a GPU only)."""
    model = hf_posenc.patch_model(tiny_model("llama"), "kerple").to(device, torch.float16).eval()
    ids = random_ids(2, 40).to(device)
    outputs = {}
    for path in ("blocked", "triton"):
        attention.last_paths.clear()
        with torch.no_grad(), attention.attention_path(path):
            outputs[path] = model(ids).logits.float()
        assert attention.last_paths[path] == model.config.num_hidden_layers
    assert (outputs["triton"] - outputs["blocked"]).abs().max() <= 1e-2 * outputs["blocked"].abs().max()
