"""Estimates the commands print or act on before long work: peak memory (a run that would not fit is refused) and
run time on the bundled SmolLM2-135M.

The time constants were measured on the machine this project was developed on: 2 idle CPU cores, torch 2.13 CPU,
SmolLM2-135M in fp32 with sdpa attention and no KV cache. On another machine they are off by its speed ratio; the
main job scales them by a timed forward at run time (``main_job.calibrate``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..registry import get_family
from .runtime import UsageError

# Seconds for one forward of W tokens, fitted as a*W + b*W^2 to measurements at W = 256..8192 (0.70, 2.56, 6.18, 15.5
# and 42.9 s at 256, 1024, 2048, 4096, 8192 tokens).
SECONDS_PER_TOKEN = 2.1e-3
SECONDS_PER_TOKEN_SQUARED = 3.8e-7
SECONDS_PER_GENERATED_TOKEN = 0.07  # greedy decoding with a KV cache
SECONDS_PER_ADAMW_STEP = 1.1  # the update of all 135M parameters
PATCHED_SLOWDOWN = 1.05  # patched methods with their own attention path measured 1.0-1.2x the unpatched time
SMOLLM2_PARAMETERS = 134.5e6
LONG_RUN_SECONDS = 30 * 60  # a run estimated longer than this is announced with a warning before it starts
DEQUANTISE_SECONDS = 25.0  # the first run's GGUF conversion of SmolLM2 (models._convert; 18-25 s measured)
# A cached model loads in under a second: the loads are not what the estimate misses. The main job's timed run on a
# fresh clone (issue 57) took 697 s where the estimate said 576 s (x1.21): its forwards and steps run slower inside
# the job than alone, so the estimate is printed as a range up to 1.25x.
ESTIMATE_HIGH_FACTOR = 1.25


def estimate_range(seconds: float) -> str:
    """``seconds`` as the range a run takes: "about 6.0-7.5 min", "about 24-30 min"."""
    low, high = seconds / 60, seconds * ESTIMATE_HIGH_FACTOR / 60
    digits = 1 if high < 10 else 0
    return f"about {low:.{digits}f}-{high:.{digits}f} min"


def forward_seconds(window: int) -> float:
    """Expected time of one forward of ``window`` tokens of SmolLM2-135M on the measuring machine (see above)."""
    return SECONDS_PER_TOKEN * window + SECONDS_PER_TOKEN_SQUARED * window**2


def model_forward_seconds(model, window: int) -> float:
    """``forward_seconds`` scaled to the model's size (the cost of a forward grows about with the parameter count)."""
    return forward_seconds(window) * sum(p.numel() for p in model.parameters()) / SMOLLM2_PARAMETERS


def announce_run_time(seconds: float, what: str, shorter: str) -> None:
    """Print the estimate before long work; past LONG_RUN_SECONDS as a warning that says how to shorten it."""
    import sys

    took = f"about {seconds / 3600:.1f} h" if seconds >= 3600 else f"about {seconds / 60:.0f} min"
    if seconds > LONG_RUN_SECONDS:
        print(f"warning: {what} will take {took} by estimate (2 idle CPU cores; a loaded machine is slower); "
              f"{shorter}", file=sys.stderr, flush=True)
    else:
        print(f"{what}: {took} by estimate", file=sys.stderr, flush=True)


def available_memory_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        with contextlib.suppress(OSError, ValueError):
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return 1 << 62


def estimate_forward_bytes(model, length: int, batch: int = 1) -> int:
    """Rough, deliberately high peak memory of a no-grad forward at ``length`` tokens: weights, the fp32 logits,
    a layer's activations and an fp32 attention block of [heads, 2048, length]. For SmolLM2-135M it says 4.2 GB
    at 8k and 7.8 GB at 16k tokens, where 2.5 and 7.5 GB were measured (DESIGN.md)."""
    info = get_family(model.config).model_info(model)
    hidden, heads, vocab = info.hidden_size, info.num_heads, info.vocab_size
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = 4 * (vocab * 1.1 + hidden * 24)
    attention = 4 * heads * min(length, 2048) * length
    return int(1.25 * (params + batch * (length * per_token + attention)))


# The engines a fine-tune runs under, for the per-process estimate: one process ("none"), DDP, DeepSpeed ZeRO-2 and
# ZeRO-3, torch's FSDP2 (fully_shard per decoder layer and at the root: tools/sharding.py).
ENGINES = ("none", "ddp", "zero2", "zero3", "fsdp2")
# DeepSpeed's default reduce_bucket_size (elements): ZeRO-2/3 reduce gradients through a bucket of up to this size
# (for SmolLM2-135M that is the whole gradient at once).
DEEPSPEED_BUCKET_ELEMENTS = 5e8


def parameter_count(parameter) -> int:
    """Elements of `parameter`, also where ZeRO-3 has partitioned it (the parameter itself is then empty)."""
    return int(getattr(parameter, "ds_numel", parameter.numel()))


