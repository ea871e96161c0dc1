"""hf_posenc: swap and extend the positional mechanism of pretrained causal language models.

    import hf_posenc
    hf_posenc.patch_model(model, "alibi")       # in place; returns the model
    hf_posenc.get_posenc_config(model)          # AlibiConfig(slopes='bloom', trainable=False)
    hf_posenc.unpatch_model(model)              # the original model, exactly
    model.save_pretrained(d); hf_posenc.from_pretrained(d)   # round trip, patch included

The public names below are imported on first use (PEP 562), so that `import hf_posenc` and `hf-posenc --help` do not
load torch and transformers; `from hf_posenc import patch_model` works as always. Using any of them imports the
library as a whole (the built-in methods and families registered, the attention function in transformers).
"""

import importlib

from . import registry as _registry
from .version import __version__

# public name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(("save_adapter", "peft_modules_to_save"), "checkpoints.adapters"),
    **dict.fromkeys(("from_pretrained", "load_adapter"), "checkpoints.loading"),
    "push_to_hub": "checkpoints.hub",
    "make_model_card": "checkpoints.model_card",
    "PosEncConfig": "config",
    "PosEncError": "errors",
    "ModelFamily": "families.base",
    "HybridConfig": "engine.hybrid",
    "AlibiConfig": "methods.alibi",
    **dict.fromkeys(("ComRopeApConfig", "ComRopeConfig", "ComRopeLdConfig"), "methods.comrope"),
    "FopeConfig": "methods.fope",
    "DropeConfig": "methods.drope",
    "FoxConfig": "methods.fox",
    "StickBreakingConfig": "methods.stick_breaking",
    "CopeConfig": "methods.cope",
    "TapeConfig": "methods.tape",
    "CapeConfig": "methods.cape",
    "TransformerXlConfig": "methods.transformer_xl",
    "ContentConfig": "methods.content",
    "LiereConfig": "methods.liere",
    "Rope2dConfig": "methods.rope_2d",
    **dict.fromkeys(("AbsolutePositionMethod", "AttentionBiasMethod", "PositionalMethod", "RotaryMethod"),
                    "methods.base"),
    **dict.fromkeys(("ContentBlock", "ContentMethod"), "methods.base"),
    "FireConfig": "methods.fire",
    "KerpleConfig": "methods.kerple",
    "LearnedConfig": "methods.learned",
    "NopeConfig": "methods.nope",
    "RopeConfig": "methods.rope",
    "ReropeConfig": "methods.rerope",
    "SelfExtendConfig": "methods.self_extend",
    "SinksConfig": "methods.sinks",
    "SinkCache": "engine.sink_cache",
    **dict.fromkeys(("DynamicConfig", "DynamicYarnConfig", "LinearConfig", "Llama3Config", "LongRopeConfig",
                     "NtkConfig", "RopeScalingConfig", "YarnConfig"), "methods.rope_scaling"),
    "SandwichConfig": "methods.sandwich",
    "SinusoidalConfig": "methods.sinusoidal",
    "T5Config": "methods.t5",
    "XposConfig": "methods.xpos",
    "ModelInfo": "model_info",
    **dict.fromkeys(("get_positional_module", "get_posenc_config", "patch_model", "sink_cache", "unpatch_model"),
                    "patching"),
    **dict.fromkeys(("available_methods", "get_method", "register_family", "register_method",
                     "supported_model_types"), "registry"),
}

__all__ = [
    # patching, loading, publishing
    "available_methods", "from_pretrained", "get_method", "get_positional_module", "get_posenc_config",
    "load_adapter", "make_model_card", "patch_model", "peft_modules_to_save", "push_to_hub", "save_adapter",
    "supported_model_types", "unpatch_model", "PosEncError", "sink_cache", "SinkCache",
    # every built-in method's config
    "AlibiConfig", "ComRopeApConfig", "ComRopeConfig", "ComRopeLdConfig", "FopeConfig", "LiereConfig",
    "Rope2dConfig", "DynamicConfig", "DynamicYarnConfig", "FireConfig", "KerpleConfig", "LearnedConfig",
    "LinearConfig", "Llama3Config", "LongRopeConfig", "NopeConfig", "NtkConfig", "RopeConfig", "RopeScalingConfig",
    "ReropeConfig", "SandwichConfig", "SelfExtendConfig", "SinksConfig", "SinusoidalConfig", "T5Config", "XposConfig",
    "YarnConfig",
    "HybridConfig",  # a method on some layers only: patch_model(model, method, layers=[...])
    "ReropeConfig", "SandwichConfig", "SelfExtendConfig", "SinusoidalConfig", "T5Config", "XposConfig", "YarnConfig",
    # content-dependent attention (methods.base ContentMethod)
    "CapeConfig", "ContentConfig", "CopeConfig", "DropeConfig", "FoxConfig", "StickBreakingConfig", "TapeConfig", "TransformerXlConfig",
    # extending: methods and families
    "AbsolutePositionMethod", "AttentionBiasMethod", "ModelFamily", "ModelInfo", "PosEncConfig", "PositionalMethod",
    "RotaryMethod", "register_family", "register_method", "ContentBlock", "ContentMethod",
]


def load_library() -> None:
    """Import the library as a whole: the attention path (hf_posenc.attention), the built-in families and methods
    (registered on import), and every public name."""
    for module in ("attention", "families", "methods", *_EXPORTS.values()):
        importlib.import_module(f".{module}", __name__)


_registry.load_builtins = load_library


def __getattr__(name: str):
    if name in _EXPORTS:
        load_library()
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in ("attention", "engine", "families", "methods", "checkpoints", "tools", "evaluate", "export",
                "checkpoint", "registry", "config", "errors", "patching", "model_info"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
