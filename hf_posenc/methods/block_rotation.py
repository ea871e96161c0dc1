"""Rotations by b x b blocks, R(p) = exp(p A) with A block-diagonal and skew-symmetric: the common part of ComRoPE
and LieRE (methods/comrope.py, methods/liere.py).

Layout: LLaMA checkpoints rotate dimension k together with dimension k + d/2 (the half-split layout). Here the rotary
dimensions are reordered so that those pairs are neighbours, (0, d/2, 1, d/2 + 1, ...), then cut into blocks of b
consecutive dimensions (b/2 RoPE pairs each). RoPE is the special case where each block of A holds 2 x 2 blocks
[[0, -w_k], [w_k, 0]] with the model's frequencies w_k on its diagonal (`rope_generators`).

The rotation of every position is exp(p A) in float32: closed form (cos, sin) for b = 2, torch.linalg.matrix_exp
otherwise, computed once per forward for the queries and once for the keys and shared by every layer
(engine/state.py: PositionState.rotation_of). LLaMA-family layers can only apply cos/sin pairs themselves, so these methods rotate queries and the
(un-rotated) key cache inside the shared attention path, on every family alike.
"""

from __future__ import annotations

import torch

from ..config import PosEncConfig
from ..errors import PosEncError
from ..model_info import ModelInfo
from .base import RotaryMethod
from .rope import DEFAULT_THETA, default_inv_freq

# Options shared by the configs of these methods.
INIT_CHOICES = ("rope", "random")
INIT_STD_MAX = 1.0  # random generator entries: angles per position of order 1 already alias at distance ~ 3


def upper_size(block_size: int) -> int:
    """The number of free entries of a skew-symmetric block (its strict upper triangle)."""
    return block_size * (block_size - 1) // 2


