"""Per-token state of content methods (methods/base.py ContentMethod), and how a KV cache carries it.

A content method may need the attention layer's input x_t (FoX's forget gate is sigmoid(w . x_t + b)) and a
per-token state derived from it that later queries read for every key (FoX: the cumulative log forget gate c_j).
Three hooks, installed by the family with the method and undone with it:

- `ContentCapture`, a forward pre-hook on the base model (after the position capture): starts this forward's
  `ContentCall` on the position state's call, with the state of the cached tokens read from the KV cache
  (`CONTENT_STATE_ATTR`: {layer index: [B, H, n, ...]}), cut to the cache's length (a cropped cache drops the
  state of the tokens it dropped);
- `LayerInputCapture`, a forward pre-hook on each routed attention module: records the layer input of this call;
- `MlpOutputCapture`, for methods that read it (`reads_mlp_output`), hooks on each layer's MLP: records its output;
- `RecordContentState`, a forward hook on the base model: puts every layer's state (cached tokens and this
  forward's) on the returned cache, beside the key positions state.py keeps there.

The attention path (`layer_state`) extends the cached state with this call's tokens once per layer and call. So a
token's state is computed once, from its own layer input, and decoding reads exactly the values a full forward
computed (DynamicCache and StaticCache alike: a StaticCache's free slots get zeros, and are masked). Left padding
needs nothing more: padding tokens get a state like any token, and their keys are masked.

The state follows the cache's own batch edits, which `generate` makes for beam search and contrastive search:
`reorder_cache`, `batch_select_indices` and `batch_repeat_interleave` (engine/cache_rows.py). Under torch.compile
(where the position capture traces) content methods refuse to run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import PosEncError
from .cache_names import cache_argument, cache_output
from .cache_rows import carries_rows, follow_batch_edits
from .state import PositionState, attended_tokens

CONTENT_STATE_ATTR = "hf_posenc_content_state"  # on a KV cache: {layer index: float32 [B, H, n, ...]}


@dataclass
class ContentCall:
    """The content state of one forward: which of its tokens are padding (`real`, from the base model's 2-D
    attention_mask), the cached tokens' state per layer (`past`), the layer inputs of this call (`inputs`) and every
    token's state once a layer has run (`states`)."""

    offset: int
    real: torch.Tensor | None = None  # bool [B, q]: this call's tokens that are not padding (None: all are)
    past: dict[int, torch.Tensor] = field(default_factory=dict)
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    mlp_outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # for `reads_mlp_output` methods
    held_residuals: dict[int, torch.Tensor] = field(default_factory=dict)  # MlpOutputCapture's, during an MLP call
    states: dict[int, torch.Tensor] = field(default_factory=dict)
    # For `mixes_state` methods: per layer, the attention-weighted average of the keys' state for this call's
    # queries [B, H, q, ...] (float32), which the next layer's `layer_token_state` reads.
    mixed: dict[int, torch.Tensor] = field(default_factory=dict)
    # For reentrant gradient checkpointing (see `carried_state`): the grad mode of the forward, the layers whose
    # first pass ran without grad in it, and per layer the leaves the next layer read its hand-over as.
    grad_enabled: bool = False
    no_grad_layers: set[int] = field(default_factory=set)
    relayed: dict[int, tuple] = field(default_factory=dict)
    relayed_mlp_outputs: dict[int, tuple] = field(default_factory=dict)  # the same, for `carried_mlp_output`


def compile_refusal(method: str) -> str:
    """Why a content method's model cannot be traced by torch.compile (what ContentCapture raises there)."""
    return (f"{method!r} carries per-token state on the KV cache, which torch.compile cannot trace here; run the "
            "model uncompiled.")


class ContentCapture:
    """Forward pre-hook (with kwargs) on the base model: starts the forward's ContentCall."""

    def __init__(self, state: PositionState, parameter_names: list[str]):
        self.state = state
        self.parameter_names = parameter_names

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        if torch.compiler.is_compiling():
            raise PosEncError(compile_refusal(self.state.method.config.method))
        arguments = dict(zip(self.parameter_names, args))
        arguments.update(kwargs)
        cache = cache_argument(arguments)
        offset = int(cache.get_seq_length()) if cache is not None else 0
        past = getattr(cache, CONTENT_STATE_ATTR, None) if offset else None
        source = arguments.get("inputs_embeds")
        source = arguments.get("input_ids") if source is None else source[..., 0]
        attended = attended_tokens(arguments.get("attention_mask"), offset + source.shape[-1]) \
            if source is not None else None
        call = ContentCall(offset, attended[:, offset:] if attended is not None else None,
                           grad_enabled=torch.is_grad_enabled())
        for layer, tensor in (past or {}).items():
            if tensor.shape[2] >= offset:
                call.past[layer] = tensor[:, :, :offset]
        self.state.forward.content = call
        return None


class LayerInputCapture:
    """Forward pre-hook (with kwargs) on an attention module: records its input hidden states [B, q, hidden]."""

    def __init__(self, state: PositionState, layer_idx: int):
        self.state = state
        self.layer_idx = layer_idx

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        content = getattr(self.state.forward, "content", None)
        if content is not None and hidden is not None:
            content.inputs[self.layer_idx] = hidden
        return None


