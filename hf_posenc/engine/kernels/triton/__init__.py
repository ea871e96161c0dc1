"""Triton kernels for GPUs (issue 53), imported only where the "triton" attention path is chosen: triton and fla-core
are an optional extra, and without them everything runs as before.

- fla_content.py: FoX and stick-breaking by fla-core's maintained kernels (flash-linear-attention).
"""
