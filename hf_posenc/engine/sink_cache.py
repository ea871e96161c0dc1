"""A bounded KV cache for StreamingLLM's attention sinks (methods/sinks.py): it keeps the first `num_sinks` tokens and
the `window - 1` most recent ones, so a model patched with `sinks` generates text of any length in constant memory.

transformers 5.23 has no SinkCache; this is a `Cache` of `SinkLayer`s (subclasses of transformers' DynamicLayer).
Between forwards each layer holds at most num_sinks + window - 1 keys and values, un-rotated (the `sinks` method
rotates queries and keys inside the shared attention path, by the positions the paper assigns within the cache).
A forward of q new tokens sees the held keys plus its own q (`update` returns them all) and evicts afterwards.

Which tokens are kept is decided once per forward, per row, from the positions and the padding mask (`prepare`,
called by the base model's pre-hook, engine/state.py): the sinks are the tokens at positions 0..num_sinks-1 that are
not padding, the window the tokens whose position is within window - 1 of the row's latest one; every row keeps the
same number of slots (a left-padded row fills the rest with its padding, which stays masked). The positions and the
padding flags of the kept tokens live on the cache; each forward's 2-D attention mask (which covers every token ever
seen, as `generate` passes it) is rewritten so that the columns transformers reads for the held slots hold their
flags (see `get_mask_sizes`).

`get_seq_length()` counts every token seen, as transformers' sliding-window layers do, so default positions and
`generate`'s positions continue the text; `held_length()` is what the layers hold.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from ..errors import PosEncError
from .cache_names import cache_argument, cache_keyword


class EvictionPlan:
    """What the current forward keeps, shared by the layers of one cache: `keep` [B or 1, K] slot indices into the
    (held + new) keys, for a forward whose layers see `length` of them; None keeps everything."""

    def __init__(self) -> None:
        self.keep: torch.Tensor | None = None
        self.length = -1


class SinkLayer(DynamicLayer):
    """One layer's keys and values: held + new on `update`, then only the slots of the forward's plan."""

    is_sliding = False

    def __init__(self, num_sinks: int, window: int, plan: EvictionPlan | None = None, **kwargs):
        super().__init__()
        self.num_sinks, self.window = num_sinks, window
        self.capacity = num_sinks + window - 1
        self.plan = plan if plan is not None else EvictionPlan()
        self.cumulative_length = 0  # tokens seen (DynamicLayer.reset zeroes it)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        n = keys.shape[-2]
        if self.plan.length == n:
            keep = self.plan.keep
        elif n > self.capacity:  # used without the patched model's pre-hook: keep slots, not positions
            keep = torch.cat((torch.arange(self.num_sinks), torch.arange(n - self.window + 1, n)))[None]
        else:
            keep = None
        if keep is None:
            self.keys, self.values = keys, values
        else:
            index = keep.to(keys.device)[:, None, :, None]
            index = index.expand(keys.shape[0], keys.shape[1], -1, keys.shape[-1])
            self.keys, self.values = keys.gather(2, index), values.gather(2, index)
        return keys, values

    def held_length(self) -> int:
        return super().get_seq_length()

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The held keys and the new ones, read from the last held + q columns of the (rewritten) 2-D mask.
        held = self.held_length()
        return held + query_length, self.cumulative_length - held

    def get_max_length(self) -> int:
        return -1  # no limit on the length of the text

    def crop(self, tokens_to_remove: int) -> None:
        if self.cumulative_length > self.held_length():
            raise PosEncError("A SinkCache cannot be cropped once it has evicted tokens (assisted decoding and "
                              "DoLa crop the cache); generate without them, or pass a DynamicCache.")
        super().crop(tokens_to_remove)
        self.cumulative_length = self.held_length()


class SinkCache(Cache):
    """The KV cache of a model patched with `sinks`: `num_sinks` first tokens and a rolling window (see the module
    docstring). Created for you by `model.generate(...)` on such a model, or by `hf_posenc.sink_cache(model)` for
    your own decoding loop; the `sinks` method refuses one whose sinks or window differ from its own."""

    def __init__(self, num_layers: int, num_sinks: int, window: int):
        if window < 1 or num_sinks < 0:
            raise PosEncError(f"SinkCache(num_sinks={num_sinks!r}, window={window!r}): pass num_sinks >= 0 and "
                              "window >= 1.")
        self.num_sinks, self.window = num_sinks, window
        self.plan = EvictionPlan()
        super().__init__(layers=[SinkLayer(num_sinks, window, self.plan) for _ in range(num_layers)])
        self._positions: torch.Tensor | None = None  # [B or 1, held]
        self._attended: torch.Tensor | None = None  # [B, held] bool, None: no padding seen

    @property
    def capacity(self) -> int:
        """Keys held between forwards, at most (more only where positions repeat within a row)."""
        return self.num_sinks + self.window - 1

    def held_length(self) -> int:
        return self.layers[0].held_length() if self.layers else 0

    # The positions of the held tokens, read by the engine (engine/state.py KEY_POSITIONS_ATTR). They are set by
    # `prepare`; the engine's record after each forward (all keys, before eviction) is not needed.
    @property
    def hf_posenc_key_positions(self) -> torch.Tensor | None:
        return self._positions

    @hf_posenc_key_positions.setter
    def hf_posenc_key_positions(self, value) -> None:
        pass

    def prepare(self, arguments: dict, positions: torch.Tensor, q: int):
        """Before a forward of q tokens at `positions` [B or 1, q]: plan what it keeps and rewrite its 2-D attention
        mask (see the module docstring). Returns (held, held positions or None, attended [B, held + q] or None)."""
        held, seen = self.held_length(), self.get_seq_length()
        mask = arguments.get("attention_mask")
        batch = positions.shape[0] if mask is None else mask.shape[0]
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2
                                     and mask.shape[-1] in (seen + q, held + q)):
            raise PosEncError(
                f"With a SinkCache the attention mask must be the 2-D padding mask of every token so far ([B, "
                f"{seen + q}]: {seen} seen and {q} new), as generate passes it; got "
                f"{list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}.")
        new_flags = mask[:, -q:].bool() if mask is not None else None
        held_flags = self._attended
        attended = None
        if new_flags is not None or held_flags is not None:
            if held_flags is None:
                held_flags = torch.ones(batch, held, dtype=torch.bool, device=positions.device)
            if new_flags is None:
                new_flags = torch.ones(batch, q, dtype=torch.bool, device=positions.device)
            attended = torch.cat((held_flags.to(new_flags.device), new_flags), dim=-1)
            rewritten = attended.long()
            if seen > held:  # columns before the held slots are not read (get_mask_sizes' offset)
                rewritten = torch.cat((rewritten.new_zeros(batch, seen - held), rewritten), dim=-1)
            arguments["attention_mask"] = rewritten.to(mask.dtype if mask is not None else torch.long)
        past = self._positions if held else None
        if past is not None:
            rows = max(past.shape[0], positions.shape[0])
            everything = torch.cat((past.to(positions.device).expand(rows, -1), positions.expand(rows, -1)), dim=-1)
        else:
            everything = positions
        keep = self.plan_keep(everything, attended)
        self.plan.keep, self.plan.length = keep, held + q
        if keep is None:
            self._positions, self._attended = everything, attended
        else:
            self._positions = everything.expand(keep.shape[0], -1).gather(1, keep)
            self._attended = attended.gather(1, keep.expand(attended.shape[0], -1)) if attended is not None else None
        return held, past, attended

    def plan_keep(self, positions: torch.Tensor, attended: torch.Tensor | None) -> torch.Tensor | None:
        """positions [B or 1, n] of the held and new tokens -> the slots to keep [B or 1, K] in slot order (None:
        all). A token is needed when a later query may see it: a sink (position < num_sinks) or within window - 1
        of the row's latest position; padding never is. Each row keeps K = max(capacity, most needed in a row)
        slots: the needed ones, then the latest others."""
        n = positions.shape[-1]
        if n <= self.capacity:
            return None
        if attended is not None:
            positions = positions.expand(attended.shape[0], -1)
            latest = positions.masked_fill(~attended, torch.iinfo(positions.dtype).min).amax(-1, keepdim=True)
        else:
            latest = positions.amax(-1, keepdim=True)
        needed = (positions < self.num_sinks) | (positions >= latest - self.window + 2)
        if attended is not None:
            needed = needed & attended
        k = max(self.capacity, int(needed.sum(-1).max()))
        slots = torch.arange(n, device=positions.device)
        priority = needed.long() * (n + 1) + slots
        return priority.topk(k, dim=-1).indices.sort(dim=-1).values

    def check_for(self, method) -> None:
        """Refuse to serve a method that attends to keys this cache drops (one without sinks, or other sizes)."""
        expected = method.kept_keys()
        if expected is None:
            raise PosEncError(
                f"A SinkCache drops every key but the sinks and a window, and this model is patched with "
                f"{method.config.method!r}, which attends to all of them. Use a DynamicCache (or patch with 'sinks').")
        if (self.num_sinks, self.window) != (expected.num_sinks, expected.window):
            raise PosEncError(
                f"This SinkCache keeps {self.num_sinks} sinks and a window of {self.window}, but the model is patched "
                f"with sinks(num_sinks={expected.num_sinks}, window={expected.window}): it would drop keys the "
                "model still attends to. Create the cache with hf_posenc.sink_cache(model).")

    # Batch reordering (beam search, contrastive search) must move the held positions and flags with the keys.
    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        self._positions, self._attended = (_rows(t, beam_idx) for t in (self._positions, self._attended))

    def batch_repeat_interleave(self, repeats: int) -> None:
        for layer in self.layers:
            layer.batch_repeat_interleave(repeats)
        self._positions, self._attended = (t.repeat_interleave(repeats, 0) if t is not None and t.shape[0] > 1
                                           else t for t in (self._positions, self._attended))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for layer in self.layers:
            layer.batch_select_indices(indices)
        self._positions, self._attended = (_rows(t, indices) for t in (self._positions, self._attended))

    def reset(self):
        super().reset()
        self._positions = self._attended = None
        self.plan.keep, self.plan.length = None, -1


def _rows(tensor: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    if tensor is None or tensor.shape[0] == 1:
        return tensor
    return tensor.index_select(0, index.to(tensor.device))


class GenerateWithBoundedCache:
    """The patched model's `_prepare_cache_for_generation` (an instance attribute; the class is untouched): where
    generate would create a DynamicCache of its own, it creates the method's bounded cache instead. A cache the
    caller passes, or another `cache_implementation`, is left alone (the method stays exact with it, unbounded).
    A callable object rather than a closure, so that `copy.deepcopy(model)` gives a copy bound to the copy."""

    def __init__(self, model, method):
        self.model = model
        self.method = method

    def __call__(self, generation_config, model_kwargs, *args, **kwargs):
        given = cache_argument(model_kwargs)
        result = type(self.model)._prepare_cache_for_generation(self.model, generation_config, model_kwargs, *args,
                                                                **kwargs)
        name = cache_keyword(model_kwargs)
        created = model_kwargs.get(name)
        if given is None and type(created) is DynamicCache and not getattr(created, "_is_user_defined", False):
            model_kwargs[name] = bounded_cache(self.method, num_layers(self.model))
        return result


def bounded_cache(method, num_layers: int) -> SinkCache | None:
    """The bounded KV cache of a method that attends only to some keys (`kept_keys`: StreamingLLM's sinks and
    window), for a model of `num_layers` layers; None for a method that may attend to every earlier token."""
    kept = method.kept_keys()
    return None if kept is None else SinkCache(num_layers, kept.num_sinks, kept.window)


def num_layers(model) -> int:
    config = model.config.get_text_config(decoder=True)
    return config.num_hidden_layers