def skew_from_upper(upper: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., upper_size(b)] strict-upper-triangle entries -> skew-symmetric [..., b, b]."""
    rows, cols = torch.triu_indices(block_size, block_size, offset=1, device=upper.device)
    matrix = upper.new_zeros((*upper.shape[:-1], block_size, block_size))
    matrix[..., rows, cols] = upper
    return matrix - matrix.transpose(-1, -2)


def rope_generators(inv_freq: torch.Tensor, block_size: int) -> torch.Tensor:
    """The strict-upper entries [num_blocks, upper_size(b)] of RoPE's generator in the pair-neighbour layout: the
    entry (2i, 2i + 1) of pair k's block is -w_k, so exp(p A) rotates the pair by the angle p * w_k as RoPE does."""
    pair_starts = 2 * torch.arange(inv_freq.shape[0])  # pair k occupies dimensions 2k, 2k + 1
    block, row = pair_starts // block_size, pair_starts % block_size
    full = torch.zeros(pair_starts.shape[0] * 2 // block_size, block_size, block_size)
    full[block, row, row + 1] = -inv_freq  # (tensor ops only: methods are also built on the meta device)
    rows, cols = torch.triu_indices(block_size, block_size, offset=1)
    return full[:, rows, cols]


def block_exponentials(generators: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """generators [..., num_blocks, b, b] (skew; with a leading heads axis when per head), positions [B or 1, q] ->
    exp(p A) float32 [B or 1, q, ..., num_blocks, b, b]."""
    if generators.shape[-1] == 2:  # closed form: a plane rotation by the angle in entry (1, 0)
        angle = positions[(...,) + (None,) * (generators.dim() - 2)].float() * generators.float()[..., 1, 0]
        cos, sin = angle.cos(), angle.sin()
        return torch.stack((torch.stack((cos, -sin), -1), torch.stack((sin, cos), -1)), -2)
    if not positions.is_floating_point() and not torch.compiler.is_compiling():
        # (power_products sizes its table by the largest position, a value torch.compile cannot trace)
        return power_products(generators.float(), positions)
    return torch.linalg.matrix_exp(positions[(...,) + (None,) * generators.dim()].float() * generators.float())


def power_products(generators: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """exp(p A) for integer positions as the product of exp(2^k A) (exp(-2^k A) for p < 0) over the bits of |p|, in
    ascending order. A matrix_exp per position cost (at 2048 positions, b = 64) a tenth of LieRE's training step
    forward, and its backward, the exponential of a [2b, 2b] block matrix per position, half of the step; these
    products need log2(L) exponentials and about one b x b matmul per position, forward and backward, and stay
    closer to exp(p A) at large |p| (rounding grows with the number of bits, not with |p| ||A||)."""
    expand = (...,) + (None,) * generators.dim()
    products = None
    for sign in (1, -1):
        if sign == -1 and not bool((positions < 0).any()):
            break
        distance = (positions * sign).clamp_min(0)  # positions of the other sign: 0 here, replaced below
        count = int(distance.max()) + 1 if distance.numel() else 1
        bits = torch.arange(max(1, (count - 1).bit_length()), device=generators.device)
        factors = torch.linalg.matrix_exp((2.0 ** bits * sign)[expand].to(generators.dtype) * generators)
        if count <= 2 * distance.numel() + 64:  # positions that fill their range: a table of every product
            signed = power_table(factors, count)[distance]
        else:  # a few positions far apart (decoding): each one's own product
            signed = bit_products(factors, distance)
        products = signed if products is None else torch.where((positions < 0)[expand], signed, products)
    return products


def power_table(factors: torch.Tensor, count: int) -> torch.Tensor:
    """factors [bits, ...] = exp(2^k A) -> [count, ...]: entry n = exp(n A), doubled each step as
    exp((n + 2^k) A) = exp(n A) exp(2^k A) (the order of bit_products, so both give the same numbers)."""
    table = torch.eye(factors.shape[-1], dtype=factors.dtype, device=factors.device).expand(1, *factors.shape[1:])
    for factor in factors:
        if table.shape[0] >= count:
            break
        table = torch.cat((table, table[:count - table.shape[0]] @ factor))
    return table


def bit_products(factors: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """factors [bits, ...] = exp(2^k A), distance [B or 1, q] >= 0 -> [B or 1, q, ...]: exp(n A) for each n."""
    expand = (...,) + (None,) * (factors.dim() - 1)
    products = torch.eye(factors.shape[-1], dtype=factors.dtype, device=factors.device)
    products = products.expand(*distance.shape, *factors.shape[1:])
    for bit, factor in enumerate(factors):
        products = torch.where(((distance >> bit) & 1).bool()[expand], products @ factor, products)
    return products


def to_pair_neighbours(x: torch.Tensor) -> torch.Tensor:
    """[..., d] in the half-split layout -> [..., d] with dimension k next to k + d/2."""
    return x.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)


def to_half_split(x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class BlockRotationMethod(RotaryMethod):
    """A rotary method whose rotation is exp(p A) by blocks; a subclass says what A is (`generators`)."""

    rotates_in_attention = True

    def __init__(self, config: PosEncConfig, info: ModelInfo, block_size: int):
        super().__init__(config, info)
        # per_head: one generator per key-value head (its query heads share it, as they share its keys)
        self.rotation_heads = info.num_kv_heads if getattr(config, "per_head", False) else None
        dim = info.rotary_dim
        if block_size % 2 or dim % block_size:
            raise PosEncError(f"{type(self).__name__}: block_size={block_size} must be even and divide the rotary "
                              f"dimension {dim} of this model; pass one of "
                              f"{[b for b in range(2, dim + 1, 2) if dim % b == 0]}.")
        self.rotary_dim, self.block_size, self.num_blocks = dim, block_size, dim // block_size
        # The frequencies init="rope" starts from: the model's own RoPE, else the `rope` patch's (theta 10000).
        self.initial_theta = float(getattr(config, "theta", None) or info.rope_theta or info.patched_rope_theta
                                   or DEFAULT_THETA)
        self.rope_inv_freq = default_inv_freq(self.initial_theta, dim)

    def initial_upper(self, init: str, init_std: float) -> torch.Tensor:
        """Strict-upper entries [num_blocks, upper_size(b)] of the starting generator ([heads, num_blocks, ...] per
        head: RoPE's for every head, or independent random ones)."""
        heads = () if self.rotation_heads is None else (self.rotation_heads,)
        if init == "rope":
            return rope_generators(self.rope_inv_freq, self.block_size).expand(*heads, -1, -1).clone()
        return torch.randn(*heads, self.num_blocks, upper_size(self.block_size)) * init_std

    def generators(self) -> torch.Tensor:
        """The skew-symmetric blocks [num_blocks, b, b] of A (float32; [kv heads, num_blocks, b, b] per head)."""
        raise NotImplementedError

    def rotation(self, positions, seq_len=0):
        return block_exponentials(self.generators(), positions)

    def rotate_together(self, query, key, rotation):
        # Each key head beside its group of query heads, so that a per-head rotation groups them as it groups
        # either alone. One product of H + H_kv vectors per position and block: two products (H, then H_kv) took
        # 4x as long, forward and backward (SmolLM2's 9 + 3 heads, 512 positions, b = 64).
        kv_heads = key.shape[1]
        both = torch.cat((query.unflatten(1, (kv_heads, -1)), key[:, :, None]), dim=2)  # [B, H_kv, group + 1, n, D]
        rotated = self.rotate_heads(both.flatten(1, 2), rotation).unflatten(1, (kv_heads, -1))
        return rotated[:, :, :-1].flatten(1, 2), rotated[:, :, -1]

    def rotate_heads(self, x, rotation):
        dim = self.rotary_dim
        rotary, rest = x[..., :dim], x[..., dim:]
        blocks = to_pair_neighbours(rotary).unflatten(-1, (self.num_blocks, self.block_size))  # [B, H, q, n, b]
        if self.rotation_heads is None:
            matrices = rotation.to(x.dtype).expand(x.shape[0], -1, -1, -1, -1)  # [B, q, n, b, b]
            rotated = torch.einsum("zqnij,zhqnj->zhqni", matrices, blocks)  # no copy of the matrices per head
        else:  # [B, q, kv heads, n, b, b]; x's heads are the kv heads (keys) or groups of them (queries)
            matrices = rotation.to(x.dtype).expand(x.shape[0], -1, -1, -1, -1, -1)
            grouped = blocks.unflatten(1, (self.rotation_heads, -1))  # [B, kv heads, group, q, n, b]
            rotated = torch.einsum("zqknij,zkgqnj->zkgqni", matrices, grouped).flatten(1, 2)
        rotated = to_half_split(rotated.flatten(-2))
        return rotated if rest.shape[-1] == 0 else torch.cat((rotated, rest), dim=-1)
