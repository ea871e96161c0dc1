"""The method protocol. A positional method is an nn.Module built from its config and the model's ModelInfo: a
subclass of PositionalMethod and of at most one of its four kinds below, which says where it acts (tested with
isinstance, nothing else):

- PositionalMethod alone: nowhere (NoPE);
- AbsolutePositionMethod: `embed(positions)` is added to the input embeddings;
- AttentionBiasMethod: `bias(layer_idx, query_positions, key_positions)` is added to attention scores;
- RotaryMethod: `rotation(positions)` (by default `cos_sin(positions)`) rotates queries and keys, applied by
  `rotate_heads`; a method whose rotation is not a cos/sin pair per dimension (a b x b matrix per block) overrides
  both and rotates inside the shared attention path (`rotates_in_attention`);
- ContentMethod: attention that reads content (the layer's input, queries, keys, per-token state carried by the
  KV cache): `content_scores` per query block (or `content_weights`, for attention that is not a softmax), served
  by the shared attention path (engine/attention/content_path.py `content_attention`, engine/content.py).

Every capability the engine (families, per-forward state, attention path, checkpoints) reads from a method is
declared here, once, with its default: a class attribute or a method that a subclass overrides in its class body.
Defining a subclass checks its names (`check_method_names`): a name that misses a capability by a typo
(`alibi_slope`), or a capability of another kind of method, is refused, since the engine would never read it and the
method would silently take a slower or different path. A method's own helpers are free otherwise. A method's fast
kernels are not capabilities: the engine finds them by the method's name (engine/kernels/by_method.py), and this
package imports nothing from the engine.

Everything here is computed in float32 whatever the model's dtype (a bf16 bias or frequency table
loses the precision that long contexts need).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..config import PosEncConfig
from ..errors import PosEncError
from ..model_info import ModelInfo


@dataclass(frozen=True)
class KeptKeys:
    """The keys a method attends to however long the text: the first `num_sinks` tokens and the `window - 1` before
    the newest. The engine keeps only those in a bounded KV cache (engine/sink_cache.py SinkCache), which `generate`
    creates in place of its DynamicCache."""

    num_sinks: int
    window: int


class PositionalMethod(nn.Module):
    """Capabilities of every method (subclass it directly for a method that adds no position at all)."""

    # How many float32 [B, H, rows, keys] tensors the method makes per query block in the shared attention path (its
    # bias and its temporaries, or the mask alone): the blocked path sizes its query blocks by it.
    block_cost: ClassVar[float] = 1.0

    def __init__(self, config: PosEncConfig, info: ModelInfo):
        super().__init__()
        self.config = config
        self.num_heads = info.num_heads

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__module__ != __name__:  # the classes of this module declare the protocol; the others use it
            check_method_names(cls)

    def extra_repr(self) -> str:
        return repr(self.config)

    def builds_on(self) -> list[PosEncConfig]:
        """Configs of the patches that must be applied, in order, before this one computes the same on a freshly
        loaded model (a checkpoint replays them). Most methods build on nothing."""
        return []

    @property
    def masks_keys(self) -> bool:
        """True when `allowed_keys` hides keys beyond causality (xPos's blockwise causal attention)."""
        return False

    def allowed_keys(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor | None:
        """An extra key mask [B or 1, 1, q, kv] (True = may attend) on top of causality, or None."""
        return None

    def kept_keys(self) -> KeptKeys | None:
        """The only keys this method can still attend to (StreamingLLM's sinks and window), which the engine's
        bounded KV cache keeps; None for methods that may attend to every earlier token."""
        return None

    def is_native(self, info: ModelInfo) -> bool:
        """True when the model's own positional mechanism already computes exactly this method (the patch then
        removes and adds nothing)."""
        return False

    def native_config_update(self) -> dict | None:
        """{config attribute: value} with which a LLaMA-family config.json reproduces this method in plain
        transformers (rope_parameters, max_position_embeddings), or None if transformers has no equivalent."""
        return None


class AbsolutePositionMethod(PositionalMethod):
    def embed(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [B or 1, q] (long) -> float32 [B or 1, q, hidden]."""
        raise NotImplementedError

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        """As a model's own position-embedding module (GPT-2's wpe): position_ids [..., q] -> [..., q, hidden]."""
        return self.embed(position_ids.reshape(-1, position_ids.shape[-1]).long()).reshape(
            *position_ids.shape, -1)


@dataclass(frozen=True)
class PositionSpan:
    """What the positions of one forward span (read from the device once per forward, engine/attention/geometry.py
    `position_span`): a table of distances sized from it serves every block of every layer, where sizing it from
    each block's own positions would wait for the device once per block."""

    max_query_position: int
    min_key_position: int

    @classmethod
    def of(cls, query_positions: torch.Tensor, key_positions: torch.Tensor) -> PositionSpan:
        return cls(int(query_positions.max()), int(key_positions.min()))

    @property
    def distances(self) -> int:
        """How many distances (0, 1, ...) a table must hold for any query and key of the forward."""
        return max(1, self.max_query_position - self.min_key_position + 1)


class BiasForm:
    """One attention call's bias, tile by tile, for a backward that never keeps a per-pair bias tensor (engine/
    attention/form_attention.py): `tile` gives the bias of query rows x key columns and what `accumulate` needs
    again; `accumulate` takes the gradient dS of that tile and reduces it into the method's own parameters;
    `gradients` returns, after the last tile, one gradient (or None) per tensor of `tensors`, through which autograd
    continues to the method's parameters."""

    tensors: tuple[torch.Tensor, ...] = ()

    def tile(self, rows: slice, columns: slice) -> tuple[torch.Tensor, object]:
        """(float32 bias [B or 1, H, r, k] of query rows x key columns, a new tensor; what `accumulate` needs)."""
        raise NotImplementedError

    def start_backward(self, dtype: torch.dtype, needed: list[bool]) -> None:
        """Before the first `accumulate`: the dtype dS comes in, and which of `tensors` need a gradient."""
        raise NotImplementedError

    def accumulate(self, saved: object, grad_bias: torch.Tensor) -> None:
        """grad_bias [B, H, r, k]: the loss's gradient w.r.t. the bias of the tile `tile` returned `saved` for."""
        raise NotImplementedError

    def gradients(self) -> tuple[torch.Tensor | None, ...]:
        raise NotImplementedError


class AttentionBiasMethod(PositionalMethod):
    def bias(self, layer_idx: int, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """query_positions [B or 1, q], key_positions [B or 1, kv] -> float32 [B or 1, heads, q, kv]: each token's
        own position id. Entries whose key slot is after the query's are masked; a key whose position is not
        before the query's (position ids that restart) gets the bias at distance 0."""
        raise NotImplementedError

    def block_bias(self, layer_idx: int, query_positions: torch.Tensor, key_positions: torch.Tensor,
                   span: PositionSpan | None) -> torch.Tensor:
        """`bias` of one block of a forward whose positions span `span` (None: unknown), which the attention path
        calls: a method that sizes something from the positions (a table of distances) sizes it from the span
        instead of reading the block's positions. Default: `bias`."""
        return self.bias(layer_idx, query_positions, key_positions)

    def bias_table(self, layer_idx: int, num_distances: int, max_position: int | None = None,
                   device: torch.device | None = None) -> torch.Tensor | None:
        """float32 [H, num_distances]: the bias at distances 0..num_distances-1 when, for queries at positions up to
        `max_position`, it depends on the distance i - j alone; else None. With a table the attention path never
        materialises the bias (a Toeplitz view per query block, a flex_attention score_mod)."""
        return None

    def bias_form(self, layer_idx: int, query_positions: torch.Tensor, key_positions: torch.Tensor,
                  span: PositionSpan | None) -> BiasForm | None:
        """The bias of a call whose positions span `span` as a `BiasForm` (a bias computed per tile, whose gradient
        the method reduces itself), where `bias_table` gives none and the bias takes a gradient; None: the attention
        path differentiates `block_bias` by autograd."""
        return None

    def alibi_slopes(self, device: torch.device) -> torch.Tensor | None:
        """float32 [H] slopes s_h when the bias is exactly ALiBi's -s_h * (i - j) and the slopes take no gradient;
        else None. A kernel with ALiBi built in (flash-attn's alibi_slopes) then serves the method."""
        return None


class RotaryMethod(PositionalMethod):
    # Rotate queries and the whole (un-rotated) key cache inside the shared attention path rather than before
    # the cache update: needed when the rotation of old keys changes with the length (dynamic scalings) or
    # differs between queries and keys (xPos).
    rotates_in_attention: ClassVar[bool] = False
    # The frequencies depend on the current length (highest position + 1).
    length_dependent: ClassVar[bool] = False
    # For length-dependent methods: when the scale changes, run the text so far again so that cached decoding equals a
    # full forward (engine/replay.py); False keeps only the in-attention rotation.
    exact_cache: bool = False
    # Rotate each query block with the keys it sees, inside the shared attention path, when a call's queries lie
    # further apart than `max_query_spread(dtype)` (else all queries and keys once, as other methods): for methods
    # whose factors are only bounded relative to a centre near the queries (xPos).
    rotates_per_query_block: ClassVar[bool] = False
    # Compute each query block's attention scores with `block_scores` from un-rotated queries and keys (needs
    # rotates_in_attention): for methods that give a query two position assignments, one for the keys near it and
    # one for those beyond, merged per query (Self-Extend, ReRoPE). The attention path masks, softmaxes and applies
    # the values.
    scores_per_query_block: ClassVar[bool] = False
    # The RoPE base theta: what a RoPE scaling patched over this method scales (on a model without RoPE of its own).
    theta: float | None = None
    # Coordinates per position: 1 for token positions; more (rope-2d: 2, row and column) when the method takes
    # `position_ids` of shape [B, L, position_axes]. Such a method is refused 1-D position_ids; with none given it
    # gets `default_coordinates` of the token positions.
    position_axes: int = 1
    # Each layer has its own rotation (`layer_rotation`; rope-2d per_layer=True): needs rotates_in_attention.
    per_layer_rotation: bool = False

    def scale_key(self, seq_len: int):
        """Equal for two lengths exactly when they give the same frequencies."""
        return seq_len if self.length_dependent else 0

    def frequencies(self, seq_len: int) -> tuple[torch.Tensor, float]:
        """(inv_freq float32 [rotary_dim / 2] on CPU, attention scaling applied to cos and sin)."""
        raise NotImplementedError

    def cos_sin(self, positions: torch.Tensor, seq_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B or 1, q] -> float32 (cos, sin), each [B or 1, q, rotary_dim]."""
        inv_freq, attention_scaling = self.frequencies(seq_len)
        freqs = positions[..., None].float() * inv_freq.to(positions.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos() * attention_scaling, angles.sin() * attention_scaling

    def default_coordinates(self, positions: torch.Tensor) -> torch.Tensor:
        """For a method with position_axes > 1: token positions [B or 1, q] -> coordinates [B or 1, q, position_axes]
        used when the caller passes no position_ids."""
        raise NotImplementedError

    def rotation(self, positions: torch.Tensor, seq_len: int = 0):
        """What rotates the tokens at `positions` ([B or 1, q], or [B or 1, q, position_axes]), in float32; computed
        once per forward and handed to `rotate_heads`. By default the (cos, sin) pair of `cos_sin`, which is also
        what LLaMA-family layers apply themselves."""
        return self.cos_sin(positions, seq_len)

    def layer_rotation(self, layer_idx: int, positions: torch.Tensor, seq_len: int = 0):
        """For `per_layer_rotation` methods: the rotation of layer `layer_idx` (as `rotation()`, which is what every
        layer gets otherwise)."""
        return self.rotation(positions, seq_len)

    def rotate_heads(self, x: torch.Tensor, rotation) -> torch.Tensor:
        """x [B, heads, q, D] -> x rotated by `rotation` (from `rotation()` for its q positions), in x's dtype."""
        cos, sin = rotation
        return rotate(x, cos[:, None].to(x.dtype), sin[:, None].to(x.dtype))

    def rotate_together(self, query: torch.Tensor, key: torch.Tensor, rotation) -> tuple[torch.Tensor, torch.Tensor]:
        """query [B, H, n, D] and key [B, H_kv, n, D] at the same n positions (a full forward), both rotated by
        `rotation`; a method whose rotation is a matrix product per position does both in one product."""
        return self.rotate_heads(query, rotation), self.rotate_heads(key, rotation)

    def rotate_query_key(self, query: torch.Tensor, key: torch.Tensor, query_positions: torch.Tensor,
                         key_positions: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """query [B, H, q, D], key [B, H_kv, kv, D] -> both rotated (used by the shared attention path)."""
        return (self.rotate_heads(query, self.rotation(query_positions, seq_len)),
                self.rotate_heads(key, self.rotation(key_positions, seq_len)))

    def max_query_spread(self, dtype: torch.dtype) -> float:
        """For `rotates_per_query_block` methods: how far apart the positions of one block's queries may lie when the
        queries and keys are in `dtype`."""
        return float("inf")

    def block_keys(self, key: torch.Tensor, key_positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """For `scores_per_query_block` methods: what `block_scores` needs of the call's keys [B, H, kv, D] (heads
        already matched), computed once per layer call, not once per query block (the keys rotated for each of the
        method's position assignments; each [B, H, kv, ...], cut to a block's columns before `block_scores`)."""
        return (key,)

    def block_scores(self, query: torch.Tensor, keys: tuple[torch.Tensor, ...], query_positions: torch.Tensor,
                     key_positions: torch.Tensor) -> torch.Tensor:
        """For `scores_per_query_block` methods: un-rotated query [B, H, r, D], `block_keys` cut to the block's k
        columns, positions [B or 1, r] and [B or 1, k] -> float32 scores q.k [B, H, r, k] before the softmax scaling
        and any mask."""
        raise NotImplementedError



def unmasked_columns(mask: torch.Tensor) -> int:
    """How many leading key columns every row of a block's bool mask [..., r, k] allows, so that masking may start
    after them: all but the last r in a causal block without padding, where masking the whole block was about 7% of
    stick-breaking's layer step on the CPU. 0 off the CPU (reading the count back would wait for the device) and
    under torch.compile (a count read from a tensor would break the graph)."""
    if mask.device.type != "cpu" or torch.compiler.is_compiling():
        return 0
    blocked = ~mask.flatten(0, -2).all(0)  # [k]: keys some row may not see
    return int(blocked.byte().argmax()) if bool(blocked.any()) else mask.shape[-1]


def fill_disallowed_(tensor: torch.Tensor, allowed: torch.Tensor, value: float, unmasked: int | None = None):
    """`tensor.masked_fill_(~allowed, value)` over the columns after `unmasked` (by default unmasked_columns(allowed))
    alone: the leading ones every row allows keep their values either way. Returns `tensor`."""
    if unmasked is None:
        unmasked = unmasked_columns(allowed)
    tensor[..., unmasked:].masked_fill_(~allowed[..., unmasked:], value)
    return tensor


@dataclass
class ContentBlock:
    """What the shared attention path hands a content method for one query block (rows r of the call's queries,
    columns k of its keys): the keys the block may see, and the per-token state of its queries and keys."""

    layer_idx: int
    scaling: float  # the model's softmax scaling (1/sqrt(head_dim), or the layer's own)
    allowed: torch.Tensor  # bool [B or 1, 1, r, k]: causality, padding and any key mask together
    bias: torch.Tensor | None  # float32 [B or 1, H or 1, r, k] to add to the logits (the native bias kept by
    # base="native", e.g. BLOOM's ALiBi, and a caller's additive float mask), or None
    query_positions: torch.Tensor  # [B or 1, r] long
    key_positions: torch.Tensor  # [B or 1, k] long
    query_state: torch.Tensor | None  # the method's carried per-token state (token_state) of the rows [B, S, r, ...]
    key_state: torch.Tensor | None  # ... and of the keys [B, S, k, ...]
    query_slots: torch.Tensor  # [r] cache slots of the rows
    key_slots: torch.Tensor  # [k] cache slots of the keys (a key at a row's own slot is that row's token)
    span: PositionSpan | None = None  # what the forward's positions span (for a bias method's block_bias)


class ContentMethod(PositionalMethod):
    """Attention that reads content. The config has `base`: "none" removes the model's own mechanism (as nope does)
    and the method alone orders tokens; "native" keeps it (RoPE rotation on LLaMA, learned wpe on GPT-2, ALiBi on
    BLOOM, which the attention path then adds as `ContentBlock.bias`) and the method acts on top."""

    # Needs the attention layer's input x [B, q, hidden] (captured by a forward pre-hook on each attention module):
    # for per-token state (`token_state`) and for `finish_output`.
    reads_layer_input: ClassVar[bool] = False
    # Reads `ContentBlock.span` (CAPE, to size its bias method's table of distances); the attention path reads the
    # forward's positions for it once per forward, and leaves it None for other methods.
    reads_position_span: ClassVar[bool] = False
    # Computes each block's attention weights itself (`content_weights`) instead of logits for a softmax
    # (stick-breaking).
    replaces_softmax: ClassVar[bool] = False
    # The per-token state changes from layer to layer (TAPE's position features): each layer's state of this call's
    # tokens comes from `layer_token_state` (their previous-layer state and its attention-weighted average, which the
    # attention path computes with the same weights as the values), not from `token_state`.
    mixes_state: ClassVar[bool] = False
    # For `mixes_state` methods: `layer_token_state` reads the previous layer's MLP output (what that layer adds to
    # the residual stream after its attention; TAPE's gate_input="mlp_output", the authors' PELayer) instead of this
    # layer's attention input. The family's MLP hooks capture it (engine/content.py MlpOutputCapture).
    reads_mlp_output: ClassVar[bool] = False
    # `content_scores` returns a tensor of its own that autograd did not save (the output of an add or a multiply):
    # the attention path then masks the disallowed keys in place instead of in a copy (a pass over the block fewer;
    # about 5% of CoPE's layer step at 2048 tokens on the CPU). A saved one would fail in the backward.
    scores_maskable_in_place: ClassVar[bool] = False

    @property
    def keeps_native(self) -> bool:
        """True when the model's own positional mechanism stays (config.base == "native")."""
        return self.config.base == "native"

    def softmax_scaling(self, model_scaling: float) -> float:
        """The scaling of q . k the shared attention path uses (ContentBlock.scaling, the kernels' scale) given the
        layer's own; by default the layer's (DroPE's softmax_scale replaces it)."""
        return model_scaling

    def native_bias(self, layer_idx: int, query_positions: torch.Tensor, key_positions: torch.Tensor):
        """float32 [B or 1, H, r, k]: the model's own mechanism where it is a bias that the shared attention path
        must add itself (BLOOM's ALiBi, kept by base="native"), else None."""
        return None

    def token_state(self, layer_idx: int, layer_input: torch.Tensor, real: torch.Tensor | None = None
                    ) -> torch.Tensor | None:
        """Per-token state of this call's tokens from the layer input [B, q, hidden] -> float32 [B, S, q, ...],
        or None (S: the method's rows, its heads say). It is kept on the KV cache beside the keys
        (engine/content.py), so cached decoding sees exactly the values a full forward computed. `real`: bool
        [B, q], the tokens that are not padding (from the base model's 2-D attention_mask; None: all are)."""
        return None

    def layer_token_state(self, layer_idx: int, layer_input: torch.Tensor, positions: torch.Tensor,
                          previous: torch.Tensor | None, mixed: torch.Tensor | None) -> torch.Tensor:
        """For `mixes_state` methods: the state of this call's tokens at `layer_idx` [B, H_s, q, ...] from the layer
        input [B, q, hidden] (past the first layer, the previous one's MLP output where `reads_mlp_output`), their
        positions [B or 1, q], their state at the previous content layer [B, H_s, q, ...] and, per query head, the
        attention-weighted average of the keys' previous-layer state [B, H, q, ...] (both None at the first layer).
        Kept on the KV cache per layer as `token_state` is."""
        raise NotImplementedError

    def extend_token_state(self, past: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """The state of every token so far [B, H, offset + q, ...] from the cached one (None: no cache) and this
        call's `token_state` (a cumulative state, such as FoX's cumulative log forget gate, overrides this)."""
        return new if past is None else torch.cat((past, new), dim=2)

    def prepare_heads(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      layer_input: torch.Tensor | None, key_state: torch.Tensor | None = None,
                      first_key_slot: int = 0):
        """query [B, H, q, D], key/value [B, H_kv, kv, D] (the whole cache, from cache slot `first_key_slot` on, with
        their carried state `key_state` [B, S, kv, ...]) -> the three the blocks use (QK-norm, a token shift, say);
        by default unchanged."""
        return query, key, value

    def content_scores(self, query: torch.Tensor, key: torch.Tensor, block: ContentBlock) -> torch.Tensor:
        """query [B, H, r, D], key [B, H, k, D] (heads matched) -> float32 logits [B, H, r, k] for the softmax,
        including `block.scaling` and `block.bias`; masked entries are overwritten by the attention path."""
        raise NotImplementedError

    def content_weights(self, query: torch.Tensor, key: torch.Tensor, block: ContentBlock) -> torch.Tensor:
        """For `replaces_softmax` methods: query [B, H, r, D], key [B, H, k, D] -> float32 attention weights
        [B, H, r, k] (zero where `block.allowed` is False), which the attention path applies to the values."""
        raise NotImplementedError

    def finish_output(self, layer_idx: int, output: torch.Tensor, layer_input: torch.Tensor | None) -> torch.Tensor:
        """The attention output [B, H, q, D] before the output projection -> what the projection gets (an output
        gate, say); by default unchanged."""
        return output


# --- Optional forms: a method derives from one beside its kind where its scores have that form, and the attention
# path then runs SDPA (or a kernel) on the parts instead of materialising each block's scores.

class NearFarForm(RotaryMethod):
    """A `scores_per_query_block` method whose block_scores are where(near, q_n . k_n, q_f . k_f) (Self-Extend,
    ReRoPE, sinks)."""

    def block_near(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor | None:
        """Positions [B or 1, r] and [B or 1, k] -> the near mask bool [B or 1, 1, r, k]; the attention path then runs
        SDPA on the method's `block_parts` (kernel calls per part and block) instead of block_scores and an eager
        softmax, and rebuilds this mask in the backward rather than keep it. None: block_scores serves."""
        raise NotImplementedError

    def block_parts(self, query: torch.Tensor, keys: tuple[torch.Tensor, ...], query_positions: torch.Tensor,
                    key_positions: torch.Tensor, far: bool):
        """The block_scores arguments -> ((q_n [B, H, r, D], k_n [B, H, k, D]), (q_f, k_f) if `far` (some allowed
        entry of the block is far) else None). Each query's rotations depend on its own position alone: on the CPU the
        attention path calls this once for every query of the call."""
        raise NotImplementedError

    def window_holds(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> bool:
        """For a call whose query i is key i (positions [B or 1, L] each): whether every causal pair takes one plain
        rotation (`window_heads`), so that one causal SDPA call serves the call. False (the default): per query
        block."""
        return False

    def window_heads(self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor):
        """For a call `window_holds` accepts: (query [B, H, L, D], key [B, H, L, D]) rotated for it."""
        raise NotImplementedError


class SeparableBiasForm(ContentMethod):
    """A content method whose logits (content_scores) are block.scaling * q_i . k_j + u_i - w_j + block.bias, with u
    and w from the carried state (FoX)."""

    def separable_terms(self, query_state: torch.Tensor | None, key_state: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(u [B, H, q], w [B, H, kv]), float32, for the queries' state [B, S, q, ...] and the keys' [B, S, kv, ...];
        the attention path then runs SDPA's kernel per block (engine/attention/separable.py) instead of
        content_scores. None: content_scores serves."""
        raise NotImplementedError


class DotProductForm(ContentMethod):
    """A content method whose logits (content_scores) are block.scaling * q'_i . k'_j + block.bias, for transformed
    queries and keys (Transformer-XL, TAPE)."""

    def kernel_heads(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, query_state: torch.Tensor | None,
                     key_state: torch.Tensor | None, query_positions: torch.Tensor, key_positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q' [B, H, q, E], k' [B, H_kv, kv, E]), float32, from query [B, H, q, D] and key [B, H_kv, kv, D] (at its
        key-value heads, each shared by a group of query heads), the carried state of the queries [B, S, q, ...] and keys [B, S, kv, ...]
        and their positions [B or 1, q] and [B or 1, kv]; the attention path then runs SDPA on them
        (engine/attention/content_path.py `_kernel_content`), for `mixes_state` methods with the keys' state beside the values;
        a fused CPU form of it, where there is one, is the method's entry in engine/kernels/by_method.py. None:
        content_scores serves."""
        raise NotImplementedError

    # The form of `kernel_heads` holds only for attended pairs whose key position is not after the query's (a method
    # that clamps negative distances to 0, as `relative_distance` does): the attention path checks, and keeps
    # content_scores for a call with such a pair.
    kernel_needs_ordered_keys: ClassVar[bool] = False


FORMS = (NearFarForm, SeparableBiasForm, DotProductForm)
KINDS = (AbsolutePositionMethod, AttentionBiasMethod, RotaryMethod, ContentMethod)


def capabilities(kind: type[PositionalMethod]) -> set[str]:
    """The names the engine reads from a method of this kind (its protocol class and PositionalMethod)."""
    return {name for cls in {kind, PositionalMethod} for name in vars(cls)
            if not name.startswith("_") and not hasattr(nn.Module, name)}


def kind_of(cls: type) -> type[PositionalMethod]:
    """The protocol class a method class derives from (PositionalMethod for a method that acts nowhere)."""
    kinds = [kind for kind in KINDS if issubclass(cls, kind)]
    if len(kinds) > 1:
        raise PosEncError(f"{cls.__name__} derives from {' and '.join(k.__name__ for k in kinds)}; a method acts in "
                          "one place: derive from one of them.")
    return kinds[0] if kinds else PositionalMethod


def check_method_names(cls: type) -> None:
    """Refuse public names in the class bodies of `cls` (up to its protocol class) that the engine would not read
    although they look like a capability: a capability of another kind or form, or a near miss of a capability's
    name."""
    kind = kind_of(cls)
    protocol = (PositionalMethod, *KINDS, *FORMS)
    own = set().union(*(capabilities(k) for k in protocol if issubclass(cls, k)))
    every = set().union(*(capabilities(k) for k in protocol))
    for klass in cls.__mro__[:cls.__mro__.index(kind)]:
        if klass in FORMS:
            continue
        for name in vars(klass):
            if name.startswith("_") or name in own or hasattr(nn.Module, name):
                continue
            if name in every:
                owner = next(k.__name__ for k in (*KINDS, *FORMS) if name in vars(k))
                raise PosEncError(f"{klass.__name__}.{name} is a capability of {owner} methods, and {cls.__name__} "
                                  f"derives from {kind.__name__}: it would never be read. Derive from {owner} or "
                                  "rename it.")
            near = difflib.get_close_matches(name, sorted(every), n=1, cutoff=0.8)
            if near:
                raise PosEncError(f"{klass.__name__}.{name} is not a capability hf_posenc reads; did you mean "
                                  f"{near[0]!r}? Rename it (or, for a helper of the method's own, give it a name "
                                  f"that is not a near miss of {near[0]!r}). The capabilities of {kind.__name__} "
                                  f"methods: {', '.join(sorted(own))}.")


def relative_distance(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """i - j as float32 [B or 1, 1, q, kv], at least 0: a key whose position is not before the query's (only with
    position ids that restart or go back) is treated as at the query's position, as the distance tables do."""
    return (query_positions[:, None, :, None] - key_positions[:, None, None, :]).clamp_min(0).float()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the half-split layout that LLaMA checkpoints use; cos/sin broadcast over x and
    cover its first cos.shape[-1] dimensions (the rest pass through: partial rotary)."""
    dim = cos.shape[-1]
    rotary, rest = (x, None) if dim == x.shape[-1] else (x[..., :dim], x[..., dim:])
    half = dim // 2
    rotated_half = torch.cat((-rotary[..., half:], rotary[..., :half]), dim=-1)
    out = rotary * cos + rotated_half * sin
    return out if rest is None else torch.cat((out, rest), dim=-1)


def rotate_per_head(x: torch.Tensor, rotation, heads: int) -> torch.Tensor:
    """`rotate` with a (cos, sin) pair per key-value head, each [B or 1, q, heads, rotary_dim]: x [B, H, q, D] holds
    the key-value heads (keys) or groups of query heads sharing one (queries)."""
    group = x.shape[1] // heads
    cos, sin = (part.transpose(1, 2).repeat_interleave(group, dim=1).to(x.dtype) for part in rotation)
    return rotate(x, cos, sin)
