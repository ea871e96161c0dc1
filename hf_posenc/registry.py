"""The two registries: positional methods by name, model families by `config.model_type`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from .config import PosEncConfig
from .errors import PosEncError


class Family(Protocol):
    """What the registry reads of a model family; families/base.py ModelFamily is the whole protocol (named here
    without importing it: the families import the engine, which imports the registry)."""

    name: str
    model_types: tuple[str, ...]


@dataclass(frozen=True)
class MethodSpec:
    name: str
    config_class: type[PosEncConfig]
    module_class: type  # a methods/base.py PositionalMethod subclass
    listed: bool = True  # False: loadable by name (checkpoints), but not in available_methods() (the hybrid)


_METHODS: dict[str, MethodSpec] = {}
_FAMILIES: dict[str, Family] = {}


# Set by hf_posenc/__init__.py: imports the built-in methods and families, which register themselves, on first use
# (`import hf_posenc` alone imports neither torch nor transformers). None in a standalone checkpoint's copy of this
# module, whose code imports what it registers.
load_builtins: Callable[[], None] | None = None


def _builtins() -> None:
    if load_builtins is not None:
        load_builtins()


def register_method(name: str, config_class: type[PosEncConfig], module_class: type | None = None, *,
                    listed: bool = True) -> Any:
    """Register a positional method. Use as `register_method(name, Config, Module)` or as a class decorator
    `@register_method(name, Config)` on the module class. Names are lower-case with hyphens. `listed=False` keeps a
    composite (the hybrid of engine/hybrid.py) out of available_methods()."""
    if name != name.lower() or " " in name or "_" in name:
        raise PosEncError(f"Method name {name!r} must be lower-case with hyphens, e.g. 'dynamic-yarn'.")

    if not (isinstance(config_class, type) and issubclass(config_class, PosEncConfig)):
        raise PosEncError(f"register_method({name!r}, ...): the config class must be a dataclass subclassing "
                          f"hf_posenc.PosEncConfig; got {config_class!r}.")

    def add(cls: type) -> type:
        if name in _METHODS and _METHODS[name].module_class is not cls:
            raise PosEncError(f"A method named {name!r} is already registered ({_METHODS[name].module_class}).")
        config_class.method = name
        _METHODS[name] = MethodSpec(name, config_class, cls, listed)
        return cls

    return add if module_class is None else add(module_class)


def available_methods() -> list[str]:
    _builtins()
    return sorted(name for name, spec in _METHODS.items() if spec.listed)


def get_method(name: str) -> MethodSpec:
    _builtins()
    if not isinstance(name, str) or name not in _METHODS:
        raise PosEncError(f"Unknown positional method {name!r}. Available methods: {', '.join(available_methods())}.")
    return _METHODS[name]


def config_for(config: PosEncConfig) -> MethodSpec:
    _builtins()
    for spec in _METHODS.values():
        if type(config) is spec.config_class:
            return spec
    raise PosEncError(f"{type(config).__name__} is not the config of any registered method.")


def register_family(family: Family | type) -> Any:
    """Register a model family (an instance or, as a class decorator, the class) for its `model_types`."""
    instance = family() if isinstance(family, type) else family
    for model_type in instance.model_types:
        _FAMILIES[model_type] = instance
    return family


def supported_model_types() -> dict[str, list[str]]:
    """Family name -> model types it covers."""
    _builtins()
    out: dict[str, list[str]] = {}
    for model_type, family in sorted(_FAMILIES.items()):
        out.setdefault(family.name, []).append(model_type)
    return out


def get_family(model_config: Any) -> Family:
    if getattr(model_config, "is_encoder_decoder", False):
        raise PosEncError(
            f"{type(model_config).__name__} is an encoder-decoder model; hf_posenc patches decoder-only causal "
            "language models (AutoModelForCausalLM)."
        )
    model_type = getattr(model_config, "model_type", None)
    _builtins()
    if model_type not in _FAMILIES:
        families = "; ".join(f"{name}: {', '.join(types)}" for name, types in supported_model_types().items())
        raise PosEncError(
            f"model_type {model_type!r} is not supported. hf_posenc patches decoder-only causal LMs of these "
            f"families: {families}. Register a family with hf_posenc.register_family(...) to add one."
        )
    return _FAMILIES[model_type]