class MlpOutputCapture:
    """Hooks on one layer's MLP: record its output [B, q, hidden], what the layer adds to the residual stream.

    An MLP that adds the residual itself (BLOOM's `BloomMLP(hidden_states, residual)`, `residual_argument` its
    index) runs on a zero residual instead, so its output is the MLP's own (0 + dropout(y) is dropout(y) exactly),
    and the forward hook adds the held residual back: residual + dropout(y), the sum the MLP computes."""

    def __init__(self, state: PositionState, layer_idx: int, residual_argument: int | None = None):
        self.state = state
        self.layer_idx = layer_idx
        self.residual_argument = residual_argument

    def hold_residual(self, module: nn.Module, args: tuple, kwargs: dict):
        """Forward pre-hook (with kwargs), only where the MLP adds the residual itself."""
        content = getattr(self.state.forward, "content", None)
        if content is None:
            return None
        index = self.residual_argument
        if "residual" in kwargs:
            residual = kwargs["residual"]
            kwargs = {**kwargs, "residual": torch.zeros_like(residual)}
        else:
            residual = args[index]
            args = (*args[:index], torch.zeros_like(residual), *args[index + 1:])
        content.held_residuals[self.layer_idx] = residual
        return args, kwargs

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor):
        content = getattr(self.state.forward, "content", None)
        if content is None:
            return None
        content.mlp_outputs[self.layer_idx] = output
        if torch.is_grad_enabled() and output.requires_grad:
            output = _AddLeafGradients.apply(output, content.relayed_mlp_outputs, self.layer_idx, output)
        residual = content.held_residuals.pop(self.layer_idx, None)
        return output if residual is None else residual + output


class RecordContentState:
    """Forward hook (with kwargs) on the base model: the state of every token goes onto the returned cache."""

    def __init__(self, state: PositionState):
        self.state = state

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        cache = cache_output(output)
        content = getattr(self.state.forward, "content", None)
        if cache is not None and content is not None:
            setattr(cache, CONTENT_STATE_ATTR, dict(content.states))
            follow_batch_edits(cache)
        return output


carries_rows(CONTENT_STATE_ATTR, lambda states, edit: {layer: edit.rows(state) for layer, state in states.items()})


def layer_state(state: PositionState, layer_idx: int, q: int, key_slots: torch.Tensor):
    """(layer input [B, q, hidden] or None, state of the queries [B, H, q, ...] or None, state of the keys
    [B, H, kv, ...] or None) for this call of layer `layer_idx`, the keys being the cache slots `key_slots`."""
    method = state.method
    content: ContentCall | None = getattr(state.forward, "content", None)
    if content is None:
        raise RuntimeError("hf_posenc: a content method's attention ran before the base model's pre-hook.")
    layer_input = content.inputs.get(layer_idx)
    if method.reads_layer_input and layer_input is None:
        raise RuntimeError(f"hf_posenc: no layer input was captured for layer {layer_idx}.")
    if method.mixes_state and layer_input is not None:
        if content.grad_enabled and not torch.is_grad_enabled():  # a reentrant checkpoint's first pass
            content.no_grad_layers.add(layer_idx)
        below = [layer for layer in content.states if layer < layer_idx]
        previous, mixed = carried_state(content, max(below), layer_idx) if below else (None, None)
        update_input = layer_input
        if method.reads_mlp_output and below:
            update_input = carried_mlp_output(content, max(below), layer_idx)
        new = method.layer_token_state(layer_idx, update_input, state.forward.query_positions.to(layer_input.device),
                                       previous[:, :, content.offset:content.offset + q] if below else None, mixed)
    else:
        new = method.token_state(layer_idx, layer_input, content.real) if layer_input is not None else None
    if new is None:
        return layer_input, None, None
    past = content.past.get(layer_idx)
    if past is not None and (past.shape[0] != new.shape[0] or past.shape[2] != content.offset):
        raise PosEncError(
            f"The KV cache holds the per-token state of {past.shape[2]} tokens in {past.shape[0]} rows for "
            f"{method.config.method!r}, but this forward continues {content.offset} tokens in {new.shape[0]} rows: "
            "a cache reordered or expanded outside hf_posenc's view (beam search, num_return_sequences > 1) cannot "
            "be followed; decode greedily or by sampling, one sequence per prompt.")
    if content.offset and past is None:
        raise PosEncError(
            f"{method.config.method!r} needs the per-token state of the {content.offset} cached tokens, and this "
            "KV cache was filled without it (by another model or before the patch): start from an empty cache.")
    every = method.extend_token_state(past.to(new.device) if past is not None else None, new)
    content.states[layer_idx] = every
    first = state.first_key_slot(q, key_slots.numel())
    keys = every[:, :, first:first + key_slots.numel()]
    missing = key_slots.numel() - keys.shape[2]
    if missing > 0:  # a StaticCache's free slots (masked)
        keys = torch.cat((keys, keys.new_zeros((*keys.shape[:2], missing, *keys.shape[3:]))), dim=2)
    return layer_input, every[:, :, content.offset:content.offset + q], keys


