"""A bias method's parameters fitted to the original model's attention before any training, for ``hf-posenc finetune
--fit-bias-steps N`` (issue 55: a start near the original). On a few training blocks, each changed layer l gives
once: the teacher's attention probabilities P_l on its own input x_l, and the patched attention's content logits S_l
on the same x_l (its log-probabilities less its bias; a constant per row does not change a softmax). Then the
method's parameters theta alone take N Adam steps on

    KL(theta) = mean over the layers, rows, heads and queries i of  sum_j P_l[i, j] (log P_l[i, j] - log q_l[i, j]),
    q_l = softmax_j(S_l + b_l(theta)),

the patched layer's attention against the original's on the original's input, as attention transfer (LoLCATs, Zhang
et al. 2024) compares them, but on the attention weights and with the projections held: a step is a softmax over the
captured logits, not a forward of the model. A per-layer bias (``t5:per_layer=true``, ``fire``) learns each layer's
recency profile, the part of RoPE's effect that a function of i - j can hold (docs/finetuning-and-evaluation.md,
"Full swap"). Memory: two float32 [rows, heads, queries, length] tensors per changed layer.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import PosEncError
from .attention_transfer import _hooks, attention_modules, capture_targets, changed_layers, fed_teacher_inputs

if TYPE_CHECKING:
    import torch

# The content logit of a masked key: finite (a teacher weight of 0 times it is 0, where -inf would give nan) and far
# below any bias a method makes.
MASKED = -1e30


@dataclass
class CapturedAttention:
    """Per changed layer (in `layers` order): the teacher's probabilities and the patched attention's content logits
    (MASKED where a key is masked), each [rows, heads, queries, length], for the blocks' last queries."""

    layers: list[int]
    teacher: list[torch.Tensor]
    content: list[torch.Tensor]
    query_positions: torch.Tensor  # [1, queries]: the blocks' last queries, those that see the most keys
    key_positions: torch.Tensor  # [1, length]
    entropy: list[float]  # each layer's mean teacher entropy: the KL is the cross-entropy less it


@dataclass
class BiasFit:
    """What `fit_positional_bias` did: the mean KL before and after, per layer after, steps and seconds."""

    kl_before: float
    kl_after: float
    layer_kl: list[float]
    steps: int
    seconds: float


def fitted_method(model):
    """The patch's method if it is a bias with parameters to fit, else a PosEncError that names what can be."""
    from hf_posenc import get_posenc_config, get_positional_module
    from hf_posenc.methods.base import AttentionBiasMethod

    from .teacher import _inner_model

    inner = _inner_model(model)
    config, method = get_posenc_config(inner), get_positional_module(inner)
    fits = "t5:per_layer=true, fire, kerple, sandwich or alibi:trainable=true"
    if config is None or hasattr(config, "layer_methods"):
        raise PosEncError("--fit-bias-steps fits one bias method on every layer; this model has "
                          f"{'no patch' if config is None else 'a hybrid patch'}: give --method {fits}")
    if not isinstance(method, AttentionBiasMethod) or not list(method.parameters()):
        raise PosEncError(f"--fit-bias-steps: {config.method!r} has no bias parameters to fit; use one of {fits}")
    return method


@contextlib.contextmanager
def _eager(model):
    """The model with transformers' eager attention inside the block (the one that returns its weights)."""
    from .teacher import _inner_model

    inner = _inner_model(model)
    before = inner.config._attn_implementation
    inner.set_attn_implementation("eager")
    try:
        yield
    finally:
        inner.set_attn_implementation(before)


@contextlib.contextmanager
def _kept_weights(model, layers: list[int], queries: int):
    """Inside the block, under eager attention, each of `layers`' attention weights of the last `queries` rows
    [rows, heads, queries, length] is kept as the layer runs (no layer's whole weights kept); yields the dict."""
    import torch

    wanted, kept = set(layers), {}

    def ask_for_weights(index, module, args, kwargs):
        # BLOOM's attention (its config always "eager") returns its weights when its caller asks for them.
        if index in wanted and "output_attentions" in inspect.signature(module.forward).parameters:
            return args, {**kwargs, "output_attentions": True}
        return None

    def keep(index, module, args, kwargs, output):
        if index not in wanted:
            return
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if not isinstance(weights, torch.Tensor):
            raise PosEncError(f"{type(module).__name__} gave no attention weights under eager attention: the bias fit "
                              "cannot read this model's attention")
        kept[index] = weights[..., -queries:, :].float().clone()

    with _eager(model), _hooks(attention_modules(model), ask_for_weights, keep):
        yield kept


