"""Content methods against float64 references written from their authors' code, not from ours.

CAPE: chuanyang-Zheng/CAPE (megatron/model/positional_embeddings.py `AliBi_C`, DAPE.py `AliBi_DAPE`): the attention
scores x (scaled q . k per head), ALiBi's a = -tril(i - j) * slope, and
    x + a + mlp2(cat(x, a) over heads),   mlp2 = nn.Sequential(nn.Linear(2H, width), nn.LeakyReLU(), nn.Linear(width, H))
with nn.Linear's default init; ours is base="none" with the bias "alibi" (GELU in place of LeakyReLU as an option).

TAPE: VITA-Group/TAPE models/llama/adape.py (`LlamaDecoderLayer`, `PELayer`): a layer's attention averages the
position features e (cos, sin) with its weights, e += einsum('bqnd,qe->bqnd', average, post_attention_linear.weight),
then its MLP runs and the features get
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
from transformers import AutoModelForCausalLM

import hf_posenc
from helpers import max_diff
from hf_posenc.engine.kernels.by_method import causal_kernel
from hf_posenc.methods.base import ContentBlock
from tiny_models import CONFIGS, random_ids, tiny_model

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


# --- TAPE -------------------------------------------------------------------------------------------------------------
def authors_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward of models/llama/adape.py."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def authors_rotate_half(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)


def authors_pe_layer(x, e, up_weight, x_weight, down_weight):
    """PELayer.forward: e (cos, sin) [b, heads, seq, head_dim] each, x the layer's MLP output [b, seq, hidden]."""
    up_e = tuple(torch.einsum('bqnd,eq->bend', i, up_weight) for i in e)
    x_e = tuple(nn.functional.silu((x @ x_weight.T).transpose(1, 2).unsqueeze(-1)) * i for i in up_e)
    return tuple(torch.einsum('bend,qe->bqnd', i, down_weight) for i in x_e)


def authors_tape_logits(model, authors_weights, ids: torch.Tensor) -> torch.Tensor:
    """MyLlamaForCausalLM.forward of VITA-Group/TAPE models/llama/adape.py in float64, eval mode, no cache (the
    authors' attention asserts one query head per key-value head): AdaRotaryEmbedding's cos/sin per head as the
    first position states, then per layer LlamaDecoderLayer.forward with PELlamaAttention's eager path, the weights
    of our model (its embedding, attention, MLP, norms, head) and `authors_weights[layer]` = (post_attention_linear,
    up_proj, x_proj, down_proj) weights."""
    config = model.config
    heads, hidden_size = config.num_attention_heads, config.hidden_size
    head_dim = hidden_size // heads
    base = model.model
    batch, length = ids.shape
    inv_freq = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).double() / head_dim))
    emb = torch.einsum("i,j->ij", torch.arange(length).double(), inv_freq)
    emb = torch.cat((emb, emb), dim=-1)
    position_states = tuple(f(emb)[None, None].repeat(1, heads, 1, 1).expand(batch, -1, -1, -1)
                            for f in (torch.cos, torch.sin))
    mask = torch.full((length, length), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)
    hidden_states = base.embed_tokens.weight[ids]
    for layer, (post_attention, up_weight, x_weight, down_weight) in zip(base.layers, authors_weights):
        attention, mlp = layer.self_attn, layer.mlp
        residual, pos_residual = hidden_states, position_states
        x = authors_rms_norm(hidden_states, layer.input_layernorm.weight, config.rms_norm_eps)

        def heads_of(projection):
            return (x @ projection.weight.T).view(batch, length, heads, head_dim).transpose(1, 2)
        query, key, value = heads_of(attention.q_proj), heads_of(attention.k_proj), heads_of(attention.v_proj)
        cos, sin = position_states
        query, key = query * cos + authors_rotate_half(query) * sin, key * cos + authors_rotate_half(key) * sin
        weights = torch.softmax(query @ key.transpose(2, 3) / math.sqrt(head_dim) + mask, dim=-1)
        attn_output = (weights @ value).transpose(1, 2).reshape(batch, length, hidden_size)
        pos_output = (weights @ cos, weights @ sin)
        hidden_states = residual + attn_output @ attention.o_proj.weight.T
        position_states = tuple(torch.einsum('bqnd,qe->bqnd', pos_output[i], post_attention) for i in range(2))
        position_states = tuple(a + b for a, b in zip(position_states, pos_residual))
        residual, pos_residual = hidden_states, position_states
        x = authors_rms_norm(hidden_states, layer.post_attention_layernorm.weight, config.rms_norm_eps)
        x = (nn.functional.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
        position_states = authors_pe_layer(x, position_states, up_weight, x_weight, down_weight)
        hidden_states = residual + x
        position_states = tuple(a + b for a, b in zip(position_states, pos_residual))
    return authors_rms_norm(hidden_states, base.norm.weight, config.rms_norm_eps) @ model.lm_head.weight.T


def tape_with_the_authors_weights(gate_input: str | None):
    """A float64 tiny LLaMA without grouped queries (the authors' code has none) patched with TAPE, and the authors'
    per-layer weights it computes. The authors' layer l updates the features the next layer reads; ours does that at
    layer l + 1, so our layer l + 1 holds the authors' layer l's maps (our first layer's are unused, as are the
    authors' last layer's). Their `einsum('bqnd,qe->bqnd', e, post_attention_linear.weight)` sums the weight's
    second index out: a scale per head, our attention_mix as the diagonal of its row sums."""
    config = CONFIGS["llama"]()
    config.num_key_value_heads = config.num_attention_heads
    torch.manual_seed(0)
    options = {} if gate_input is None else {"gate_input": gate_input}
    model = hf_posenc.patch_model(AutoModelForCausalLM.from_config(config).eval(), "tape", width=6, **options)
    model = model.double()
    module = hf_posenc.get_positional_module(model)
    generator = torch.Generator().manual_seed(4)
    layers, heads, width = config.num_hidden_layers, config.num_attention_heads, 6
    authors = [(torch.randn(heads, heads, generator=generator, dtype=torch.float64) * 0.3,
                torch.randn(width, heads, generator=generator, dtype=torch.float64) * 0.5,
                torch.randn(width, config.hidden_size, generator=generator, dtype=torch.float64) * 0.5,
                torch.randn(heads, width, generator=generator, dtype=torch.float64) * 0.5) for _ in range(layers)]
    with torch.no_grad():
        for layer in range(layers - 1):
            post_attention, up_weight, x_weight, down_weight = authors[layer]
            module.attention_mix[layer + 1] = torch.diag(post_attention.sum(1))
            module.feature_up[layer + 1] = up_weight
            module.content_gate[layer + 1] = x_weight
            module.feature_down[layer + 1] = down_weight
    return model, authors


def test_tape_with_the_mlp_output_gate_is_the_authors_decoder_layer():
    """gate_input="mlp_output": the logits of the authors' decoder layers (float64) to the float32 that our features
    are computed in; the default gate (the next attention's input) computes something else."""
    ids = random_ids(2, 13)
    model, authors = tape_with_the_authors_weights("mlp_output")
    default, _ = tape_with_the_authors_weights(None)
    assert hf_posenc.get_positional_module(default).config.gate_input == "attention_input"
    with torch.no_grad():
        theirs = authors_tape_logits(model, authors, ids)
        ours, other = model(ids).logits, default(ids).logits
    scale = theirs.abs().max()
    assert max_diff(ours, theirs) <= 1e-6 * scale
    assert max_diff(other, theirs) >= 1e-3 * scale
