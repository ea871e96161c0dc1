"""The checks of fla-core's kernels on the "triton" path (test_triton_fla.py), run in a process of their own through
Triton's interpreter on the CPU: `python fla_interpreter.py CASE` prints one JSON object of measured errors and
path counts, which the test asserts on.

TRITON_INTERPRET=1 must be set before triton is imported (`triton.jit` reads it when fla's modules define their
kernels), hence the process of its own: a pytest worker may have imported triton already (torch.compile's tests).
Under Triton 3.9's interpreter an autotuner with more than one config fails ("0 active drivers": its benchmark asks
for a GPU driver), and fla autotunes several of its kernels (its cumulative sums, stick-breaking's); with one config
an autotuner runs without a benchmark, so this process keeps the first config of each (`one_config_per_autotuner`).
That changes only which launch parameters (warps, stages) run, which the interpreter ignores."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import json  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

warnings.filterwarnings("ignore", message="Triton is not supported on current platform")  # fla's note: no GPU


def one_config_per_autotuner() -> int:
    """Keep the first config of every autotuner in fla's loaded modules (see the module docstring); returns how
    many were cut."""
    import fla.ops.forgetting_attn  # noqa: F401  (the modules whose kernels these checks run)
    import fla.ops.stickbreaking_attn  # noqa: F401
    from triton.runtime.autotuner import Autotuner

    cut = 0
    for name, module in list(sys.modules.items()):
        if name != "fla" and not name.startswith("fla."):
            continue
        for value in list(vars(module).values()):
            while hasattr(value, "fn"):  # heuristics and autotuners wrap the kernel, each holding the next in .fn
                if isinstance(value, Autotuner) and len(value.configs) > 1:
                    value.configs = value.configs[:1]
                    cut += 1
                value = value.fn
    return cut


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


# --- references in float64, written from the formulas ---------------------------------------------------------------

def allowed_pairs(starts: torch.Tensor, attend_current: bool = True) -> torch.Tensor:
    """bool [B, 1, T, T]: key j visible to query i (j <= i, or j < i, in the same document; starts [B, T] marks each
    document's first token)."""
    document = starts.cumsum(-1)
    slots = torch.arange(starts.shape[-1])
    earlier = slots[None, :] <= slots[:, None] if attend_current else slots[None, :] < slots[:, None]
    return (earlier & (document[:, :, None] == document[:, None, :]))[:, None]


def fox_reference(query, key, value, log_forget, scaling, starts):
    """FoX (methods/fox.py): softmax_j(scaling q_i . k_j + sum_{l=j+1..i} log f_l) v_j over the visible keys;
    [B, H, T, D] queries, [B, H_kv, T, D] keys and values, log f [B, H, T]."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1).double(), value.repeat_interleave(groups, 1).double()
    c = log_forget.double().cumsum(-1)
    logits = scaling * query.double() @ key.transpose(-1, -2) + c[..., :, None] - c[..., None, :]
    logits = logits.masked_fill(~allowed_pairs(starts), float("-inf"))
    return logits.softmax(-1) @ value


def stick_breaking_reference(query, key, value, scaling, attend_current, starts):
    """Stick-breaking (methods/stick_breaking.py): A_ij = beta_ij prod_{j<k<i (<=i with attend_current)} (1 - beta_ik),
    beta = sigmoid(scaling q . k), over the visible keys, and o_i = sum_j A_ij v_j + (1 - sum_j A_ij) v_i."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1).double(), value.repeat_interleave(groups, 1).double()
    beta = torch.sigmoid(scaling * query.double() @ key.transpose(-1, -2))
    breaks = allowed_pairs(starts, attend_current)
    kept = torch.where(breaks, 1 - beta, torch.ones_like(beta))
    length = query.shape[2]
    after = torch.stack([kept[..., j + 1:].prod(-1) for j in range(length)], dim=-1)  # prod over k > j
    weights = torch.where(breaks, beta * after, torch.zeros_like(beta))
    return weights @ value + (1 - weights.sum(-1, keepdim=True)) * value


# --- op level: our glue to fla (kernels/triton/fla_content.py) against the references ------------------------------

SHAPES = {"batch": 2, "length": 40, "heads": 4, "kv_heads": 2, "head_dim": 16, "hidden": 8}
RESTART = (17, 29)  # row r's second document starts there (packed cases)


def op_inputs(dtype, packed: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    b, t, h, hk, d, hidden = SHAPES.values()
    query, key, value = (torch.randn(b, n, t, d, generator=generator).to(dtype).requires_grad_()
                         for n in (h, hk, hk))
    starts = torch.zeros(b, t, dtype=torch.bool)
    starts[:, 0] = True
    if packed:
        for row, start in enumerate(RESTART):
            starts[row, start] = True
    layer_input = torch.randn(b, t, hidden, generator=generator)
    gate_weight = (0.5 * torch.randn(h, hidden, generator=generator)).requires_grad_()
    gate_bias = torch.linspace(-1.0, 3.0, h).requires_grad_()  # forget gates from sigmoid(-1) to sigmoid(3)
    return query, key, value, starts, layer_input, gate_weight, gate_bias


def log_forget(layer_input, gate_weight, gate_bias):
    """FoX's log f_t [B, H, T] from its gate parameters, in the parameters' dtype (methods/fox.py log_forget)."""
    return F.logsigmoid(layer_input.to(gate_weight.dtype) @ gate_weight.T + gate_bias).transpose(1, 2)


def op_errors(method: str, dtype, packed: bool, attend_current: bool = False) -> dict:
    """{output and each gradient: error relative to the float64 reference's largest value} of one op call."""
    from hf_posenc.engine.kernels.triton.fla_content import (cu_seqlens_of, forgetting_attention,
                                                             stick_breaking_attention)

    query, key, value, starts, layer_input, gate_weight, gate_bias = op_inputs(dtype, packed)
    scaling = SHAPES["head_dim"] ** -0.5
    cu_seqlens = cu_seqlens_of(starts) if packed else None
    leaves = {"query": query, "key": key, "value": value}
    if method == "fox":
        leaves |= {"gate_weight": gate_weight, "gate_bias": gate_bias}
        output = forgetting_attention(query, key, value, log_forget(layer_input, gate_weight, gate_bias), scaling,
                                      cu_seqlens)
        references = {name: leaf.detach().double().requires_grad_() for name, leaf in leaves.items()}
        reference = fox_reference(references["query"], references["key"], references["value"],
                                  log_forget(layer_input, references["gate_weight"], references["gate_bias"]),
                                  scaling, starts)
    else:
        output = stick_breaking_attention(query, key, value, scaling, attend_current, cu_seqlens)
        references = {name: leaf.detach().double().requires_grad_() for name, leaf in leaves.items()}
        reference = stick_breaking_reference(references["query"], references["key"], references["value"], scaling,
                                             attend_current, starts)
    assert output.dtype == dtype and output.shape == reference.shape
    weight = torch.randn(reference.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = torch.autograd.grad((output.double() * weight).sum(), list(leaves.values()))
    want = torch.autograd.grad((reference * weight).sum(), list(references.values()))
    errors = {"output": relative_error(output, reference)}
    errors |= {name: relative_error(g, w) for name, g, w in zip(leaves, got, want)}
    return errors


def op_case(method: str) -> dict:
    results = {}
    variants = [False, True] if method == "stick-breaking" else [False]
    for dtype in (torch.float32, torch.float16):
        for packed in (False, True):
            for attend_current in variants:
                name = f"{str(dtype)[6:]} {'packed' if packed else 'causal'}" + (" attend_current" * attend_current)
                results[name] = op_errors(method, dtype, packed, attend_current)
    return results


# --- model level: a tiny patched LLaMA, "triton" against "blocked" --------------------------------------------------

MODEL_PATCHES = {
    "fox": [{}, {"base": "native", "qk_norm": True, "output_norm": True, "output_gate": True, "key_shift": True,
                 "value_shift": True, "gate_init": "decay-time"}],
    "stick-breaking": [{}, {"attend_current": True}],
}


def train_step(model, ids, **kwargs):
    """[logits, every parameter's gradient] of one forward and backward."""
    model.zero_grad()
    logits = model(ids, **kwargs).logits
    logits.float().square().mean().backward()
    return [logits.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


def largest_relative_difference(ours: list, theirs: list) -> float:
    assert len(ours) == len(theirs) > 2
    return max(relative_error(a, b) for a, b in zip(ours, theirs))


def model_case(method: str) -> dict:
    import hf_posenc
    from hf_posenc import attention as engine
    from helpers import left_pad
    from tiny_models import random_ids, tiny_model
    from transformers import DynamicCache

    results = {}
    ids = random_ids(2, 24)
    positions = torch.stack([torch.cat((torch.arange(10), torch.arange(14))),
                             torch.cat((torch.arange(7), torch.arange(17)))])
    for options in MODEL_PATCHES[method]:
        model = hf_posenc.patch_model(tiny_model("llama"), method, **options).train()
        with torch.no_grad():  # the gates' parameters off their initial values, so their gradients are not trivial
            for parameter in hf_posenc.get_positional_module(model).parameters():
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(6)))
        label = ",".join(f"{k}={v}" for k, v in options.items()) or "defaults"
        for form, kwargs in (("causal", {}), ("packed", {"position_ids": positions, "use_cache": False})):
            steps = {}
            for path in ("triton", "blocked"):
                engine.last_paths.clear()
                with engine.attention_path(path):
                    steps[path] = (train_step(model, ids, **kwargs), engine.last_paths["triton"])
            results[f"{label} {form}"] = {"difference": largest_relative_difference(steps["triton"][0],
                                                                                    steps["blocked"][0]),
                                          "triton calls": steps["triton"][1], "blocked's": steps["blocked"][1]}
        model.eval()
        with torch.no_grad():
            decoded, served = {}, {}
            for path in ("triton", "blocked"):
                with engine.attention_path(path):
                    cache = DynamicCache(config=model.config)
                    engine.last_paths.clear()
                    model(ids[:, :12], past_key_values=cache, use_cache=True)
                    prefill = engine.last_paths["triton"]
                    engine.last_paths.clear()
                    decoded[path] = model(ids[:, 12:13], past_key_values=cache, use_cache=True).logits
                    served[path] = (prefill, engine.last_paths["triton"], engine.last_paths["content"])
            padded, mask = left_pad([random_ids(1, 12, seed=3)[0], random_ids(1, 7, seed=4)[0]])
            padded_logits = {}
            for path in ("triton", "blocked"):
                with engine.attention_path(path):
                    engine.last_paths.clear()
                    padded_logits[path] = model(padded, attention_mask=mask).logits[mask.bool()]
                    served[f"padded {path}"] = engine.last_paths["triton"]
        results[f"{label} decode"] = {"difference": relative_error(decoded["triton"], decoded["blocked"]),
                                      "prefill triton calls": served["triton"][0],
                                      "decode triton calls": served["triton"][1],
                                      "decode content calls": served["triton"][2]}
        results[f"{label} left padding"] = {
            "difference": (padded_logits["triton"] - padded_logits["blocked"]).abs().max().item(),
            "triton calls": served["padded triton"]}
    results["layers"] = model.config.num_hidden_layers
    results["verdicts"] = [[v.kernel, list(map(str, v.kind)), v.passed, v.error] for v in engine.kernel_status()]
    return results


CASES = {"fox op": lambda: op_case("fox"), "stick-breaking op": lambda: op_case("stick-breaking"),
         "fox model": lambda: model_case("fox"), "stick-breaking model": lambda: model_case("stick-breaking")}

if __name__ == "__main__":
    torch.set_num_threads(1)
    cut = one_config_per_autotuner()
    print(json.dumps({"autotuners cut": cut, **CASES[sys.argv[1]]()}))
