"""The patch engine: what happens to a model when it is patched, and at every forward.

- install.py: the transactional core of a patch (build the method, install it through the family, undo log).
- undo.py: the undo log (plain data: survives deepcopy and pickling).
- state.py: the positions of each forward, read once per forward by a pre-hook on the base model.
- attention/: the attention of every method that acts inside attention, one file per path (bias, near/far, content).
- kernel_check.py: compiled and external kernels serve only kinds of call checked on this machine.
- fused_cpu.py: fused CPU kernels (cpu_kernels/*.cpp, built on first use) for content methods with no SDPA form.
- replay.py: exact KV caching for length-dependent RoPE scalings (replays the text when the scale changes).

The engine imports nothing from hf_posenc.checkpoints or the tools (tests/test_layout.py checks it).
"""
