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
from .methods.alibi import AlibiConfig
from .methods.base import AbsolutePositionMethod, AttentionBiasMethod, PositionalMethod, RotaryMethod
from .methods.fire import FireConfig
from .methods.kerple import KerpleConfig
from .methods.learned import LearnedConfig
from .methods.nope import NopeConfig
from .methods.rope import RopeConfig
from .methods.rope_scaling import (DynamicConfig, DynamicYarnConfig, LinearConfig, Llama3Config, LongRopeConfig,
                                   NtkConfig, RopeScalingConfig, YarnConfig)
from .methods.rerope import ReropeConfig
from .methods.sandwich import SandwichConfig
from .methods.self_extend import SelfExtendConfig
from .methods.sinusoidal import SinusoidalConfig
from .methods.t5 import T5Config
from .methods.xpos import XposConfig
from .model_info import ModelInfo
from .patching import get_positional_module, get_posenc_config, patch_model, unpatch_model
from .registry import available_methods, get_method, register_family, register_method, supported_model_types
from .version import __version__

__all__ = [
    # patching, loading, publishing
    "available_methods", "from_pretrained", "get_method", "get_positional_module", "get_posenc_config",
    "make_model_card", "patch_model", "push_to_hub", "supported_model_types", "unpatch_model", "PosEncError",
    # every built-in method's config
    "AlibiConfig", "DynamicConfig", "DynamicYarnConfig", "FireConfig", "KerpleConfig", "LearnedConfig",
    "LinearConfig", "Llama3Config", "LongRopeConfig", "NopeConfig", "NtkConfig", "RopeConfig", "RopeScalingConfig",
    "ReropeConfig", "SandwichConfig", "SelfExtendConfig", "SinusoidalConfig", "T5Config", "XposConfig", "YarnConfig",
    # extending: methods and families
    "AbsolutePositionMethod", "AttentionBiasMethod", "ModelFamily", "ModelInfo", "PosEncConfig", "PositionalMethod",
    "RotaryMethod", "register_family", "register_method",
]
