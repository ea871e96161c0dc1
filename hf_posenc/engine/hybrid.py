"""Hybrid patches: a method on some layers only, the others keeping the model's own mechanism (or another method on
other layers), as recent models interleave RoPE and NoPE layers.

    patch_model(model, "nope", layers=[1, 3])        # layers 1 and 3 without position, the others native
    patch_model(model, "nope", layers="every:4")     # layers 3, 7, 11, ...: every 4th layer counting from 1
    patch_model(model, "alibi", layers=[0, 2])       # a second patch on other layers: both parts are kept

A hybrid is one patch whose config (`HybridConfig`) lists its parts: {"method", "options", "layers"}; its module
(`HybridMethod`) holds one method module per part (parameters `<base>.posenc.parts.<i>.*`). Each part gets its own
per-forward position state; it is installed on the part's layers only (engine/install.py `install_hybrid`). The
checkpoint records the parts (and, in posenc_config.json, `layer_methods`: what each layer runs).

What cannot be per layer: absolute methods (`learned`, `sinusoidal`) add their embedding to the input of the first
layer, not inside a layer; length-dependent RoPE scalings with exact caching replay the whole model's cache; methods
over 2-D positions (`rope-2d`) change the model's position_ids; content-dependent methods (`fox`, `cope`, ...) keep
per-token state installed for the whole model; and methods that build on another patch (a RoPE scaling on GPT-2 builds
on a `rope` patch of every layer). Those are refused. On a family whose own positions are an input embedding (GPT-2's
learned `wpe`), that embedding is not a layer's: it stays while some layer is native, and the parts add their method in
their layers; once the parts run every layer, nothing reads it and it goes, as with the full patch (issue 51).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ..config import PosEncConfig
from ..errors import PosEncError
from ..methods.base import AbsolutePositionMethod, ContentMethod, PositionalMethod, RotaryMethod
from ..model_info import ModelInfo
from ..registry import config_for, get_method, register_method

HYBRID = "hybrid"
NATIVE = "native"  # what layer_methods says for a layer that keeps the model's own mechanism
LAYER_PATTERNS = ("a list of layer indices ([1, 3]), one index, 'every:K' (layers K-1, 2K-1, ...), 'first:N', "
                  "'last:N', or 'rest' (every layer no part of the hybrid runs yet)")
REST = "rest"


def rest_layers(parts: list[dict] | None, num_layers: int) -> list[int]:
    """The layers of `layers="rest"`: those no part of the hybrid (`parts`, None: not a hybrid) runs yet."""
    if not parts:
        raise PosEncError(f"layers={REST!r} names the layers that no part of a hybrid runs yet, and this model is not "
                          "a hybrid: patch the first part with layers=[...] or a pattern ('every:2'), then the "
                          f"other method with layers={REST!r}.")
    taken = {index for part in parts for index in part["layers"]}
    rest = [index for index in range(num_layers) if index not in taken]
    if not rest:
        raise PosEncError(f"layers={REST!r} names no layer: every layer of this hybrid already runs a part. Call "
                          "hf_posenc.unpatch_model(model) first to start again.")
    return rest


def parse_layers(spec: Any, num_layers: int) -> list[int]:
    """The sorted layer indices `spec` names on a model with `num_layers` layers; one clear error otherwise."""
    given = spec

    def refuse(problem: str) -> None:
        raise PosEncError(f"layers={given!r} {problem}; pass {LAYER_PATTERNS}, with indices from 0 to "
                          f"{num_layers - 1} (this model has {num_layers} layers).")

    if isinstance(spec, str):
        kind, _, count = spec.partition(":")
        if kind not in ("every", "first", "last") or not count.isdigit() or int(count) < 1:
            refuse("is not a layer pattern")
        k = int(count)
        if kind == "every":
            layers = list(range(k - 1, num_layers, k))
        elif kind == "first":
            layers = list(range(min(k, num_layers)))
        else:
            layers = list(range(max(0, num_layers - k), num_layers))
        if not layers:
            refuse("names no layer")
        return layers
    if isinstance(spec, range):
        spec = list(spec)
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = [spec]
    if not isinstance(spec, (list, tuple)) or not spec:
        refuse("is not a non-empty list of layer indices")
    for index in spec:
        if isinstance(index, bool) or not isinstance(index, int):
            refuse(f"holds {index!r}, which is not an integer")
        if not 0 <= index < num_layers:
            refuse(f"holds {index}, which is not a layer of this model")
    if len(set(spec)) != len(spec):
        refuse("names a layer twice")
    return sorted(spec)


@dataclasses.dataclass
class HybridConfig(PosEncConfig):
    """A patch made of parts, each a method on some layers: `parts` is a list of {"method": name, "options": {...},
    "layers": [indices]} with disjoint layers (layers in no part keep the model's own mechanism). Usually built by
    `patch_model(model, method, layers=...)`; the options are stored complete (defaults filled in)."""

    parts: list = dataclasses.field(default_factory=list)

    def validate(self) -> None:
        if not isinstance(self.parts, (list, tuple)) or not self.parts:
            self.refuse("parts", "is not a non-empty list", 'a list of {"method": name, "options": {...}, '
                        '"layers": [indices]} (or call patch_model(model, method, layers=[...]))')
        normalised, seen = [], {}
        for part in self.parts:
            if not isinstance(part, dict) or set(part) - {"method", "options", "layers"} or "method" not in part \
                    or "layers" not in part:
                self.refuse("parts", f"holds {part!r}, which is not a part", '{"method": name, "options": {...}, '
                            '"layers": [indices]} for each part')
            config = part_config(part["method"], part.get("options") or {})
            layers = part["layers"]
            if not isinstance(layers, (list, tuple)) or not layers or any(
                    isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers) or \
                    len(set(layers)) != len(layers):
                self.refuse("parts", f"gives {part['method']!r} the layers {layers!r}",
                            "a non-empty list of distinct layer indices >= 0 for each part")
            for index in layers:
                if index in seen:
                    raise PosEncError(f"Layer {index} is given both {seen[index]!r} and {part['method']!r}; a layer "
                                      "runs one method: give each part other layers.")
                seen[index] = part["method"]
            normalised.append({"method": config.method, "options": _options(config), "layers": sorted(layers)})
        self.parts = normalised

    def part_configs(self) -> list[tuple[PosEncConfig, list[int]]]:
        return [(get_method(part["method"]).config_class.from_options(**part["options"]), part["layers"])
                for part in self.parts]

    def sub_configs(self) -> list[PosEncConfig]:
        return [config for config, _ in self.part_configs()]

    def layer_methods(self, num_layers: int) -> list[str]:
        """What each layer runs: a part's method name, or "native"."""
        names = [NATIVE] * num_layers
        for part in self.parts:
            for index in part["layers"]:
                if index < num_layers:
                    names[index] = part["method"]
        return names


def part_config(method: Any, options: dict) -> PosEncConfig:
    if method == HYBRID or isinstance(method, HybridConfig):
        raise PosEncError("A hybrid's part is one method, not another hybrid: list its parts in one HybridConfig.")
    if isinstance(method, PosEncConfig):
        if options:
            raise PosEncError(f"Options {sorted(options)} were given together with a {type(method).__name__}; put "
                              "them in the config instead.")
        config_for(method)
        method.validate()
        return method
    return get_method(method).config_class.from_options(**options)


def _options(config: PosEncConfig) -> dict[str, Any]:
    return {key: value for key, value in config.to_dict().items() if key != "method"}


def refuse_per_layer(config: PosEncConfig, module: PositionalMethod | None = None) -> None:
    """Refuse a method that cannot act on some layers only (see the module docstring); `module`: the method as
    built for the model, when the check needs it."""
    cls = config_for(config).module_class
    name = config.method
    fix = f"patch the whole model with {name!r} (no layers=), or choose a method that acts inside attention"
    if issubclass(cls, AbsolutePositionMethod):
        raise PosEncError(f"{name!r} adds a position embedding to the input of the first layer, not inside a layer, "
                          f"so it cannot run on some layers only: {fix}.")
    if issubclass(cls, ContentMethod):
        raise PosEncError(f"{name!r} is a content-dependent method, whose per-token state (engine/content.py) is "
                          f"installed for the whole model, not per layer: {fix}.")
    if module is None:
        return
    if isinstance(module, RotaryMethod) and module.length_dependent and module.exact_cache:
        raise PosEncError(f"{name!r} (with exact_cache) replays the whole model's cache when its scale changes, "
                          "which cannot be done for some layers only: pass exact_cache=False, or use a fixed RoPE "
                          "scaling ('yarn', 'linear', 'ntk') on those layers.")
    if isinstance(module, RotaryMethod) and module.position_axes > 1:
        raise PosEncError(f"{name!r} takes {module.position_axes}-D position_ids, which the model's other layers "
                          f"cannot read: {fix}.")
    if module.builds_on():
        raise PosEncError(f"{name!r} builds on a {module.builds_on()[0].method!r} patch of every layer, which this "
                          "model does not have: use 'rope' (or another method of its own) on those layers.")


@register_method(HYBRID, HybridConfig, listed=False)
class HybridMethod(PositionalMethod):
    """Methods on some layers only, the model's own mechanism on the others.

    Holds the method module of each part (`parts[i]`, on the layers `part_layers[i]`) and acts through them: the
    family installs each on its layers (engine/install.py install_hybrid)."""

    def __init__(self, config: HybridConfig, info: ModelInfo):
        super().__init__(config, info)
        modules, layer_sets = [], []
        for part, layers in config.part_configs():
            too_high = [index for index in layers if index >= info.num_layers]
            if too_high:
                raise PosEncError(f"The hybrid gives {part.method!r} the layers {too_high}, and this model has "
                                  f"{info.num_layers} layers (0 to {info.num_layers - 1}): choose layers it has.")
            refuse_per_layer(part)
            module = config_for(part).module_class(part, info)
            refuse_per_layer(part, module)
            modules.append(module)
            layer_sets.append(list(layers))
        self.parts = nn.ModuleList(modules)
        self.part_layers = layer_sets

    def extra_repr(self) -> str:
        return ", ".join(f"{part['method']} on layers {part['layers']}" for part in self.config.parts)
