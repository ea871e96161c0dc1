"""The attention of every method that acts inside attention (additive biases, rotary methods rotated there,
near/far methods, content methods), computed without a [B, H, L, L] tensor. One file per part:

- dispatch.py: `posenc_attention`, the entry transformers calls, routing each call to a path;
- call.py: `AttentionCall`, one call's tensors, mask, slots and positions;
- paths.py: the chosen path and the counts of which path served;
- geometry.py: query blocks, the keys each may see, masks, the Toeplitz view of a distance table;
- bias_path.py (with table_attention.py): biases and rotations, by blocks, flex or flash;
- near_far.py: Self-Extend, ReRoPE and sinks, two position assignments per block;
- content_path.py (with content_blocks.py, compiled_content.py, separable.py): content methods.

How each path is chosen and what it costs: docs/attention-paths.md.
"""

from ..kernels.check import KernelCheckWarning, kernel_status, reset_kernel_status  # noqa: F401
from .bias_path import FLEX_RECOMPILE_LIMIT  # noqa: F401
from .call import AttentionCall  # noqa: F401
from .content_blocks import content_block_output, content_probabilities  # noqa: F401
from .dispatch import ATTENTION_NAME, RoutedAttentionConfig, posenc_attention, register_attention  # noqa: F401
from .geometry import (ACCELERATOR_BLOCK_BYTES, BLOCK_BYTES, block_mask, block_rows, padded_table,  # noqa: F401
                       position_span, query_blocks, toeplitz_view)
from .paths import (ATTENTION_PATHS, attention_path, get_attention_path, last_paths, path_counts,  # noqa: F401
                    set_attention_path, tuned_choices)
