"""The patch engine: what happens to a model when it is patched, and at every forward.

- install.py: the transactional core of a patch (build the method, install it by its kind through the family, undo
  log).
- undo.py: the undo log (plain data: survives deepcopy and pickling).
- state.py: the positions of each forward, read once per forward by a pre-hook on the base model.
- content.py: content methods' per-token state, and how the KV cache carries it.
- attention/: the attention of every method that acts inside attention, one file per path (dispatch, bias, near/far,
  content blocks; the path choice and its counts in paths.py).
- kernels/: fast kernels found by method (by_method.py), the fused CPU kernels (fused_cpu.py, cpu_kernels/*.cpp)
  and the check each kernel passes on this machine before it serves (check.py).
- hybrid.py: a method on some layers only (HybridConfig, HybridMethod).
- replay.py: exact KV caching for length-dependent RoPE scalings (replays the text when the scale changes).
- sink_cache.py: the bounded KV cache of StreamingLLM's attention sinks (SinkCache).
- cache_rows.py: per-row state kept on a KV cache follows the cache's batch edits (beam search, ...).
- cache_names.py: the KV cache's name in transformers' forward arguments and outputs.

The engine imports nothing from hf_posenc.checkpoints or the tools, and methods/ imports nothing from the engine
(tests/test_layout.py checks both).
"""
