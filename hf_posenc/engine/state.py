"""Per-model run-time state: the positions of the tokens in the current forward, read once by a pre-hook on the
base model and used by every layer.

Every token keeps its own position id: a key's position is the one it had when it entered the KV cache (kept on
the cache object beside the keys, `KEY_POSITIONS_ATTR`), never one inferred from its slot. So gapped ids
(PoSE-style skips), restarts and right padding give what a model reading each id would compute. Where every key a
query can see sits at its cache slot plus one shift per row (consecutive ids, left padding), `CallPositions.shift`
says so and the attention path uses its fast slot-distance forms; elsewhere it computes from the positions.

The positions of a call live in thread-local storage on the model's modules (never in transformers' globals), so
two models patched differently, or one model called from two threads, do not interfere.
"""

from __future__ import annotations

import inspect
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..errors import PosEncError
from ..methods.base import AbsolutePositionMethod, PositionalMethod, RotaryMethod
from .cache_names import cache_argument, cache_output
from .cache_rows import carries_rows, follow_batch_edits
from .shared_graph import shared_tensor
from .sink_cache import SinkCache

STATE_ATTR = "hf_posenc_state"
ATTENTION_BACKENDS = ("sdpa", "eager", None)  # None: not chosen yet, transformers' default (sdpa)
KEY_POSITIONS_ATTR = "hf_posenc_key_positions"  # on a KV cache: [B or 1, n] positions of the n cached tokens
# on a KV cache, for a method over several position axes that rotates in attention: [B or 1, n, axes]
KEY_COORDINATES_ATTR = "hf_posenc_key_coordinates"
# On a KV cache after a compiled forward, instead: [B or 1, 1], each cached token's position is its slot plus this.
KEY_SHIFT_ATTR = "hf_posenc_key_shift"
for _attribute in (KEY_POSITIONS_ATTR, KEY_COORDINATES_ATTR, KEY_SHIFT_ATTR):  # beam search reorders them too
    carries_rows(_attribute, lambda value, edit: edit.rows_or_shared(value))


@dataclass
class CallPositions:
    """The positions of one forward.

    `slot_offset` is the number of tokens already in the KV cache (so a StaticCache, whose key length is its
    capacity, still gives the right query offset). `key_positions` holds the positions of every token in the cache
    once this forward's tokens are added, in slot order. `shift` [B or 1, 1] is set when each row's tokens that
    may be attended (padding left out) sit at slot + shift, i.e. position distances are slot distances; None
    otherwise (gaps, restarts, or padding on the right with real positions)."""

    query_positions: torch.Tensor  # [B or 1, q] long
    key_positions: torch.Tensor  # [B or 1, slot_offset + q] long
    slot_offset: int
    shift: torch.Tensor | None
    # What a length-dependent rotary scaling follows: each row's highest position + 1 among its tokens that are not
    # padding, this forward's and the cached ones (`row_lengths`); an int where every row has the same scale, else a
    # tuple with one length per row (0 for other methods).
    seq_len: int | tuple[int, ...] = 0
    rotation: Any = None  # a rotary method's rotation of the queries (its `rotation()`: by default cos/sin)
    # (positions, grad mode, rotation) computed in this forward and shared by every layer (PositionState.rotation_of;
    # not for `per_layer_rotation` methods)
    rotations: list = field(default_factory=list)
    # For a method over several position axes (rope-2d): the coordinates [B or 1, q, axes] of the queries and
    # [B or 1, slot_offset + q, axes] of every key, in slot order (what it rotates by inside attention).
    query_coordinates: torch.Tensor | None = None
    key_coordinates: torch.Tensor | None = None
    # Set under torch.compile (see PositionState.update_traced): `slot_offset` may be a 0-d tensor and
    # `key_positions` holds only the position of slot 0 [B or 1, 1]: each key sits at its slot plus that.
    traced: bool = False
    content: Any = None  # a content method's per-token state of this forward (engine/content.py ContentCall)
    # Values read from this forward's positions that the layers need as Python values, by what they depend on
    # (PositionState.once_per_forward): read once, not once per layer, since reading a tensor's value waits for the
    # device.
    host_values: dict = field(default_factory=dict)
    # ((method, attention mask, dtype, kv, blocks), each block's kernel calls) for a `block_near` method on the
    # CPU kernel, made by the first layer that asks (attention/near_far.py _near_far_plans) and reused by the others
    near_far_plans: list = field(default_factory=list)


