"""Positional methods: importing this package registers the built-in ones."""

from .alibi import Alibi, AlibiConfig
from .comrope import ComRopeAp, ComRopeApConfig, ComRopeConfig, ComRopeLd, ComRopeLdConfig
from .cape import CapeConfig, ContextAdaptivePositions
from .cope import ContextualPositions, CopeConfig
from .drope import DropeConfig, DroppedPositions
from .fope import Fope, FopeConfig
from .fox import FoxConfig, ForgettingAttention
from .learned import LearnedConfig, LearnedPositions
from .liere import Liere, LiereConfig
from .nope import NoPositions, NopeConfig
from .rerope import Rerope, ReropeConfig
from .rope import Rope, RopeConfig
from .rope_2d import Rope2d, Rope2dConfig
from .rope_scaling import (DynamicConfig, DynamicYarnConfig, Llama3Config, LinearConfig, LongRopeConfig, NtkConfig,
                           RopeScalingConfig, ScaledRope, YarnConfig)
from .self_extend import SelfExtend, SelfExtendConfig
from .sinks import AttentionSinks, SinksConfig
from .sinusoidal import Sinusoidal, SinusoidalConfig
from .stick_breaking import StickBreakingAttention, StickBreakingConfig
from .tape import Tape, TapeConfig
from .transformer_xl import TransformerXlAttention, TransformerXlConfig
from .relative_biases import *  # noqa: F401,F403  (fire, t5, kerple, sandwich, xpos)

__all__ = [
    "Alibi", "AlibiConfig", "ComRopeAp", "ComRopeApConfig", "ComRopeConfig", "ComRopeLd", "ComRopeLdConfig",
    "Fope", "FopeConfig", "FoxConfig", "ForgettingAttention", "StickBreakingAttention", "StickBreakingConfig",
    "CapeConfig", "ContextAdaptivePositions", "ContextualPositions", "CopeConfig", "DropeConfig", "DroppedPositions", "TransformerXlAttention", "TransformerXlConfig", "Liere", "LiereConfig", "Rope2d", "Rope2dConfig", "LearnedConfig", "LearnedPositions", "NoPositions", "NopeConfig",
    "Rope", "RopeConfig", "Sinusoidal", "SinusoidalConfig",
    "DynamicConfig", "DynamicYarnConfig", "Llama3Config", "LinearConfig", "LongRopeConfig", "NtkConfig",
    "RopeScalingConfig", "ScaledRope", "YarnConfig", "Rerope", "ReropeConfig", "SelfExtend", "SelfExtendConfig",
    "AttentionSinks", "SinksConfig", "Tape", "TapeConfig",
]
