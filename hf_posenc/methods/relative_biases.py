"""Learned and parametric relative biases (and xPos): importing this module registers them."""

from .fire import Fire, FireConfig
from .kerple import Kerple, KerpleConfig
from .sandwich import Sandwich, SandwichConfig
from .t5 import T5Bias, T5Config
from .xpos import Xpos, XposConfig

__all__ = ["Fire", "FireConfig", "Kerple", "KerpleConfig", "Sandwich", "SandwichConfig", "T5Bias", "T5Config",
           "Xpos", "XposConfig"]