def estimate_training_bytes(model, length: int, batch: int, trainable: int, checkpointing: bool,
                            teacher=None, engine: str = "none", processes: int = 1) -> int:
    """Rough peak memory of one training micro-step, per process: weights, gradients and AdamW state of the
    trainable parameters, activations kept for backward (all layers, or one with gradient checkpointing), fp32 logits.
    With a distillation `teacher` (distill.Teacher): its own weights where it holds a copy, and its fp32 logits
    and their softmax, which live beside the student's through the loss.

    `engine` (ENGINES) on `processes` data-parallel processes changes what each process holds of the model's state,
    not its activations (each runs its own micro-batch at full length); fp32 gradients and AdamW, no offload:
    - ddp: everything, plus DDP's gradient buckets (a second copy; accelerate leaves gradient_as_bucket_view off);
    - zero2: whole weights, 1/N of the gradients and AdamW state, and DeepSpeed's reduce bucket;
    - zero3: 1/N of everything, the bucket, and the gathered working set: the parameters outside the decoder
      layers (embeddings, head, the patch's positional module) and two layers (the running one and the prefetched);
    - fsdp2: 1/N of everything, and gathered with their unsharded gradients: the root's unit (the parameters
      outside the layers, gathered from forward to backward) and two layers."""
    info = get_family(model.config).model_info(model)
    hidden, layers, heads, vocab = info.hidden_size, info.num_layers, info.num_heads, info.vocab_size
    params = weight_bytes(model)
    kept_layers = 1 if checkpointing else layers
    per_token = 4 * (vocab * 3 + hidden * 34 * kept_layers + (hidden * 2 * layers if checkpointing else 0))
    attention = 4 * heads * length * length * kept_layers
    if teacher is not None:
        if teacher.model is not None:
            params += sum(p.numel() * p.element_size() for p in teacher.model.parameters())
        per_token += 4 * vocab * 2
    state = engine_state_bytes(model, trainable, engine, processes) + params - weight_bytes(model)
    return int(1.25 * (state + batch * (length * per_token + attention)))


def weight_bytes(model) -> int:
    return sum(parameter_count(p) * p.element_size() for p in model.parameters())


def engine_state_bytes(model, trainable: int, engine: str, processes: int) -> float:
    """Weights, gradients and AdamW state of `trainable` parameters that one process holds under `engine` on
    `processes` processes (see estimate_training_bytes)."""
    if engine not in ENGINES:
        from ..errors import PosEncError

        raise PosEncError(f"estimate_training_bytes: engine {engine!r}: choose one of {', '.join(ENGINES)}")
    params, processes = weight_bytes(model), max(1, processes)
    gradients, adamw = 4 * trainable, 8 * trainable
    if engine == "none":
        return params + gradients + adamw
    if engine == "ddp":
        return params + 2 * gradients + adamw
    bucket = 4 * min(trainable, DEEPSPEED_BUCKET_ELEMENTS)
    if engine == "zero2":
        return params + bucket + (gradients + adamw) / processes
    from .sharding import fsdp_wrap_units

    layer_bytes = [sum(parameter_count(p) * p.element_size() for p in unit.parameters())
                   for unit in fsdp_wrap_units(model)[:-1]]
    gathered = params - sum(layer_bytes) + 2 * max(layer_bytes)
    if engine == "zero3":
        return params / processes + gathered + bucket + (gradients + adamw) / processes
    return params / processes + 2 * gathered + (gradients + adamw) / processes  # fsdp2: with unsharded gradients


def longest_training_length(model, memory_bytes: float, engine: str, processes: int, batch: int = 1,
                            checkpointing: bool = True, trainable: int | None = None, step: int = 256) -> int:
    """The longest context (a multiple of `step` tokens) that the fine-tune's memory check lets one device of
    `memory_bytes` train under `engine` on `processes` devices (estimate_training_bytes within 90 % of it, as
    check_memory asks); `trainable` defaults to every parameter (--train-only all). 0 where not even `step` fits."""
    trainable = sum(parameter_count(p) for p in model.parameters()) if trainable is None else trainable

    def fits(length: int) -> bool:
        return estimate_training_bytes(model, length, batch, trainable, checkpointing, engine=engine,
                                       processes=processes) <= 0.9 * memory_bytes

    low, high = 0, step
    while fits(high):
        low, high = high, 2 * high
    while high - low > step:  # low fits and high does not
        middle = (low + high) // 2 // step * step
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def check_memory(needed: int, what: str, available: int | None = None) -> None:
    available = available_memory_bytes() if available is None else available
    if needed > 0.9 * available:
        raise UsageError(f"{what} needs about {needed / 2**30:.1f} GiB of memory by estimate, and "
                         f"{available / 2**30:.1f} GiB is available; use a shorter length or a smaller batch "
                         "(or --no-memory-check to try anyway)")
