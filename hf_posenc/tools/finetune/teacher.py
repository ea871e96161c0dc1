"""Distillation from the original model for ``hf-posenc finetune --distill-from original|PATH``.

The loss mixes the KL divergence to the teacher at a temperature T with the LM loss (Hinton et al. 2015):

    loss = alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * LM loss

the KL summed over the vocabulary and averaged over the tokens it covers. The teacher is the original model:

- ``original`` with frozen base weights (``--train-only positional`` or ``lora``): the same model with the patch
  taken off for the teacher's forward (the engine's undo log) and put back, the same method module (its trained
  weights kept), with LoRA adapters disabled: no second copy in memory. The unpatched forward is the original
  model bit for bit, because the frozen weights are the original ones.
- ``original`` with ``--train-only all``, ``qk`` or ``qkvo``: a frozen copy of the model taken before the patch (the trained weights
  move away from the original, so the same model unpatched would be a moving teacher).
- ``PATH``: a model loaded from there (hf_posenc.from_pretrained: patched or plain), frozen.

The teacher is only right inside its trained window W: for a block longer than W it sees the block's first W tokens
and the KL covers those positions only; the LM loss covers the whole block.
"""

from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING, Any

from ..runtime import DTYPES, uncompiled

if TYPE_CHECKING:
    import argparse

    import torch


def distillation_loss(student_logits: "torch.Tensor", teacher_logits: "torch.Tensor", temperature: float = 1.0,
                      covered: int | None = None) -> "torch.Tensor":
    """T^2 * KL(teacher_T || student_T), summed over the vocabulary, averaged over the batch's tokens; only the first
    `covered` positions count (default: the teacher's whole length)."""
    import torch.nn.functional as F

    covered = teacher_logits.shape[1] if covered is None else covered
    student = F.log_softmax(student_logits[:, :covered].float() / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits[:, :covered].float() / temperature, dim=-1)
    kl = (teacher.exp() * (teacher - student)).sum(-1)
    return kl.mean() * temperature ** 2


def mixed_loss(lm_loss: "torch.Tensor", kl: "torch.Tensor", alpha: float) -> "torch.Tensor":
    return alpha * kl + (1 - alpha) * lm_loss if alpha < 1 else kl


class Teacher:
    """What gives the teacher's logits: ``Teacher.original(model, frozen_base)`` or ``Teacher.loaded(path)``."""

    def __init__(self, mode: str, model=None, window: int | None = None):
        self.mode = mode  # "unpatched view", "frozen copy" or "loaded"
        self.model = model  # the frozen copy or loaded model (None for the view: the student model is used)
        self.window = window

    @classmethod
    def original(cls, model, frozen_base: bool) -> "Teacher":
        """For `model` before this run patches it: the view when the base weights stay frozen, else a frozen copy.
        A model loaded from a patched checkpoint (`--model DIR`) is copied with its patch taken off: the teacher is
        the model without its positional patch, never the patched student itself."""
        from hf_posenc.registry import get_family

        with unpatched(model) as original:
            window = get_family(original.config).trained_window(original)
            if frozen_base:
                return cls("unpatched view", None, window)
            teacher = copy.deepcopy(original).eval()
        teacher.requires_grad_(False)
        return cls("frozen copy", teacher, window)

    @classmethod
    def loaded(cls, path: str, dtype) -> "Teacher":
        from hf_posenc.registry import get_family

        from ..models import load_model

        teacher, _ = load_model(path, dtype=dtype, verbose=False)
        teacher.eval().requires_grad_(False)
        return cls("loaded", teacher, get_family(teacher.config).trained_window(teacher))

    def to(self, device) -> "Teacher":
        if self.model is not None:
            self.model.to(device)
        return self

    @contextlib.contextmanager
    def generating(self, student):
        """The teacher as a model to call (generate, sample) inside the block: its own, or `student` unpatched."""
        if self.model is not None:
            yield self.model
        else:
            with unpatched(student) as model:
                yield model

    def within_window(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """`inputs` (tensors [B, L, ...]) cut to the teacher's first `window` positions where longer."""
        import torch

        length = inputs["input_ids"].shape[1]
        if self.window is None or length <= self.window:
            return inputs
        return {key: value[:, :self.window] if isinstance(value, torch.Tensor) else value
                for key, value in inputs.items()}

    def logits(self, student, **inputs: Any) -> "torch.Tensor":
        """The teacher's logits for `inputs` (input_ids [B, L] and optionally position_ids / attention_mask), cut to
        its window; `student` is the (possibly wrapped) model being trained, used by the unpatched view."""
        import torch

        inputs = self.within_window(inputs)
        with torch.no_grad():
            if self.model is not None:
                return self.model(**inputs).logits
            with unpatched(student) as model:
                return model(**inputs).logits


def make_teacher(args: argparse.Namespace, model) -> Teacher | None:
    """The teacher ``--distill-from`` asks for (None without it); made before the patch is applied."""
    if args.distill_from is None:
        return None
    if args.distill_from == "original":
        return Teacher.original(model, frozen_base=args.train_only in ("positional", "lora"))
    return Teacher.loaded(args.distill_from, DTYPES[args.dtype])


def _inner_model(model):
    """The transformers model inside torch.compile / DDP / PEFT wrappers (the one the patch is installed on)."""
    model = uncompiled(model)
    model = getattr(model, "module", model)  # DDP
    if hasattr(model, "get_base_model"):  # PEFT
        model = model.get_base_model()
    return model


@contextlib.contextmanager
def unpatched(model):
    """The model with its positional patch taken off (and LoRA adapters disabled) inside the block, put back after:
    the same method module, so trained positional weights are kept. Yields the model to call."""
    from hf_posenc.checkpoints.saving import INITIAL_STATE_ATTR
    from hf_posenc.engine.install import PATCH_ATTR, _reinstall, applied_patch
    from hf_posenc.registry import get_family

    model = uncompiled(model)  # the teacher's forward runs uncompiled: one compiled graph, the student's
    wrapper = getattr(model, "module", model)
    inner = _inner_model(model)
    applied = applied_patch(inner)
    adapters = wrapper.disable_adapter() if hasattr(wrapper, "disable_adapter") else contextlib.nullcontext()
    if applied is not None:
        applied.log.undo()
        delattr(inner, PATCH_ATTR)
    try:
        with adapters:
            yield wrapper
    finally:
        if applied is not None:  # the same method module goes back, with the save_pretrained of a patched model
            initial = getattr(applied.method, INITIAL_STATE_ATTR, None)
            _reinstall(inner, get_family(inner.config), applied, _save_hook_again(applied))
            if initial is not None:  # what it was installed with, so trained weights still count as trained
                object.__setattr__(applied.method, INITIAL_STATE_ATTR, initial)


def _save_hook_again(applied):
    """What re-attaches the patched model's save_pretrained when the patch is put back (see engine/install.py)."""
    import functools

    from hf_posenc.checkpoints.hub import publish_saved
    from hf_posenc.checkpoints.saving import attach_save_hook

    return functools.partial(attach_save_hook, publish=publish_saved)
