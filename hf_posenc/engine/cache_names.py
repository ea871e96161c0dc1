"""The KV cache's name in transformers' forward arguments and outputs: `cache` since transformers 5.24,
`past_key_values` before (still accepted, with a deprecation warning, until 5.40). Everything in hf_posenc that
reads or passes a cache by name goes through these, so that both versions work."""

from __future__ import annotations

import inspect
from typing import Any

CACHE_NAMES = ("cache", "past_key_values")  # newest first


def cache_argument(arguments: dict[str, Any]):
    """The KV cache a base model's forward got, under either name."""
    cache = arguments.get("cache")
    return cache if cache is not None else arguments.get("past_key_values")


def cache_keyword(arguments: dict[str, Any]) -> str:
    """The name under which `arguments` hold a cache (`cache` where that is set, else `past_key_values`)."""
    return "cache" if arguments.get("cache") is not None else "past_key_values"


def cache_output(output: Any):
    """The KV cache a base model's forward returned, under either name."""
    fields = getattr(output, "__dataclass_fields__", {})
    # Only the field the output class has: on 5.24 `past_key_values` is a property that warns of its deprecation.
    return getattr(output, "past_key_values" if "past_key_values" in fields else "cache", None)


def forward_cache_keyword(model) -> str:
    """The name `model.forward` takes a cache by on the installed transformers (for callers passing one)."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in CACHE_NAMES if name in parameters), "past_key_values")
