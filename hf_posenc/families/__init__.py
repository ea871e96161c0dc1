"""Model families: importing this package registers the built-in ones."""

from .base import ModelFamily
from .bloom import BloomFamily
from .gpt2 import GPT2Family
from .llama import LlamaFamily

__all__ = ["BloomFamily", "GPT2Family", "LlamaFamily", "ModelFamily"]
