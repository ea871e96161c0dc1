"""`hf_posenc.attention` is the package hf_posenc/engine/attention/ under its former name: the very same module
object, so `attention.set_attention_path(...)`, `attention.attention_path(...)`, `attention.last_paths` and
`attention.kernel_status()` are the engine's own."""

import sys

from .engine import attention

sys.modules[__name__] = attention
