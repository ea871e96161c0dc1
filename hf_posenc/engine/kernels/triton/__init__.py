"""Triton kernels (an optional extra: `pip install hf_posenc[gpu]`), each beside the plain form it is checked
against. Nothing here imports triton at import time: `table_kernel()` does, where a Triton path is chosen, so without
triton installed everything else works as before.

- table_attention.py: attention with a per-head distance table (fixed and trainable ALiBi, Sandwich, T5, KERPLE,
  FIRE up to its threshold), FlashAttention-2 style, forward and backward with the table's gradient.
- fla_content.py: FoX and stick-breaking by fla-core's maintained kernels (flash-linear-attention).
- cape_attention.py: CAPE (its MLP across heads per pair) on a causal square with a distance table, forward and
  backward with the MLP's and the table's gradients: the port of cpu_kernels/cape.cpp.
- cope_attention.py: CoPE (contextual positions), the fused CPU kernel's tiling in Triton, forward and backward with
  the position embeddings' gradient.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ....errors import PosEncError

INSTALL_HINT = "pip install 'hf_posenc[gpu]' (triton>=3.2)"


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can run on `device`: CUDA, or the CPU through Triton's interpreter (TRITON_INTERPRET=1
    set before triton was imported)."""
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def table_kernel(device: torch.device, forced: bool):
    """The distance-table kernel (table_attention.table_attention), or None where it cannot serve (auto); `forced` (attention_path("triton"))
    turns its absence into a PosEncError naming the fix."""
    if not triton_installed():
        if forced:
            raise PosEncError(f"attention_path('triton') needs triton, which is not installed: {INSTALL_HINT}, or "
                              "choose another path (attention_path('auto')).")
        return None
    if not runs_on(device):
        if forced:
            raise PosEncError(f"attention_path('triton') runs Triton kernels on CUDA, or on the CPU only through "
                              f"Triton's interpreter; this call is on {device}: set TRITON_INTERPRET=1 in the "
                              "environment before triton is imported, or choose another path.")
        return None
    from .table_attention import table_attention
    return table_attention