class PositionState:
    """The method a model was patched with, its attention backend, and the positions of the current forward
    (per thread)."""

    def __init__(self, method: PositionalMethod, model_config=None, backend: str | None = None,
                 holder: nn.Module | None = None, attribute: str | None = None):
        self.installed = method
        self.model_config = model_config  # the model's own config: its attention implementation is the backend
        self.fixed_backend = backend  # the backend where there is no model config (a bare attention module)
        self.holder, self.attribute = holder, attribute  # where the method is installed: holder.<attribute>
        self.attention_path: str | None = None  # this model's own path choice (attention/paths.py); None: none
        self.path_counts: Counter = Counter()  # the attention calls each path served (attention/paths.py)
        # Choices measured on this machine at their first call, by kind (the table backward's plan:
        # attention/table_attention.py backward_plan); attention/paths.py tuned_choices lists them.
        self.tuned: dict = {}
        self._calls = threading.local()
        self._latest = None  # the CallPositions of the latest forward, from any thread (see `forward`)

    @property
    def method(self) -> PositionalMethod:
        """The method module that computes: the one installed, unless PEFT has put its own in that place (see
        active_method)."""
        if self.holder is None:
            return self.installed
        return active_method(self.holder._modules.get(self.attribute), self.installed)

    @property
    def eager(self) -> bool:
        """True when the model's config asks for eager attention (weights returned), False for sdpa; any other
        implementation cannot carry the method's positions and is refused."""
        backend = self.model_config._attn_implementation if self.model_config is not None else self.fixed_backend
        if backend not in ATTENTION_BACKENDS:
            raise PosEncError(
                f"The model is patched with {self.method.config.method!r}, whose attention hf_posenc computes with "
                f"'eager' or 'sdpa', but its attention implementation is now {backend!r}. Call "
                "model.set_attn_implementation('sdpa') (or 'eager'), or hf_posenc.unpatch_model(model) first to use "
                f"{backend!r} without the patch.")
        return backend == "eager"

    # A thread-local cannot be copied or pickled; a copy starts with no forward in flight and no counts.
    def __getstate__(self) -> dict:
        return {"installed": self.installed, "model_config": self.model_config, "fixed_backend": self.fixed_backend,
                "holder": self.holder, "attribute": self.attribute, "attention_path": self.attention_path}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({"attention_path": None, **state})
        self.path_counts = Counter()
        self.tuned = {}  # measured again on the machine that loads it
        self._calls = threading.local()
        self._latest = None

    @property
    def forward(self) -> CallPositions:
        """The positions of the forward in flight (this thread's)."""
        call = getattr(self._calls, "current", None)
        if call is None:
            # A thread that ran no forward: autograd's device thread (CUDA's backward runs there, not in the caller's
            # thread) recomputing a checkpointed layer. It recomputes the latest forward's layers.
            call = self._latest
        if call is None:
            raise RuntimeError("hf_posenc: attention ran before the base model's pre-hook set the positions.")
        return call

    def update_traced(self, query_positions: torch.Tensor, slot_offset,
                      coordinates: torch.Tensor | None = None) -> CallPositions:
        """`update` inside torch.compile, where no decision may depend on tensor values: `slot_offset` may be a
        0-d tensor (a StaticCache's length) and every token is taken to sit at its slot plus the last query's
        shift (position - slot); the attention path then computes from positions (shift None). That is exact for
        consecutive ids and for left padding (whose padding, masked anyway, gets other positions from generate)."""
        q = query_positions.shape[-1]
        first_key = query_positions[:, -1:] - (slot_offset + q - 1)
        call = CallPositions(query_positions, first_key, slot_offset, None, traced=True)
        if isinstance(self.method, RotaryMethod):
            if self.method.scores_per_query_block:
                raise PosEncError(
                    f"{self.method.config.method!r} chooses per query block between two position assignments, which "
                    "torch.compile cannot trace as one graph here; run the model uncompiled.")
            if self.method.length_dependent:
                raise PosEncError(
                    f"{self.method.config.method!r} rescales with the length of each forward, which torch.compile "
                    "cannot trace; run the model uncompiled, or use a fixed RoPE scaling ('yarn', 'linear', 'ntk').")
            call.rotation = self.method.rotation(query_positions if coordinates is None else coordinates, 0)
        self._calls.current = self._latest = call
        return call

    def update(self, query_positions: torch.Tensor, slot_offset: int, past_positions: torch.Tensor | None = None,
               attended: torch.Tensor | None = None, coordinates: torch.Tensor | None = None,
               past_coordinates: torch.Tensor | None = None) -> CallPositions:
        """Record the positions of a forward: `query_positions` [B or 1, q]; `past_positions` [B or 1, >= offset],
        those of the cached tokens (None: consecutive before the first query, as a cache filled outside hf_posenc's
        view would be); `attended` [B, offset + q] bool, the tokens that are not padding (None: all);
        `coordinates` [B or 1, q, axes], the queries' positions for a method over several axes (rope-2d)."""
        q = query_positions.shape[-1]
        if slot_offset == 0:
            key_positions = query_positions
        else:
            if past_positions is None or past_positions.shape[-1] < slot_offset or \
                    past_positions.shape[0] not in (1, query_positions.shape[0]):
                first = query_positions[:, :1] - slot_offset
                past_positions = first + torch.arange(slot_offset, device=query_positions.device)
            past_positions = past_positions[:, :slot_offset].to(query_positions.device)
            rows = max(past_positions.shape[0], query_positions.shape[0])
            key_positions = torch.cat((past_positions.expand(rows, -1), query_positions.expand(rows, -1)), dim=-1)
        call = CallPositions(query_positions, key_positions, slot_offset, uniform_shift(key_positions, attended))
        if isinstance(self.method, RotaryMethod):
            if self.method.length_dependent:
                call.seq_len = self.scaled_lengths(key_positions, attended)
            rotated = query_positions if coordinates is None else coordinates
            call.rotation = shared_tensor(self.method, lambda: self.method.rotation(rotated, call.seq_len))
            call.rotations.append((rotated, torch.is_grad_enabled(), call.rotation))
            if coordinates is not None:
                call.query_coordinates = coordinates
                call.key_coordinates = self._key_coordinates(coordinates, call.key_positions, slot_offset,
                                                             past_coordinates)
        self._calls.current = self._latest = call
        return call

    def scaled_lengths(self, key_positions: torch.Tensor, attended: torch.Tensor | None) -> int | tuple[int, ...]:
        """`CallPositions.seq_len` for a length-dependent method: each row's scale follows its own length, as the
        row alone would (a left-padded batch is not scaled by its longest row; issue 51)."""
        lengths = row_lengths(key_positions, attended).tolist()
        if len({self.method.scale_key(length) for length in lengths}) == 1:
            return max(lengths)
        return tuple(lengths)

    def _key_coordinates(self, coordinates, key_positions, slot_offset, past_coordinates):
        """The coordinates of every key: the cached ones (else the default coordinates of their positions, for a
        cache filled outside this view), then the queries'."""
        if slot_offset == 0:
            return coordinates
        if past_coordinates is None or past_coordinates.shape[-2] < slot_offset or \
                past_coordinates.shape[0] not in (1, coordinates.shape[0]):
            past_coordinates = self.method.default_coordinates(key_positions[:, :slot_offset])
        past_coordinates = past_coordinates[:, :slot_offset].to(coordinates.device)
        rows = max(past_coordinates.shape[0], coordinates.shape[0])
        return torch.cat((past_coordinates.expand(rows, -1, -1), coordinates.expand(rows, -1, -1)), dim=-2)

    def attention_coordinates(self, kv: int, device: torch.device):
        """(query coordinates, key coordinates) of the keys attention sees ([.., kv, axes], sliced and padded as
        `relative_positions` does the positions), or None for a call without coordinates."""
        call = self.forward
        if call.key_coordinates is None:
            return None
        first_key = self.first_key_slot(call.query_coordinates.shape[-2], kv)
        keys = call.key_coordinates[:, first_key:first_key + kv].to(device)
        missing = kv - keys.shape[-2]
        if missing > 0:
            keys = torch.cat((keys, keys[:, -1:].expand(-1, missing, -1)), dim=-2)
        return call.query_coordinates.to(device), keys

    def rotate_query_key(self, query: torch.Tensor, key: torch.Tensor, query_positions: torch.Tensor,
                         key_positions: torch.Tensor, layer_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The method's rotate_query_key for one layer, with each rotation computed once per forward and reused by
        every layer (`rotation_of`): for ComRoPE/LieRE a matrix exponential per position, for the dynamic scalings
        cos/sin of the whole key cache. A method that overrides rotate_query_key (xPos) is called as it is. A method
        with a rotation per layer (`per_layer_rotation`) gets layer `layer_idx`'s."""
        method, call = self.method, self.forward
        if type(method).rotate_query_key is not RotaryMethod.rotate_query_key or (
                call.traced and not method.per_layer_rotation):
            return method.rotate_query_key(query, key, query_positions, key_positions, call.seq_len)
        coordinates = None if call.traced else self.attention_coordinates(key.shape[2], key.device)
        if coordinates is not None:  # a method over several axes rotates by the tokens' coordinates
            query_positions, key_positions = coordinates
        if call.traced:  # no per-forward reuse under torch.compile
            return (method.rotate_heads(query, method.layer_rotation(layer_idx, query_positions, call.seq_len)),
                    method.rotate_heads(key, method.layer_rotation(layer_idx, key_positions, call.seq_len)))
        query_rotation = self.rotation_of(query_positions, layer_idx)
        key_rotation = query_rotation if same_positions(query_positions, key_positions) else \
            self.rotation_of(key_positions, layer_idx)
        if query_rotation is key_rotation and query.dtype == key.dtype and query.shape[1] % key.shape[1] == 0:
            return method.rotate_together(query, key, query_rotation)
        return method.rotate_heads(query, query_rotation), method.rotate_heads(key, key_rotation)

    def rotation_of(self, positions: torch.Tensor, layer_idx: int = 0):
        """The method's rotation of `positions` [B or 1, n] in the current forward: computed by the first layer that
        asks (the queries' by `update`) and reused by the others, which see the same positions. A method with a
        rotation per layer computes it in each call of the layer: a checkpointed layer's recomputation must compute
        what its first pass did (non-reentrant checkpointing checks it), and with grad where that pass had none
        (reentrant checkpointing)."""
        call, method = self.forward, self.method
        if method.per_layer_rotation:
            return method.layer_rotation(layer_idx, positions, call.seq_len)
        grad = torch.is_grad_enabled()
        for known, known_grad, rotation in call.rotations:
            # (one computed without grad, by a reentrant checkpoint's first pass, would give no gradient later)
            if (known_grad or not grad) and same_positions(known, positions):
                return rotation
        rotation = shared_tensor(method, lambda: method.rotation(positions, call.seq_len))
        call.rotations.append((positions, grad, rotation))
        return rotation

    def slots(self, q: int, kv: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache slots of the q queries and the kv keys seen by attention."""
        offset = self.forward.slot_offset
        if self.forward.traced:  # offset may be a tensor: slot arithmetic without reading its value
            query_slots = offset + torch.arange(q, device=device)
            key_slots = (offset + q - kv).clamp_min(0) + torch.arange(kv, device=device) \
                if isinstance(offset, torch.Tensor) else max(0, offset + q - kv) + torch.arange(kv, device=device)
            return query_slots, key_slots
        query_slots = torch.arange(offset, offset + q, device=device)
        first_key = self.first_key_slot(q, kv)
        key_slots = torch.arange(first_key, first_key + kv, device=device)
        return query_slots, key_slots

    def first_key_slot(self, q: int, kv: int) -> int:
        """The cache slot of the first of the kv keys attention sees, from the sizes alone (no read of a tensor on
        the device): a dynamic cache holds exactly offset + q keys, a static one more (the extra slots are masked), a
        sliding-window cache fewer (only the last kv). So where q == kv the first query is the first key."""
        return max(0, int(self.forward.slot_offset) + q - kv)

    def query_offset(self, q: int, kv: int) -> int:
        """The slot distance from the first of the kv keys to the first of the q queries (`slots`' first entries)."""
        return int(self.forward.slot_offset) - self.first_key_slot(q, kv)

    def once_per_forward(self, key, compute: Callable[[], Any]) -> Any:
        """compute() the first time a layer of this forward asks for `key`, then its value: for values read from the
        forward's positions that every layer reads as Python values (so the device is waited for once per forward,
        not once per layer). `key` must name everything the value depends on besides the forward."""
        values = self.forward.host_values
        if key not in values:
            values[key] = compute()
        return values[key]

    def relative_positions(self, q: int, kv: int, device: torch.device):
        """(query_slots [q], key_slots [kv], query_positions [B or 1, q], key_positions [B or 1, kv]): each token's
        own position. Slots past the cached tokens (a StaticCache's free capacity, always masked) repeat the last
        position."""
        query_slots, key_slots = self.slots(q, kv, device)
        call = self.forward
        if call.traced:
            return query_slots, key_slots, call.query_positions.to(device), call.key_positions.to(device) + key_slots
        first_key = self.first_key_slot(q, kv)
        key_positions = call.key_positions[:, first_key:first_key + kv].to(device)
        missing = kv - key_positions.shape[-1]
        if missing > 0:
            key_positions = torch.cat((key_positions, key_positions[:, -1:].expand(-1, missing)), dim=-1)
        return query_slots, key_slots, call.query_positions.to(device), key_positions


def active_method(slot: nn.Module | None, installed: PositionalMethod) -> PositionalMethod:
    """The method module in the place the patch installed `installed` (`slot`: what that place holds now). PEFT
    trains a module listed in `modules_to_save` (hf_posenc.peft_modules_to_save) as a copy: it puts a wrapper
    there holding the original (`original_module`) and one copy per adapter (`modules_to_save`), and
    merge_and_unload puts the active copy there. The engine computes with the module PEFT trains and saves."""
    if slot is None or slot is installed:
        return installed
    if isinstance(slot, PositionalMethod):  # merge_and_unload left the trained copy in the method's place
        return slot
    if getattr(slot, "original_module", None) is installed:  # PEFT's ModulesToSaveWrapper
        active = getattr(slot, "active_adapters", None) or []
        copies = getattr(slot, "modules_to_save", None)
        if not getattr(slot, "disable_adapters", False) and active and copies is not None and active[0] in copies:
            return copies[active[0]]
    return installed


def same_positions(known: torch.Tensor, positions: torch.Tensor) -> bool:
    return known is positions or (known.shape == positions.shape and known.device == positions.device
                                   and torch.equal(known, positions))


def uniform_shift(key_positions: torch.Tensor, attended: torch.Tensor | None) -> torch.Tensor | None:
    """[rows, 1] with position - slot for each row's attended tokens, if that is one value per row; else None."""
    slots = torch.arange(key_positions.shape[-1], device=key_positions.device)
    shift = key_positions - slots
    if attended is None or attended.shape[-1] != shift.shape[-1]:
        return shift[:, -1:] if bool((shift == shift[:, -1:]).all()) else None
    attended = attended.to(device=shift.device, dtype=torch.bool)
    shift = shift.expand(attended.shape[0], -1)
    low = torch.where(attended, shift, torch.iinfo(shift.dtype).max).amin(-1, keepdim=True)
    high = torch.where(attended, shift, torch.iinfo(shift.dtype).min).amax(-1, keepdim=True)
    empty = ~attended.any(-1, keepdim=True)
    if not bool(((low == high) | empty).all()):
        return None
    return torch.where(empty, 0, low)


class PositionCapture:
    """Forward pre-hook (with kwargs) on the base model: records the positions of this forward and, for
    absolute methods, adds the position embedding to the input embeddings (covering both `input_ids` and
    `inputs_embeds` callers). The token embeddings are read from the model at each call, so a replaced or
    adapter-wrapped embedding (resize_token_embeddings, PEFT) is the one used."""

    def __init__(self, state: PositionState, parameter_names: list[str],
                 default_positions: Callable[[dict[str, Any], int, int, torch.device], torch.Tensor], replay=None,
                 adds_embeddings: bool = True):
        self.state = state
        self.adds_embeddings = adds_embeddings  # False: the model calls the absolute method itself (GPT-2's wpe)
        self.parameter_names = parameter_names  # the base model's forward parameters, in order
        self.default_positions = default_positions
        self.replay = replay  # a PrefixReplay for length-dependent RoPE scalings with exact caching

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        arguments = dict(zip(self.parameter_names, args))
        arguments.update(kwargs)
        input_ids, inputs_embeds = arguments.get("input_ids"), arguments.get("inputs_embeds")
        source = inputs_embeds if inputs_embeds is not None else input_ids
        if source is None:
            return None
        q = source.shape[-2] if inputs_embeds is not None else source.shape[-1]
        cache = cache_argument(arguments)
        traced = torch.compiler.is_compiling()
        offset = cache.get_seq_length() if cache is not None else 0
        if not traced:
            offset = int(offset)
        elif isinstance(offset, torch.Tensor):
            # Under torch.compile a StaticCache's length stays a tensor (reading its value would break the graph);
            # a copy, because the first layer's cache update increments that tensor in place.
            offset = offset.clone()
        positions = arguments.get("position_ids")
        if positions is None:
            positions = self.default_positions(arguments, q, offset, source.device)
        positions, coordinates = self.split_coordinates(arguments, positions, q, offset, source.device)
        embed_tokens = module.get_input_embeddings()
        bounded = isinstance(cache, SinkCache)
        if traced:
            self.state.update_traced(positions, offset, coordinates)
        elif bounded:
            # A cache that evicts: the slots the attention sees are the held tokens, not every token seen.
            cache.check_for(self.state.method)
            held, past, attended = cache.prepare(arguments, positions, q)
            self.state.update(positions, held, past, attended, coordinates)
        else:
            if self.replay is not None:
                arguments, positions, offset = self.replay.prepare(arguments, positions, offset, cache, embed_tokens)
            past = cached_key_positions(cache, offset) if offset else None
            past_coordinates = getattr(cache, KEY_COORDINATES_ATTR, None) if offset and coordinates is not None \
                else None
            self.state.update(positions, offset, past, attended_tokens(arguments.get("attention_mask"), offset + q),
                              coordinates, past_coordinates)

        if not (self.adds_embeddings and isinstance(self.state.method, AbsolutePositionMethod)):
            return ((), arguments) if self.replay is not None or coordinates is not None or bounded else None
        if inputs_embeds is None:
            inputs_embeds = embed_tokens(input_ids)
        inputs_embeds = inputs_embeds + self.state.method.embed(positions).to(inputs_embeds.dtype)
        # Everything as keywords: transformers' forward decorators look arguments up by name.
        arguments.update(input_ids=None, inputs_embeds=inputs_embeds)
        return (), arguments


    def split_coordinates(self, arguments: dict, positions: torch.Tensor, q: int, offset: int, device):
        """(token positions [B or 1, q], coordinates [B or 1, q, axes] or None). For a method over several position
        axes (`position_axes` > 1) the caller's position_ids [B, q, axes] are its coordinates, and the model itself
        gets token positions in their place (what it would use with none given: masks and caches see 1-D ids)."""
        method = self.state.method
        axes = method.position_axes if isinstance(method, RotaryMethod) else 1
        given = arguments.get("position_ids")
        if axes == 1:
            if positions.dim() == 3 and positions.shape[-1] != q:
                raise PosEncError(f"position_ids of shape {list(positions.shape)} hold several coordinates per token, "
                                  f"but {type(method).__name__} takes one: pass position_ids of shape [B, {q}] (or "
                                  "patch with a method over 2-D positions, such as 'rope-2d').")
            return positions.reshape(-1, q).long(), None
        if given is not None and not (given.dim() == 3 and given.shape[-2:] == (q, axes)):
            raise PosEncError(f"{type(method).__name__} takes {axes}-D positions, and position_ids of shape "
                              f"{list(given.shape)} were given: pass position_ids of shape [B, {q}, {axes}] (row, "
                              "column of each token), or none for a 1 x L grid.")
        tokens = self.default_positions(arguments, q, offset, device).reshape(-1, q).long()
        coordinates = method.default_coordinates(tokens) if given is None else given.long()
        if given is not None and "position_ids" in self.parameter_names:
            arguments["position_ids"] = tokens
        elif given is not None:
            del arguments["position_ids"]
        return tokens, coordinates


class RecordKeyPositions:
    """Forward hook on the base model: keeps the positions of the tokens in the returned KV cache on the cache, so
    the next forward with that cache knows where its keys are."""

    def __init__(self, state: PositionState):
        self.state = state

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output):
        cache = cache_output(output)
        if cache is not None and not self.state.forward.traced:
            setattr(cache, KEY_POSITIONS_ATTR, self.state.forward.key_positions)
            setattr(cache, KEY_SHIFT_ATTR, None)
            if self.state.forward.key_coordinates is not None:
                setattr(cache, KEY_COORDINATES_ATTR, self.state.forward.key_coordinates)
            follow_batch_edits(cache)
        elif cache is not None:
            # A compiled forward took every cached token to sit at its slot plus one shift per row (its number of
            # tokens may be a tensor there, so no [B, n] positions): that shift is recorded, for later eager calls.
            setattr(cache, KEY_POSITIONS_ATTR, None)
            setattr(cache, KEY_SHIFT_ATTR, self.state.forward.key_positions)
        return output


def cached_key_positions(cache: Any, offset: int) -> torch.Tensor | None:
    """The positions [B or 1, >= offset] of the tokens in a KV cache, as the last forward with it recorded them
    (RecordKeyPositions); None if no patched forward filled it."""
    positions = getattr(cache, KEY_POSITIONS_ATTR, None)
    shift = getattr(cache, KEY_SHIFT_ATTR, None)
    if positions is None and shift is not None:
        positions = shift + torch.arange(offset, device=shift.device)
    return positions


def row_lengths(positions: torch.Tensor, attended: torch.Tensor | None) -> torch.Tensor:
    """[B or 1] long: each row's highest position + 1 among its tokens that are not padding (`attended` [B, n] bool,
    None: all are), 0 for a row of padding only: the length a row alone would have."""
    if attended is not None and attended.shape[-1] == positions.shape[-1]:
        positions = torch.where(attended.to(positions.device), positions, -1)
    return positions.amax(-1) + 1


def attended_tokens(attention_mask: Any, length: int) -> torch.Tensor | None:
    """The 2-D padding mask [B, length] as booleans (True = a real token), when the forward got one."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and attention_mask.shape[-1] == length:
        return attention_mask.bool()
    return None


def forward_parameter_names(module: nn.Module) -> list[str]:
    return [name for name, parameter in inspect.signature(module.forward).parameters.items()
            if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)]


def positions_after_offset(arguments: dict[str, Any], q: int, offset: int, device: torch.device) -> torch.Tensor:
    """What LLaMA and GPT-2 use when no position_ids are given: consecutive positions after the cache (`offset`
    may be a 0-d tensor under torch.compile)."""
    return (offset + torch.arange(q, device=device))[None]
