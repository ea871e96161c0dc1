"""Fast kernels the engine calls for a method, each beside the plain form it is checked against.

- by_method.py: the one table of kernels by method name (`KERNELS`, as Liger-Kernel dispatches by model_type): a
  method's causal-square kernel, its fused form of `kernel_heads`, whether the near/far kernel serves its
  `block_parts`; each entry takes the method object and reads its parameters, and names its plain reference.
- fused_cpu.py: fused CPU kernels (cpu_kernels/*.cpp, built on first use) for attention with no single SDPA call.
- triton/: Triton kernels (the optional `hf_posenc[gpu]` extra, imported only where `attention_path("triton")` is
  chosen or "auto" runs on CUDA): the distance-table attention kernel, found by `triton_table` in KERNELS.
- check.py: no compiled or external kernel serves a kind of call before it matched the plain path on this machine.

Methods import nothing from here (tests/test_layout.py checks it): a method says what it computes, the engine looks
its kernels up.
"""
