"""FIRE (Li et al. 2023, "Functional Interpolation for Relative Positions Improves Long Context Transformers"):

    bias_h(i, j) = f_theta(psi(i - j) / psi(max(L, i)))_h,   psi(x) = log(c x + 1),

with f_theta a small MLP per layer (1 -> mlp_width -> heads, ReLU), and c > 0 and the threshold L > 0 learned
(kept positive as exp of a parameter). i is the query's true position, so left padding and caches give the
same bias. For queries at positions i <= L the normaliser psi(L) is the same for every query, so the bias is a
function of i - j alone: the attention path then uses a distance table (O(L) memory); past L every (i, j) needs
its own value, computed per query block from the MLP's exact piecewise-linear form (`piecewise_linear`); in
training, `FireBiasForm` sends its gradient to the MLP, c and L in closed form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..config import FLOAT32_MAX, FLOAT32_TINY, MAX_DISTANCE, PosEncConfig
from ..model_info import ModelInfo
from ..registry import register_method
from .alibi import bloom_slopes
from .base import BiasForm, PositionSpan
from .distance import DistanceBiasMethod

DEFAULT_THRESHOLD = 2048


@dataclass
class FireConfig(PosEncConfig):
    mlp_width: int = 32
    # "alibi": the MLP starts as the piecewise-linear interpolant of ALiBi's bias (BLOOM slopes) at mlp_width
    # knots evenly spaced in psi-normalised distance, so a model swapped from ALiBi, or from RoPE to an
    # ALiBi-like prior, starts near a working point. "random": PyTorch's default Linear init, as in the paper.
    init: str = "alibi"
    c: float = 1.0  # initial c of psi(x) = log(c x + 1)
    threshold: float | None = None  # initial L; None: the model's window (max_position_embeddings), else 2048
    learn_c: bool = True
    learn_threshold: bool = True

    def validate(self) -> None:
        self.require_size("mlp_width", 1, "width")
        self.require_choice("init", ("alibi", "random"))
        self.require_number("c", FLOAT32_TINY, FLOAT32_MAX / MAX_DISTANCE,
                            why="c * distance in psi must stay finite in float32 for distances up to 2^24")
        self.require_number("threshold", 1.0, MAX_DISTANCE, none_means="the model's window",
                            why="positions past 2^24 are not exact in float32, so a larger threshold is never reached")
        self.require_bool("learn_c")
        self.require_bool("learn_threshold")


def alibi_interpolant(slopes: torch.Tensor, width: int, c: float, threshold: float):
    """MLP weights (w1 [W], b1 [W], w2 [W, H], b2 [H]) of the piecewise-linear interpolant of -slope * d, as a
    function of u = psi(d) / psi(L), through knots u_k = k / W (k = 0..W-1) and u = 1."""
    knots = torch.arange(width + 1, dtype=torch.float64) / width
    # the distance whose normalised psi is u: psi^-1(u psi(L)) = (exp(u log(c L + 1)) - 1) / c
    distance = torch.expm1(knots * math.log1p(c * threshold)) / c
    values = -slopes.double()[None, :] * distance[:, None]  # [W + 1, H]
    segment_slopes = (values[1:] - values[:-1]) / (knots[1:] - knots[:-1])[:, None]  # [W, H]
    # f(u) = sum_k a_k relu(u - u_k): a_0 is the first segment's slope, a_k the change of slope at knot k.
    w2 = torch.cat([segment_slopes[:1], segment_slopes[1:] - segment_slopes[:-1]])
    return torch.ones(width), -knots[:-1].float(), w2.float(), values[0].float()


@register_method("fire", FireConfig)
class Fire(DistanceBiasMethod):
    block_cost = 3.0  # past the threshold: transient tensors per bias entry (u, lookups)

    def __init__(self, config: FireConfig, info: ModelInfo):
        super().__init__(config, info)
        layers, width, heads = info.num_layers, config.mlp_width, info.num_heads
        threshold = float(config.threshold or info.max_positions or DEFAULT_THRESHOLD)
        if config.init == "alibi":
            w1, b1, w2, b2 = alibi_interpolant(bloom_slopes(heads), width, config.c, threshold)
            w1, b1, w2, b2 = (t[None].repeat(layers, *[1] * t.dim()) for t in (w1, b1, w2, b2))
        else:
            w1, b1, w2, b2 = torch.empty(layers, width), torch.empty(layers, width), \
                torch.empty(layers, width, heads), torch.empty(layers, heads)
            for layer in range(layers):
                first, second = nn.Linear(1, width), nn.Linear(width, heads)
                w1[layer], b1[layer] = first.weight.detach()[:, 0], first.bias.detach()
                w2[layer], b2[layer] = second.weight.detach().T, second.bias.detach()
        self.w1, self.b1, self.w2, self.b2 = (nn.Parameter(t.contiguous()) for t in (w1, b1, w2, b2))
        log_c = torch.full((layers,), math.log(config.c))
        log_threshold = torch.full((layers,), math.log(threshold))
        self.log_c = nn.Parameter(log_c, requires_grad=config.learn_c)
        self.log_threshold = nn.Parameter(log_threshold, requires_grad=config.learn_threshold)

    def threshold(self, layer_idx: int) -> torch.Tensor:
        return self.log_threshold[layer_idx].float().exp()

    def threshold_values(self) -> list[float]:
        """Every layer's threshold as a Python float, read from the device once per change of the parameter (its
        version counter moves with each in-place update: an optimizer step, a load), not once per layer and forward."""
        parameter = self.log_threshold
        if parameter.is_inference():  # made under torch.inference_mode: no version counter, and it cannot change
            stamp = ("inference", parameter.data_ptr(), parameter.device)
        else:
            stamp = (parameter._version, parameter.data_ptr(), parameter.device)
        if getattr(self, "_threshold_stamp", None) != stamp:
            self._threshold_floats = parameter.detach().float().exp().tolist()
            self._threshold_stamp = stamp
        return self._threshold_floats

    def psi(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        return torch.log1p(self.log_c[layer_idx].float().exp() * x)

    def mlp(self, layer_idx: int, u: torch.Tensor) -> torch.Tensor:
        """u float32 [...] -> [..., H]."""
        hidden = torch.relu(u[..., None] * self.w1[layer_idx].float() + self.b1[layer_idx].float())
        return hidden @ self.w2[layer_idx].float() + self.b2[layer_idx].float()

    def distance_bias(self, layer_idx, distance):
        """The bias for queries at positions <= L (where psi(max(L, i)) = psi(L))."""
        u = self.psi(layer_idx, distance) / self.psi(layer_idx, self.threshold(layer_idx))
        return self.mlp(layer_idx, u).T

    def bias_table(self, layer_idx, num_distances, max_position=None, device=None):
        if max_position is None or max_position > self.threshold_values()[layer_idx]:
            return None
        return super().bias_table(layer_idx, num_distances, max_position, device)

    def piecewise_linear(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The MLP as what it is, a piecewise-linear function of its scalar input: sorted knots [W] and, per
        segment (inputs with s knots below them, s = 0..W), slope and intercept [W + 1, H], so that
        mlp(u) = slope[s] * u + intercept[s]. Differentiable in every parameter, like the MLP (a unit's knot moving
        changes no value: relu is 0 there)."""
        w1, b1 = self.w1[layer_idx].float(), self.b1[layer_idx].float()
        w2, b2 = self.w2[layer_idx].float(), self.b2[layer_idx].float()
        rising = w1 > 0
        knots = torch.where(w1 != 0, -b1 / torch.where(w1 != 0, w1, 1.0), torch.inf).detach()
        sorted_knots, order = knots.sort()
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=order.device)
        segment = torch.arange(order.numel() + 1, device=order.device)[:, None]
        # unit k is active (w1 u + b1 > 0) above its knot when rising, below it when falling, always when flat and b1 > 0
        active = torch.where(rising, rank < segment, rank >= segment)
        active = torch.where(w1 == 0, b1 > 0, active).float()  # [W + 1, W]
        return sorted_knots, active @ (w1[:, None] * w2), b2 + active @ (b1[:, None] * w2)

    def block_bias(self, layer_idx, query_positions, key_positions, span):
        # (Under torch.compile the general form below serves: the test reads tensor values.)
        if not torch.compiler.is_compiling():
            span = span or PositionSpan.of(query_positions, key_positions)
            if span.max_query_position <= self.threshold_values()[layer_idx]:
                return super().block_bias(layer_idx, query_positions, key_positions, span)
        # Past the threshold the normaliser psi(i) differs per query, so every (i, j) needs its own value: the
        # MLP's piecewise-linear form gives it with one lookup and one multiply-add per head, about 4x faster on
        # CPU than running the MLP's [.., W] hidden layer on every pair.
        distance = (query_positions[:, :, None] - key_positions[:, None, :]).clamp_min(0).float()
        normaliser = self.psi(layer_idx, torch.maximum(self.threshold(layer_idx), query_positions.float()))
        u = self.psi(layer_idx, distance) / normaliser[:, :, None]  # [B, q, kv]
        knots, slope, intercept = self.piecewise_linear(layer_idx)
        segment = torch.searchsorted(knots, u.detach().reshape(-1))  # knots below each u
        flat = slope.T.index_select(1, segment) * u.reshape(1, -1) + intercept.T.index_select(1, segment)
        return flat.view(-1, *u.shape).transpose(0, 1)  # [B, H, q, kv]

    def bias_form(self, layer_idx, query_positions, key_positions, span):
        span = span or PositionSpan.of(query_positions, key_positions)
        if span.max_query_position <= self.threshold_values()[layer_idx]:
            return None  # a distance table serves
        if key_positions.shape[-1] > 1 and not bool((key_positions.diff(dim=-1) >= 0).all()):
            return None  # positions that restart (packed sequences): segments are not runs of keys (FireBiasForm)
        return FireBiasForm(self, layer_idx, query_positions, key_positions)


