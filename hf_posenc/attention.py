"""`hf_posenc.attention` is hf_posenc/engine/attention.py under its former name: the very same module object, so
`attention.set_attention_path(...)`, `attention.last_paths`, `attention.kernel_status()` and setting its globals act
on the attention path itself."""

import sys

from .engine import attention

sys.modules[__name__] = attention