def carried_state(content: ContentCall, layer: int, reader: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(state of every token, attention-weighted state) that layer `layer` of a `mixes_state` method (TAPE) hands to
    the next layer, `reader`, outside the hidden states.

    Reentrant checkpointing runs each layer's first pass without grad and, in the backward, recomputes it and runs a
    backward of its own from the layer's outputs only (issue 51): a hand-over made without grad carries no gradient
    back, and one read with its graph in a recomputation would be differentiated by two backwards. So where either
    layer is checkpointed so (`no_grad_layers`), the reader reads leaves requiring grad, and the producer's
    RelayCarriedState adds the gradients left on them (complete by then: the later layer's backward runs first)."""
    states, mixed = content.states[layer], content.mixed.get(layer)
    if torch.is_grad_enabled() and (layer in content.no_grad_layers or reader in content.no_grad_layers):
        leaves = (states.detach().requires_grad_(), None if mixed is None else mixed.detach().requires_grad_())
        content.relayed[layer] = leaves
        return leaves
    return states, mixed


def carried_mlp_output(content: ContentCall, layer: int, reader: int) -> torch.Tensor:
    """Layer `layer`'s MLP output as the next layer, `reader`, reads it (TAPE's gate_input='mlp_output'): across a
    reentrant checkpoint's boundary as a leaf, for the reason `carried_state` gives; MlpOutputCapture's
    `_AddLeafGradients` hands the leaf's gradient to the MLP output in the producing layer's recomputation."""
    output = content.mlp_outputs.get(layer)
    if output is None:
        raise RuntimeError(f"hf_posenc: no MLP output was captured for layer {layer}.")
    if torch.is_grad_enabled() and (layer in content.no_grad_layers or reader in content.no_grad_layers):
        leaf = output.detach().requires_grad_()
        content.relayed_mlp_outputs[layer] = (leaf,)
        return leaf
    return output


class _AddLeafGradients(torch.autograd.Function):
    """Identity on `output`; its backward also gives `tensors` (what layer `layer` handed to the next layer) the
    gradients left on the leaves the next layer read them as (`carried_state`, `carried_mlp_output`), which
    `relayed[layer]` holds, one leaf per tensor, if it read leaves. Passing `output` itself as a tensor adds its
    leaf's gradient to its own (autograd sums the two edges)."""

    @staticmethod
    def forward(ctx, output, relayed, layer, *tensors):
        ctx.relayed, ctx.layer, ctx.count = relayed, layer, len(tensors)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        leaves = ctx.relayed.pop(ctx.layer, None) or (None,) * ctx.count
        return (grad_output, None, None, *(None if leaf is None else leaf.grad for leaf in leaves))


class RelayCarriedState:
    """Forward hook on the attention module of layer `layer_idx` of a `mixes_state` method, where grad is on: routes
    the gradients of the layer's hand-over that the next layer left on leaves (`carried_state`) into this layer's
    graph, through the attention output, whose gradient the layer's backward passes anyway. (An identity node per
    layer where no leaves are read.)"""

    def __init__(self, state: PositionState, layer_idx: int):
        self.state = state
        self.layer_idx = layer_idx

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        content = getattr(self.state.forward, "content", None)
        if content is None or not torch.is_grad_enabled() or self.layer_idx not in content.states:
            return None
        first = output[0] if isinstance(output, tuple) else output
        relayed = _AddLeafGradients.apply(first, content.relayed, self.layer_idx, content.states[self.layer_idx],
                                          content.mixed.get(self.layer_idx))
        return (relayed, *output[1:]) if isinstance(output, tuple) else relayed


def install_content(family, model: nn.Module, state: PositionState, log) -> None:
    """The three hooks of a content method (the family has routed attention already)."""
    from .state import forward_parameter_names

    base = family.base_model(model)
    log.add_forward_pre_hook(base, ContentCapture(state, forward_parameter_names(base)), with_kwargs=True)
    log.add_forward_hook(base, RecordContentState(state), with_kwargs=True)
    if not state.method.reads_layer_input:
        return
    mlps = family.mlp_modules(model) if state.method.reads_mlp_output else None
    for index, attention in enumerate(family.attention_modules(model)):
        layer_idx = getattr(attention, "layer_idx", None)
        layer_idx = index if layer_idx is None else layer_idx
        log.add_forward_pre_hook(attention, LayerInputCapture(state, layer_idx), with_kwargs=True)
        if state.method.mixes_state:
            log.add_forward_hook(attention, RelayCarriedState(state, layer_idx), with_kwargs=True)
        if mlps is not None:
            capture = MlpOutputCapture(state, layer_idx, family.mlp_residual_argument)
            if capture.residual_argument is not None:
                log.add_forward_pre_hook(mlps[index], capture.hold_residual, with_kwargs=True)
            log.add_forward_hook(mlps[index], capture, with_kwargs=True)