def capture_attention(student, teacher, blocks: torch.Tensor, queries: int | None = None) -> CapturedAttention:
    """The teacher's attention weights and the patched `student`'s content logits on `blocks` [rows, length] (cut
    to the teacher's window), for every layer the patch changes; `queries`: the last so many rows of each block
    (default all), which bounds the memory of long blocks. One forward of each: the teacher's also gives each layer's
    input, which the student's layers are fed."""
    import torch

    from .teacher import unpatched

    method = fitted_method(student)
    inputs = {**teacher.within_window({"input_ids": blocks}), "use_cache": False}
    layers = changed_layers(student)
    length = inputs["input_ids"].shape[1]
    queries = length if queries is None else min(queries, length)
    with contextlib.ExitStack() as stack:
        original = teacher.model if teacher.model is not None else stack.enter_context(unpatched(student))
        with _kept_weights(original, layers, queries) as kept:
            targets = capture_targets(original, inputs, layers, outputs=False)
    probabilities = [kept[index] for index in layers]
    with torch.no_grad(), _kept_weights(student, layers, queries) as kept, \
            fed_teacher_inputs(attention_modules(student), targets):
        student(**inputs)
    patched = [kept[index] for index in layers]
    key_positions = torch.arange(length, device=blocks.device)[None]
    query_positions = key_positions[:, length - queries:]
    causal = query_positions[0][:, None] >= key_positions[0][None, :]
    tiny = torch.finfo(torch.float32).tiny
    content, entropy = [], []
    with torch.no_grad():
        for index, weights, teacher_weights in zip(layers, patched, probabilities):
            bias = method.bias(index, query_positions, key_positions).float()
            # a weight that underflowed to 0 reads as log(tiny), finite, so that no term of the KL is infinite
            content.append(torch.where(causal, weights.clamp_min(tiny).log() - bias, MASKED))
            entropy.append(float(-(teacher_weights * teacher_weights.clamp_min(tiny).log()).sum(-1).mean()))
    return CapturedAttention(layers, probabilities, content, query_positions, key_positions, entropy)


def bias_fit_kl(method, captured: CapturedAttention) -> torch.Tensor:
    """float32 [len(layers)]: each layer's KL(teacher || patched), summed over keys and averaged over rows, heads and
    queries, with the method's current bias (differentiable in its parameters)."""
    import torch

    kls = []
    for index, teacher, content, entropy in zip(captured.layers, captured.teacher, captured.content,
                                                 captured.entropy):
        bias = method.bias(index, captured.query_positions, captured.key_positions).float()
        cross = -(teacher * (content + bias).log_softmax(-1)).sum(-1).mean()  # masked keys: teacher 0, log q finite
        kls.append(cross - entropy)
    return torch.stack(kls)


def fit_positional_bias(student, teacher, blocks: torch.Tensor, steps: int, lr: float = 0.05,
                        progress=None, queries: int | None = None) -> BiasFit:
    """Fit the patch's bias parameters to the teacher's attention on `blocks` (their last `queries` rows) by `steps`
    Adam steps (the projections and everything else untouched); returns the KL before and after. `progress(step)` is
    called after each step."""
    import torch

    started = time.perf_counter()
    method = fitted_method(student)
    captured = capture_attention(student, teacher, blocks, queries)
    parameters = list(method.parameters())
    wanted = [parameter.requires_grad for parameter in parameters]
    start = [parameter.detach().clone() for parameter in parameters]  # put back if the fit fails
    for parameter in parameters:
        parameter.requires_grad_(True)
    optimizer = torch.optim.Adam(parameters, lr=lr)
    try:
        best, best_state = float("inf"), start
        for step in range(steps + 1):
            loss = bias_fit_kl(method, captured).mean()
            value = float(loss.detach())
            if not math.isfinite(value):
                raise PosEncError(f"--fit-bias-steps: the KL turned {value} at step {step}; lower --fit-bias-lr "
                                  f"(now {lr:g})")
            if step == 0:
                before = value
            if value < best:  # Adam's last steps may overshoot: the fit keeps the best point it passed
                best, best_state = value, [parameter.detach().clone() for parameter in parameters]
            if step == steps:
                break
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if progress is not None:
                progress(step + 1)
        with torch.no_grad():
            for parameter, value in zip(parameters, best_state):
                parameter.copy_(value)
            after = bias_fit_kl(method, captured)
    except BaseException:
        with torch.no_grad():
            for parameter, value in zip(parameters, start):
                parameter.copy_(value)
        raise
    finally:
        for parameter, grad in zip(parameters, wanted):
            parameter.requires_grad_(grad)
            parameter.grad = None
    return BiasFit(before, float(after.mean()), [float(kl) for kl in after], steps, time.perf_counter() - started)
