"""Content methods against float64 references written from their authors' code, not from ours.

CAPE: chuanyang-Zheng/CAPE (megatron/model/positional_embeddings.py `AliBi_C`, DAPE.py `AliBi_DAPE`): the attention
scores x (scaled q . k per head), ALiBi's a = -tril(i - j) * slope, and
    x + a + mlp2(cat(x, a) over heads),   mlp2 = nn.Sequential(nn.Linear(2H, width), nn.LeakyReLU(), nn.Linear(width, H))
with nn.Linear's default init; ours is base="none" with the bias "alibi" (GELU in place of LeakyReLU as an option).

TAPE: zhuconv/TAPE's LLaMA decoder layer (`AdaLlamaDecoderLayer`, `PELayer`): after a layer's attention has averaged
the position features (and the residual is added), its MLP runs and the features get
    e += down_proj(act(x_proj(mlp_output)) * up_proj(e))   (act the model's hidden_act, SiLU for LLaMA)
per token, mixing heads; ours takes the gate input option gate_input="mlp_output" for that (the default reads the
next layer's attention input instead).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import hf_posenc
from helpers import max_diff
from hf_posenc.engine.kernels.by_method import causal_kernel
from hf_posenc.methods.base import ContentBlock
from tiny_models import random_ids, tiny_model

TOL = 1e-8


# --- CAPE -------------------------------------------------------------------------------------------------------------
def authors_alibi_slopes(n: int) -> list[float]:
    """AliBi_C._get_slopes (the authors' copy of ALiBi's slopes)."""
    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + authors_alibi_slopes(2 * closest)[0::2][:n - closest]


def authors_mlp(module, layer: int, activation: nn.Module) -> nn.Sequential:
    """The authors' mlp2, float64, holding our layer's weights."""
    heads, width = module.output_weight.shape[1:]
    mlp = nn.Sequential(nn.Linear(2 * heads, width), activation, nn.Linear(width, heads)).double()
    with torch.no_grad():
        mlp[0].weight.copy_(module.input_weight[layer])
        mlp[0].bias.copy_(module.input_bias[layer])
        mlp[2].weight.copy_(module.output_weight[layer])
        mlp[2].bias.copy_(module.output_bias[layer])
    return mlp


def authors_alibi_c_scores(x: torch.Tensor, mlp: nn.Sequential) -> torch.Tensor:
    """AliBi_C.forward on scores x [b, np, sq, sk] (sq == sk), float64."""
    heads, length = x.shape[1], x.shape[-1]
    a = -torch.tril(torch.arange(length).view(length, 1).repeat(1, length) + torch.arange(0, -length, -1))
    a = a.to(x.dtype) * torch.tensor(authors_alibi_slopes(heads), dtype=x.dtype).view(heads, 1, 1)
    x_a_bias = torch.cat((x, torch.tile(a, (x.shape[0], 1, 1, 1))), dim=1).permute(0, 2, 3, 1)
    return x + a + mlp(x_a_bias).permute(0, 3, 1, 2)


def causal_attention(scores: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    length = scores.shape[-1]
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ value


def cape_inputs(heads=4, length=11, head_dim=16, seed=3):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, heads, length, head_dim, dtype=torch.float64, generator=generator) for _ in range(3)]


def cape_module(activation: str | None):
    options = {} if activation is None else {"activation": activation}
    model = hf_posenc.patch_model(tiny_model("llama"), "cape", mlp_width=8, **options)
    module = hf_posenc.get_positional_module(model)
    with torch.no_grad():  # the init's biases are small: larger ones move more pairs across LeakyReLU's kink
        for parameter in (module.input_bias, module.output_weight, module.output_bias):
            parameter.normal_(0, 0.5, generator=torch.Generator().manual_seed(6))
    return module


@pytest.mark.parametrize("activation, authors_activation", [(None, nn.LeakyReLU()), ("gelu", nn.GELU())])
def test_cape_scores_are_the_authors_alibi_c(activation, authors_activation):
    """Our scores (content_scores, the blocked path's; float64 in, float64 out) equal AliBi_C's on every causal pair,
    with the authors' LeakyReLU by default and nn.GELU as the option; both layers."""
    module = cape_module(activation)
    query, key, _ = cape_inputs()
    length, scaling = query.shape[2], query.shape[-1] ** -0.5
    positions = torch.arange(length)[None]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    for layer in range(2):
        block = ContentBlock(layer_idx=layer, scaling=scaling, allowed=causal[None, None], bias=None,
                             query_positions=positions, key_positions=positions, query_state=None, key_state=None,
                             query_slots=torch.arange(length), key_slots=torch.arange(length))
        ours = module.content_scores(query, key, block)
        theirs = authors_alibi_c_scores(query @ key.transpose(-1, -2) * scaling,
                                        authors_mlp(module, layer, authors_activation))
        assert ours.dtype == torch.float64
        assert max_diff(ours[..., causal], theirs[..., causal]) <= TOL * theirs.abs().max()


@pytest.mark.parametrize("activation, authors_activation", [(None, nn.LeakyReLU()), ("gelu", nn.GELU())])
def test_cape_fused_kernel_is_the_authors_alibi_c(activation, authors_activation):
    """The fused CPU kernel (the CPU's path for a causal square), float64: AliBi_C's scores through a causal softmax."""
    module = cape_module(activation)
    query, key, value = cape_inputs()
    length, scaling = query.shape[2], query.shape[-1] ** -0.5
    for layer in range(2):
        ours = causal_kernel(module).run(module, layer, query, key, value, scaling, torch.arange(length)[None])
        scores = authors_alibi_c_scores(query @ key.transpose(-1, -2) * scaling,
                                        authors_mlp(module, layer, authors_activation))
        theirs = causal_attention(scores, value)
        assert ours.dtype == torch.float64
        assert max_diff(ours, theirs) <= TOL * theirs.abs().max()


def test_cape_defaults_to_the_authors_activation_and_init():
    """activation="leaky_relu" by default; every layer of the MLP starts as nn.Linear's default (weights and biases
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)): within the bound, and spread as a uniform is, std bound / sqrt(3)); on top of
    the model's own mechanism the output layer starts at zero."""
    model = hf_posenc.patch_model(tiny_model("llama"), "cape")
    module = hf_posenc.get_positional_module(model)
    assert module.config.activation == "leaky_relu"
    heads, width = module.output_weight.shape[1:]
    for tensor, fan_in in ((module.input_weight, 2 * heads), (module.input_bias, 2 * heads),
                           (module.output_weight, width), (module.output_bias, width)):
        bound = 1 / math.sqrt(fan_in)
        assert float(tensor.detach().abs().max()) <= bound
        assert abs(float(tensor.detach().std()) / (bound / math.sqrt(3)) - 1) <= 0.3
    native = hf_posenc.get_positional_module(hf_posenc.patch_model(tiny_model("llama"), "cape", base="native"))
    assert not native.output_weight.any() and not native.output_bias.any()
    assert torch.equal(native.input_weight, module.input_weight)


def test_a_cape_checkpoint_saved_before_the_activation_option_loads_as_gelu(tmp_path):
    """A posenc_config.json without `activation` (written before the option existed, when CAPE computed GELU) loads
    as "gelu", the logits it was saved with; a patch made now without the option gets LeakyReLU."""
    model = hf_posenc.patch_model(tiny_model("llama"), "cape", activation="gelu")
    with torch.no_grad():
        for parameter in hf_posenc.get_positional_module(model).parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(2)))
    ids = random_ids(1, 12)
    with torch.no_grad():
        saved_logits = model(ids).logits
    model.save_pretrained(tmp_path)
    path = tmp_path / "posenc_config.json"
    metadata = json.loads(path.read_text())
    assert metadata["options"].pop("activation") == "gelu"
    path.write_text(json.dumps(metadata))
    loaded = hf_posenc.from_pretrained(tmp_path)
    assert hf_posenc.get_positional_module(loaded).config.activation == "gelu"
    with torch.no_grad():
        assert max_diff(loaded(ids).logits, saved_logits) <= 1e-6
    assert hf_posenc.get_positional_module(hf_posenc.patch_model(tiny_model("llama"), "cape")).config.activation \
        == "leaky_relu"