class FireBiasForm(BiasForm):
    """FIRE's bias past the threshold, tile by tile, for engine/attention/form_attention.py. With u = psi(d) /
    psi(n), n = max(L, i), and segment s the knots below u, bias_h = slope[s, h] u + intercept[s, h]
    (`piecewise_linear`). u and s are computed once per pair for all heads, and a tile's gradient dS reduces to

        d slope[s, h] = sum_s dS_h u,   d intercept[s, h] = sum_s dS_h   (sums over the pairs in segment s),
        d log c = sum g du/dlog c,   d log L = sum g du/dlog L,   g = sum_h dS_h slope[s, h],
        du/dlog c = (cd / (1 + cd) - u cn / (1 + cn)) / psi(n),   du/dlog L = -u [n = L] cL / ((1 + cL) psi(L)),

    (the chain rule through psi and max, whose tie at i = L takes half, as torch.maximum's), so that every sum is
    one over the pairs of a row in one segment, of dS_h, dS_h u or dS_h cd / (1 + cd). With key positions in order,
    u falls along a row, so each segment is a run of keys, whose sum is the difference of two prefix sums: a cumsum
    per quantity and a lookup at the run ends, where a scatter per pair (or autograd through the per-pair tensors)
    took 50-200x a vectorised pass on the CPU (issue 56). The run ends come from the knots' places in each row's u
    (one search per row and knot), and the segment of each pair from the run ends, so all agree."""

    def __init__(self, fire: Fire, layer_idx: int, query_positions: torch.Tensor, key_positions: torch.Tensor):
        self.fire, self.layer_idx = fire, layer_idx
        self.log_c, self.log_threshold = fire.log_c[layer_idx], fire.log_threshold[layer_idx]
        knots, slope, intercept = fire.piecewise_linear(layer_idx)
        self.tensors = (slope, intercept, self.log_c, self.log_threshold)
        self.knots = knots
        self.slope, self.intercept = slope.detach().T.contiguous(), intercept.detach().T.contiguous()  # [H, S]
        self.c = self.log_c.detach().float().exp()
        self.threshold = self.log_threshold.detach().float().exp()
        self.query_positions, self.key_positions = query_positions.float(), key_positions.float()
        n = torch.maximum(self.threshold, self.query_positions)
        self.normaliser = torch.log1p(self.c * n)  # psi(n) [B or 1, q]
        self.inverse_normaliser = 1.0 / self.normaliser
        self.normaliser_rate = self.c * n / (1 + self.c * n)  # dpsi(n)/dlog c
        # dn/dL of max(L, i): 1 below the threshold, half at a tie, 0 past it
        self.threshold_share = ((self.threshold > self.query_positions).float()
                                + 0.5 * (self.threshold == self.query_positions).float())

    def part(self, rows: slice, columns: slice) -> "FireBiasForm":
        """The form of query rows `rows` and keys `columns` alone (a kernel check's small problem)."""
        return FireBiasForm(self.fire, self.layer_idx, self.query_positions[:, rows], self.key_positions[:, columns])

    def tile(self, rows, columns):
        distance = (self.query_positions[:, rows, None] - self.key_positions[:, None, columns]).clamp_min_(0)
        scaled = distance.mul_(self.c)  # c d
        u = torch.log1p(scaled).div_(self.normaliser[:, rows, None])  # [B or 1, r, k], falling along each row
        batch, r, k = u.shape
        width = self.knots.numel()
        # run ends: ends[.., 1 + m] = how many leading keys have u above knot m (ends[.., 0] = k, ends[.., -1] = 0)
        at_or_below = torch.searchsorted(u.flip(-1).contiguous(), self.knots.expand(batch, r, width).contiguous(),
                                         right=True)
        inner = k - at_or_below
        ends = torch.cat([inner.new_full((batch, r, 1), k), inner, inner.new_zeros(batch, r, 1)], dim=-1)
        # segment of key c = knots below its u = how many run ends lie past c
        passed = torch.zeros(batch, r, k + 1, dtype=inner.dtype, device=u.device).scatter_add_(
            2, inner, torch.ones_like(inner))
        segment = (width - passed.cumsum_(-1)[..., :k]).view(-1)
        heads = self.slope.shape[0]
        bias = self.intercept.index_select(1, segment).addcmul_(self.slope.index_select(1, segment), u.view(1, -1))
        return bias.view(heads, batch, r, k).transpose(0, 1), (rows, scaled, u, ends)

    def start_backward(self, dtype, needed):
        self.needed = needed
        heads, segments = self.slope.shape
        batch = max(self.query_positions.shape[0], self.key_positions.shape[0])
        self.grad_slope = torch.zeros(batch, heads, segments, dtype=dtype, device=self.slope.device)
        self.grad_intercept = torch.zeros_like(self.grad_slope)
        # per query row: the sums over its keys of g u and of g cd / (1 + cd) (g = dloss/du), made into the
        # gradients of c and L once, in `gradients`
        self.row_gu = torch.zeros(batch, self.query_positions.shape[1], dtype=dtype, device=self.slope.device)
        self.row_ga = torch.zeros_like(self.row_gu)

    def accumulate(self, saved, grad_bias):
        rows, scaled, u, ends = saved
        batch, heads, r, k = grad_bias.shape
        if u.shape[0] < batch:  # positions shared by the batch: so are u and the segments
            grad_bias = grad_bias.sum(0, keepdim=True)
            batch = 1
        need_c = self.needed[2]
        count = 3 if need_c else 2  # sums of dS, dS u and (for c) dS cd / (1 + cd)
        # prefix sums along each row, behind a 0: prefix[q, .., j] = sum over keys c < j of dS * weight q
        prefix = grad_bias.new_empty(count, batch, heads, r, k + 1)
        prefix[..., 0] = 0
        torch.cumsum(grad_bias, -1, out=prefix[0, ..., 1:])
        torch.mul(grad_bias, u[:, None], out=prefix[1, ..., 1:])
        if need_c:
            torch.mul(grad_bias, (scaled / (1 + scaled))[:, None], out=prefix[2, ..., 1:])
        prefix[1:].cumsum_(-1)
        starts = torch.arange(0, prefix.numel(), k + 1, device=u.device).view(count, batch, heads, r, 1)
        at_ends = prefix.view(-1).index_select(0, (starts + ends[None, :, None]).view(-1)).view(
            count, batch, heads, r, -1)
        runs = at_ends[..., :-1] - at_ends[..., 1:]  # [quantity, B, H, r, S]: sums over each segment's run
        per_segment = runs[:2].sum(3)  # over the rows
        # sums over each row of g u and g cd / (1 + cd), g = sum_h dS_h slope[s, h] = dloss/du
        row_sums = torch.einsum("qbhrs,hs->qbr", runs[1:], self.slope.to(runs.dtype))
        self.add_sums(per_segment[0], per_segment[1], row_sums[0], row_sums[1] if need_c else None, rows)

    def add_sums(self, dS, dS_u, gu, ga, rows=slice(None)):
        """Adds a backward's sums (from `accumulate`, or a fused kernel that made them itself): per batch row, head
        and segment those of dS and dS u [B, H, S], per batch row and query row in `rows` those of g u and g cd / (1 +
        cd) [B, r] (g = dloss/du; ga None where c takes no gradient). Positions shared by the batch keep one row:
        the sums over the batch go there."""
        if dS.shape[0] > self.grad_slope.shape[0]:
            dS, dS_u, gu = dS.sum(0, keepdim=True), dS_u.sum(0, keepdim=True), gu.sum(0, keepdim=True)
            ga = ga.sum(0, keepdim=True) if ga is not None else None
        batch = dS.shape[0]
        self.grad_intercept[:batch] += dS
        self.grad_slope[:batch] += dS_u
        self.row_gu[:batch, rows] += gu
        if ga is not None:
            self.row_ga[:batch, rows] += ga

    def gradients(self):
        slope, intercept, log_c, log_threshold = self.tensors
        gu, ga, inverse = self.row_gu, self.row_ga, self.inverse_normaliser
        grad_log_c = ((ga - gu * self.normaliser_rate) * inverse).sum()
        rate = self.c * self.threshold / (1 + self.c * self.threshold)
        grad_log_threshold = -(gu * self.threshold_share * inverse).sum() * rate
        grads = (self.grad_slope.sum(0).T.to(slope.dtype), self.grad_intercept.sum(0).T.to(intercept.dtype),
                 grad_log_c.to(log_c.dtype), grad_log_threshold.to(log_threshold.dtype))
        return tuple(grad if needed else None for grad, needed in zip(grads, self.needed))
