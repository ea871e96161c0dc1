"""hf_posenc: swap and extend the positional mechanism of pretrained causal language models.

    import hf_posenc
    hf_posenc.patch_model(model, "alibi")       # in place; returns the model
    hf_posenc.get_posenc_config(model)          # AlibiConfig(slopes='bloom', trainable=False)
    hf_posenc.unpatch_model(model)              # the original model, exactly
    model.save_pretrained(d); hf_posenc.from_pretrained(d)   # round trip, patch included
"""

from . import attention  # noqa: F401  (hf_posenc.attention: the attention path's settings and counters)
from . import families, methods  # noqa: F401  (registers the built-in families and methods)
from .checkpoints.hub import push_to_hub
from .checkpoints.loading import from_pretrained
from .checkpoints.model_card import make_model_card
from .config import PosEncConfig
from .errors import PosEncError
from .families.base import ModelFamily
from .methods import AlibiConfig, LearnedConfig, NopeConfig, RopeConfig, SinusoidalConfig
from .methods.relative_biases import FireConfig, KerpleConfig, SandwichConfig, T5Config, XposConfig
from .methods.base import AbsolutePositionMethod, AttentionBiasMethod, PositionalMethod, RotaryMethod
from .model_info import ModelInfo
from .patching import get_positional_module, get_posenc_config, patch_model, unpatch_model
from .registry import available_methods, get_method, register_family, register_method, supported_model_types
from .version import __version__

__all__ = [
    "AbsolutePositionMethod", "AlibiConfig", "AttentionBiasMethod", "LearnedConfig", "ModelFamily", "ModelInfo",
    "NopeConfig", "PosEncConfig", "PosEncError", "PositionalMethod", "RopeConfig", "RotaryMethod",
    "SinusoidalConfig", "available_methods", "from_pretrained", "get_method", "get_positional_module",
    "get_posenc_config", "make_model_card", "patch_model", "push_to_hub", "register_family", "register_method",
    "supported_model_types", "unpatch_model",
]
__all__ += ["FireConfig", "KerpleConfig", "SandwichConfig", "T5Config", "XposConfig"]
