"""Stick-breaking attention (Tan, Yang, Courville, Panda, Shen, ICLR 2025, "Scaling Stick-Breaking Attention: An
Efficient Implementation and In-depth Study"): attention weights from a stick-breaking process instead of a softmax,
so that no positional encoding is needed (recency comes from the process itself).

With z_ij = scaling * q_i . k_j (plus the model's own bias under base="native" on BLOOM) and beta_ij = sigmoid(z_ij),
each query breaks its stick from the nearest earlier key outwards:

    A_ij = beta_ij * prod_{j<k<i} (1 - beta_ik)        for keys j < i (the paper's default, attend_current=False)
    A_ij = beta_ij * prod_{j<k<=i} (1 - beta_ik)       for keys j <= i (attend_current=True)
    o_i  = sum_j A_ij v_j + (1 - sum_j A_ij) v_i

computed in log space: log A_ij = logsigmoid(z_ij) + sum_{j<k} logsigmoid(-z_ik) (log(1 - sigmoid(z)) =
-softplus(z), stable for any z), the inner sum a reverse cumulative sum over each row's keys, per query block. The
left-over mass 1 - sum_j A_ij = prod_k (1 - beta_ik) goes to the query's own value v_i, as the paper's reference
implementation does (`o + rem * v`); the attention weights returned in eager mode include it on the diagonal, so
they sum to 1. Masked keys (padding, causality) break nothing. Attention dropout (in training) applies to those
weights.

No position at all with base="none" (the paper's setting). base="native" keeps the model's own mechanism underneath
(RoPE-rotated q and k on LLaMA, as the paper's "stick-breaking + RoPE" ablation; learned wpe on GPT-2; ALiBi's
-slope * (i - j) added to z on BLOOM). Stick-breaking has no state that reproduces the original softmax logits: on
top of the native mechanism the model's outputs change at once, and fine-tuning is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..registry import register_method
from .base import fill_disallowed_, unmasked_columns
from .content import ContentAttention, ContentConfig


LOG_WEIGHT_FLOOR = -80.0


@dataclass
class StickBreakingConfig(ContentConfig):
    attend_current: bool = False  # the query's own key takes part in the stick-breaking (False: the paper's default)

    def validate(self) -> None:
        super().validate()
        self.require_bool("attend_current")


@register_method("stick-breaking", StickBreakingConfig)
class StickBreakingAttention(ContentAttention):
    replaces_softmax = True
    block_cost = 5.0

    def content_weights(self, query, key, block):
        logits = torch.matmul(query, key.transpose(2, 3)).float() * block.scaling
        if block.bias is not None:
            logits = logits + block.bias
        own = block.key_slots[None, :] == block.query_slots[:, None]  # [r, k]: the row's own token
        breaks = block.allowed if self.config.attend_current else block.allowed & ~own
        return StickBreakingWeights.apply(logits, breaks, own)


class StickBreakingWeights(torch.autograd.Function):
    """A block's stick-breaking weights float32 [B, H, r, k] (the left-over mass on each row's own key `own` [r, k])
    from its logits z [B, H, r, k] and the keys that break the stick (`breaks`, bool, broadcast), with the backward
    written out: autograd through the same chain runs about twice as many full passes over the block. With
    A_ij = exp(L_ij), L_ij = logsigmoid(z_ij) + sum_{j<k} log(1 - sigmoid(z_ik)), and the remainder R_i =
    exp(sum_k log(1 - sigmoid(z_ik))), for upstream gradients G: dL = G A, dR_i = G_i,own R_i, and dz_ij =
    dL_ij - sigmoid(z_ij) (sum_{k<=j} dL_ik + dR_i) where key j breaks, else 0."""

    @staticmethod
    def forward(ctx, logits, breaks, own):
        # log(beta) = min(z, 0) - t and log(1 - beta) = -max(z, 0) - t with t = log(1 + exp(-|z|)), exact for any z:
        # one t for both, about half the time of two F.logsigmoid calls (which also fill a buffer for a backward).
        # The clamps here and below: exp of an argument under about -88 (where float32 underflows) takes a path about
        # 10x slower in the CPU kernel, and most of a long row's keys are that far down the stick. A weight floored
        # at exp(-80) (2e-35) changes nothing at float32's precision of weights that sum to 1.
        shared = logits.abs().clamp_(max=-LOG_WEIGHT_FLOOR).neg_().exp_().log1p_()
        unmasked = unmasked_columns(breaks)  # the columns every row breaks at need no mask
        # log(1 - beta), 0 where the key does not break
        kept = fill_disallowed_(logits.clamp(min=0.0).neg_().sub_(shared), breaks, 0.0, unmasked)
        # sum_{k > j} log(1 - beta_ik): the reverse cumulative sum from the row's nearest key, shifted by one.
        after = F.pad(kept.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1))
        weights = logits.clamp(max=0.0).sub_(shared).add_(after).clamp_(min=LOG_WEIGHT_FLOOR).exp_()
        fill_disallowed_(weights, breaks, 0.0, unmasked)
        remainder = kept.sum(-1, keepdim=True).exp_()  # prod_k (1 - beta_ik): what no key took
        ctx.save_for_backward(logits, breaks, own, weights, remainder)
        ctx.unmasked = unmasked
        return weights + remainder * own.to(weights.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        logits, breaks, own, weights, remainder = ctx.saved_tensors
        grad_log = grad * weights
        grad_remainder = (grad * own).sum(-1, keepdim=True).mul_(remainder)
        through = grad_log.cumsum(-1).add_(grad_remainder)
        grad_logits = torch.addcmul(grad_log, torch.sigmoid(logits), through, value=-1.0)
        return fill_disallowed_(grad_logits, breaks, 0.0, ctx.unmasked), None, None
