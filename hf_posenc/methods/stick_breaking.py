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
from .content import ContentAttention, ContentConfig


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
        log_keep = F.logsigmoid(-logits).masked_fill(~breaks, 0.0)  # log(1 - beta), 0 where nothing breaks
        # sum_{k > j} log(1 - beta_ik): the reverse cumulative sum from the row's nearest key, shifted by one.
        after = F.pad(log_keep.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1))
        weights = torch.exp(F.logsigmoid(logits) + after).masked_fill(~breaks, 0.0)
        remainder = torch.exp(log_keep.sum(-1, keepdim=True))  # prod_k (1 - beta_ik): what no key took
        return weights + remainder * own.to(weights.dtype)
