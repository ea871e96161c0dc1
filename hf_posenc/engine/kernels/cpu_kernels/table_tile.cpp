// The backward tiles of biased attention for the CPU, for a learned distance table (engine/attention/
// table_attention.py has the method, the widened operands and the torch-op tiles this replaces) and for FIRE past its
// threshold (engine/attention/form_attention.py, methods/fire.py's FireBiasForm); engine/fused_cpu.py builds this file.
//
// Per batch x head, per query block, per key tile, in one thread's cache: the bias written into the tile, then
//   S = bias + scale Q K^T,  P = exp(S - lse) (0 where at most kSmallestProbability),  dV += P^T dO,
//   dS = (dO V^T - delta) * P, the bias's parameters' gradient from dS,  dQ += scale dS K,  dK += dS^T (scale Q),
// the five products by the BLAS torch links (tiles.h), the passes between them one loop each over the tile, where
// the torch-op tiles take about ten (a bias copy, clamp, exp, threshold, the multiply, the skewed buffer's column sum)
// at memory speed across a batch of heads. A tile whose every probability is dropped (the far keys of a steep ALiBi)
// skips its four later products. The bias and its gradient are a policy (TableBias: a copy of the table and its
// anti-diagonal sums; FireBias: FIRE's piecewise-linear MLP per pair and its sums per segment).

#include "tiles.h"

#include <limits>

namespace {

using namespace hf_posenc_cpu;

// The torch-op tiles' constants (table_attention.SMALLEST_PROBABILITY): probabilities at most 2^-60 are dropped, so
// that dS holds no subnormal number (a multiply-add with one is a microcode assist on an Intel core, issue 56), and
// exp's argument is floored below log(2^-60), where its result falls under that and is dropped too.
constexpr double kSmallestProbability = 0x1p-60;
constexpr double kLogFloor = -42.588830833596716;  // log(2^-60) - 1

// A tile's logits to probabilities, in place, row r shifted by shift[r * stride] (-lse): exp(max(s + shift, floor)),
// 0 where at most kSmallestProbability; whether any probability is kept.
template <typename T>
inline bool probabilities_in_place(T* s, int64_t rows, int64_t n, const T* shift, int64_t stride) {
  const T floor = T(kLogFloor), smallest = T(kSmallestProbability);
  int kept = 0;
  for (int64_t r = 0; r < rows; ++r) {
    T* row = s + r * n;
    const T by = shift == nullptr ? T(0) : shift[r * stride];
#pragma omp simd reduction(| : kept)
    for (int64_t c = 0; c < n; ++c) {
      const T p = std::exp(std::max(row[c] + by, floor));
      const bool keep = p > smallest;
      row[c] = keep ? p : T(0);
      kept |= int(keep);
    }
  }
  return kept != 0;
}

template <typename T>
struct Operands {
  const T *query, *key, *grad, *value;  // [N, q, W], [N, kv, W], [N, q, W], [N, kv, W] (W = D + 1)
  T *grad_query, *grad_key, *grad_value;  // [N, q, D], [N, kv, D], [N, kv, D]
  int64_t q, kv, dim;
};

// The distance table's bias: entry (r, c) of a tile is padded[offset + r + c] (keys in reversed order, block
// (first, rows, keys, start): the block's keys are the last `keys`, its tile at `tile` starts at start + tile), and
// its gradient the sums of dS along the anti-diagonals.
template <typename T>
struct TableBias {
  const T* padded;  // this head's [P]
  T* grad_padded;   // this batch x head's [P], or null

  int64_t first_key(int64_t kv, int64_t keys, int64_t tile) const { return kv - keys + tile; }

  void fill(T* p, int64_t, int nr, int64_t, int nk, int64_t offset) {
    for (int r = 0; r < nr; ++r) std::copy(padded + offset + r, padded + offset + r + nk, p + int64_t(r) * nk);
  }

  // dS = (dP - delta) * P of tile row r, in place in g, and the table's gradient += its anti-diagonal sums.
  void row_gradient(T* g, const T* p, T centre, int r, int64_t, int64_t, int nk, int64_t offset) {
    if (grad_padded == nullptr) {
#pragma omp simd
      for (int c = 0; c < nk; ++c) g[c] = (g[c] + centre) * p[c];
      return;
    }
    T* sums = grad_padded + offset + r;
#pragma omp simd
    for (int c = 0; c < nk; ++c) {
      const T ds = (g[c] + centre) * p[c];
      g[c] = ds;
      sums[c] += ds;
    }
  }

  void finish() {}
};

// FIRE's bias past its threshold (methods/fire.py, FireBiasForm): with keys in slot order (block (first, rows, keys, _):
// its keys are the first `keys`), u = log1p(c d) / psi(n) per pair (d = max(i - j, 0), psi(n) per query), the segment s
// = how many of the MLP's sorted knots lie below u, and bias_h = slope[s] u + intercept[s]; keys after the query slot
// are masked. Key positions rise along a row (the form requires it), so u falls and each segment is a run of keys,
// found by a binary search per knot in the row's u (as FireBiasForm.tile's run ends): the bias is one multiply-add
// per pair, and the gradient per segment (the sums of dS and dS u) and per query row (those of g u and
// g cd / (1 + cd), g = dS slope[s]; the form's `gradients` makes them the gradients of c and L) one vector pass per run.
// One row of FireBias: the u of its nk keys (falling) and its segments' bounds.
template <typename T>
inline void fire_row_u(T* ur, int32_t* b, T i, T normaliser, const T* kp, int nk, T c, const T* knots, int64_t width) {
  const T inverse = T(1) / normaliser;
#pragma omp simd
  for (int k = 0; k < nk; ++k) ur[k] = std::log1p(c * std::max(i - kp[k], T(0))) * inverse;
  b[0] = nk;
  for (int64_t m = 0; m < width; ++m) {  // how many leading keys have u above knot m
    const T knot = knots[m];
    b[m + 1] = knot < ur[nk - 1] ? nk : !(knot < ur[0]) ? 0
               : int32_t(std::partition_point(ur, ur + nk, [knot](T v) { return v > knot; }) - ur);
  }
  b[width + 1] = 0;
}

// One row of FireBias's bias for one head from its u and bounds: slope[s] u + intercept[s], the lowest float (as
// geometry.combined_mask's masked entries) where the key's slot is after the query's.
template <typename T>
inline void fire_row_bias(T* pr, const T* ur, const int32_t* b, const T* slope, const T* intercept, int64_t width,
                          const int64_t* ks, int64_t slot, int nk) {
  for (int64_t s = 0; s <= width; ++s) {
    const T a = slope[s], o = intercept[s];
#pragma omp simd
    for (int k = b[s + 1]; k < b[s]; ++k) pr[k] = a * ur[k] + o;
  }
  const T lowest = std::numeric_limits<T>::lowest();
#pragma omp simd
  for (int k = 0; k < nk; ++k) pr[k] = ks[k] <= slot ? pr[k] : lowest;
}

template <typename T>
struct FireBias {
  const T *query_positions, *key_positions, *normaliser;  // this batch row's [q], [kv], [q]
  const int64_t *query_slots, *key_slots;                  // [q], [kv]
  const T *knots, *slope, *intercept;                      // [W] sorted, this head's [W + 1], [W + 1]
  int64_t width;
  T c;
  bool form_grad, c_grad;
  T *grad_intercept, *grad_slope, *row_gu, *row_ga;  // this batch x head's [W + 1], [W + 1], [q], [q] (form_grad)
  std::vector<T>& u;                                 // the tile's u, per thread
  std::vector<int32_t>& bounds;                      // per tile row [W + 2]: segment s's keys are [b[s + 1], b[s])
  std::vector<double> sums_intercept = std::vector<double>(width + 1), sums_slope = std::vector<double>(width + 1);

  int64_t first_key(int64_t, int64_t, int64_t tile) const { return tile; }

  void fill(T* p, int64_t first, int nr, int64_t c0, int nk, int64_t) {
    for (int r = 0; r < nr; ++r) {
      T* ur = u.data() + int64_t(r) * nk;
      int32_t* b = bounds.data() + int64_t(r) * (width + 2);
      fire_row_u(ur, b, query_positions[first + r], normaliser[first + r], key_positions + c0, nk, c, knots, width);
      fire_row_bias(p + int64_t(r) * nk, ur, b, slope, intercept, width, key_slots + c0, query_slots[first + r], nk);
    }
  }

  void row_gradient(T* g, const T* p, T centre, int r, int64_t first, int64_t c0, int nk, int64_t) {
#pragma omp simd
    for (int k = 0; k < nk; ++k) g[k] = (g[k] + centre) * p[k];
    if (!form_grad) return;
    const T* ur = u.data() + int64_t(r) * nk;
    const int32_t* b = bounds.data() + int64_t(r) * (width + 2);
    const T* kp = key_positions + c0;
    const T i = query_positions[first + r], cc = c;
    T gu = 0, ga = 0;
    for (int64_t s = 0; s <= width; ++s) {
      const int begin = b[s + 1], end = b[s];
      if (begin >= end) continue;
      T sd = 0, sdu = 0, sda = 0;
#pragma omp simd reduction(+ : sd, sdu)
      for (int k = begin; k < end; ++k) {
        sd += g[k];
        sdu += g[k] * ur[k];
      }
      if (c_grad) {
#pragma omp simd reduction(+ : sda)
        for (int k = begin; k < end; ++k) {
          const T scaled = cc * std::max(i - kp[k], T(0));
          sda += g[k] * scaled / (1 + scaled);
        }
      }
      sums_intercept[s] += sd;
      sums_slope[s] += sdu;
      gu += slope[s] * sdu;
      ga += slope[s] * sda;
    }
    row_gu[first + r] += gu;
    row_ga[first + r] += ga;
  }

  void finish() {
    if (!form_grad) return;
    for (int64_t s = 0; s <= width; ++s) {
      grad_intercept[s] = T(sums_intercept[s]);
      grad_slope[s] = T(sums_slope[s]);
    }
  }
};

// One batch x head `n`: every block's tiles, in order, the bias and its gradient by `bias` (TableBias, FireBias).
template <typename T, typename Bias>
void head_backward(const Operands<T>& o, int64_t n, const int64_t* blocks, int64_t block_count, int64_t tile_width,
                   T scaling, Bias& bias, std::vector<T>& probs, std::vector<T>& grads) {
  const int64_t wide = o.dim + 1, dim = o.dim;
  const T* qw = o.query + n * o.q * wide;
  const T* kw = o.key + n * o.kv * wide;
  const T* gw = o.grad + n * o.q * wide;
  const T* vw = o.value + n * o.kv * wide;
  T* dq = o.grad_query + n * o.q * dim;
  T* dk = o.grad_key + n * o.kv * dim;
  T* dv = o.grad_value + n * o.kv * dim;
  for (int64_t b = 0; b < block_count; ++b) {
    const int64_t first = blocks[4 * b], rows = blocks[4 * b + 1], keys = blocks[4 * b + 2], start = blocks[4 * b + 3];
    const int nr = int(rows);
    for (int64_t tile = 0; tile < keys; tile += tile_width) {
      const int nk = int(std::min(tile_width, keys - tile));
      const int64_t c0 = bias.first_key(o.kv, keys, tile), offset = start + tile;
      T* p = probs.data();
      T* g = grads.data();
      bias.fill(p, first, nr, c0, nk, offset);
      // -lse and -delta (the widened operands' last columns) are added in the passes: the products run at depth D,
      // which the BLAS takes faster than D + 1.
      times_transposed<T>(qw + first * wide, kw + c0 * wide, p, nr, nk, int(dim), T(1), T(1), wide, wide);
      if (!probabilities_in_place(p, nr, nk, qw + first * wide + dim, wide)) continue;  // dS = 0: no gradient
      // dV[c0:] += P^T dO   (dO: the first D columns of dO')
      gemm('N', 'T', int(dim), nk, nr, T(1), gw + first * wide, int(wide), p, nk, T(1), dv + c0 * dim, int(dim));
      times_transposed<T>(gw + first * wide, vw + c0 * wide, g, nr, nk, int(dim), T(1), T(0), wide, wide);  // dP
      for (int r = 0; r < nr; ++r)  // dS = (dP - delta) * P, and what the bias's parameters take from it
        bias.row_gradient(g + int64_t(r) * nk, p + int64_t(r) * nk, gw[(first + r) * wide + dim], r, first, c0, nk,
                          offset);
      // dQ[first:] += scale dS K,  dK[c0:] += dS^T (scale Q)   (K, scale Q: the first D columns of K', Q')
      gemm('N', 'N', int(dim), nr, nk, scaling, kw + c0 * wide, int(wide), g, nk, T(1), dq + first * dim, int(dim));
      gemm('N', 'T', int(dim), nk, nr, T(1), qw + first * wide, int(wide), g, nk, T(1), dk + c0 * dim, int(dim));
    }
  }
  bias.finish();
}

// The largest row count of a block list [n, 4] (first, rows, keys, start).
inline int64_t most_rows(const at::Tensor& blocks) {
  const int64_t* b = blocks.data_ptr<int64_t>();
  int64_t most = 1;
  for (int64_t i = 0; i < blocks.size(0); ++i) most = std::max(most, b[4 * i + 1]);
  return most;
}

// The zeroed gradients of queries, keys and values a backward writes ([N, q, D], [N, kv, D], [N, kv, D]), the Operands
// over them and the widened inputs, and the scratch sizes of its tiles (rows, keys).
template <typename T>
struct BackwardOutputs {
  at::Tensor grad_query, grad_key, grad_value;
  Operands<T> operands;
  int64_t rows, tile;
};

template <typename T>
BackwardOutputs<T> backward_outputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& grad,
                                    const at::Tensor& value, const at::Tensor& blocks, int64_t tile_width) {
  const int64_t count = query.size(0), q = query.size(1), kv = key.size(1), dim = query.size(2) - 1;
  auto options = query.options();
  auto grad_query = at::zeros({count, q, dim}, options);
  auto grad_key = at::zeros({count, kv, dim}, options);
  auto grad_value = at::zeros({count, kv, dim}, options);
  Operands<T> o{query.data_ptr<T>(), key.data_ptr<T>(), grad.data_ptr<T>(), value.data_ptr<T>(),
                grad_query.data_ptr<T>(), grad_key.data_ptr<T>(), grad_value.data_ptr<T>(), q, kv, dim};
  return {grad_query, grad_key, grad_value, o, most_rows(blocks), std::max<int64_t>(1, tile_width)};
}

template <typename T>
std::vector<at::Tensor> backward_impl(const at::Tensor& query, const at::Tensor& key, const at::Tensor& grad,
                                      const at::Tensor& value, const at::Tensor& padded, const at::Tensor& blocks,
                                      int64_t tile_width, double scaling, bool table_grad) {
  const int64_t count = query.size(0), heads = padded.size(0), width = padded.size(1);
  auto out = backward_outputs<T>(query, key, grad, value, blocks, tile_width);
  auto grad_padded = table_grad ? at::zeros({count, width}, query.options()) : at::Tensor();
  const Operands<T>& o = out.operands;
  const int64_t* block_rows = blocks.data_ptr<int64_t>();
  const int64_t block_count = blocks.size(0), rows = out.rows, tile = out.tile;
  // Every batch x head writes its own gradients (a key or value head shared by a group is summed by the caller).
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> probs(rows * tile), grads(rows * tile);
    for (int64_t n = begin; n < end; ++n) {
      TableBias<T> bias{padded.data_ptr<T>() + (n % heads) * width,
                        table_grad ? grad_padded.data_ptr<T>() + n * width : nullptr};
      head_backward<T>(o, n, block_rows, block_count, tile, T(scaling), bias, probs, grads);
    }
  });
  if (!table_grad) return {out.grad_query, out.grad_key, out.grad_value};
  return {out.grad_query, out.grad_key, out.grad_value, grad_padded};
}

std::vector<at::Tensor> table_backward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& grad,
                                       const at::Tensor& value, const at::Tensor& padded, const at::Tensor& blocks,
                                       int64_t tile_width, double scaling, bool table_grad) {
  TORCH_CHECK(query.device().is_cpu(), "table_backward: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && grad.sizes() == query.sizes() && value.sizes() == key.sizes() &&
                  key.size(0) == query.size(0) && key.size(2) == query.size(2) && padded.dim() == 2 &&
                  query.size(0) % padded.size(0) == 0,
              "table_backward: query, grad [N, q, D + 1], key, value [N, kv, D + 1], padded [H, P] (H divides N)");
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) == 4 && blocks.scalar_type() == at::kLong && blocks.is_contiguous(),
              "table_backward: blocks [n, 4] int64");
  for (const auto* t : {&query, &key, &grad, &value, &padded}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == query.scalar_type(), "table_backward: contiguous, one dtype");
  }
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kDouble,
              "table_backward: float32 or float64");
  const int64_t* b = blocks.data_ptr<int64_t>();
  for (int64_t i = 0; i < blocks.size(0); ++i) {  // every read stays inside the operands
    const int64_t first = b[4 * i], rows = b[4 * i + 1], keys = b[4 * i + 2], start = b[4 * i + 3];
    TORCH_CHECK(first >= 0 && rows > 0 && first + rows <= query.size(1) && keys > 0 && keys <= key.size(1) &&
                    start >= 0 && start + rows + keys - 1 <= padded.size(1),
                "table_backward: block ", i, " reaches outside its operands");
  }
  if (query.scalar_type() == at::kDouble)
    return backward_impl<double>(query, key, grad, value, padded, blocks, tile_width, scaling, table_grad);
  return backward_impl<float>(query, key, grad, value, padded, blocks, tile_width, scaling, table_grad);
}

struct FireInputs {
  const at::Tensor &query_positions, &key_positions, &normaliser, &query_slots, &key_slots, &knots, &slope, &intercept;
};

template <typename T>
std::vector<at::Tensor> fire_backward_impl(const at::Tensor& query, const at::Tensor& key, const at::Tensor& grad,
                                           const at::Tensor& value, const FireInputs& f, const at::Tensor& blocks,
                                           int64_t tile_width, double scaling, double c, bool form_grad, bool c_grad) {
  const int64_t count = query.size(0), q = query.size(1), kv = key.size(1);
  const int64_t heads = f.slope.size(0), width = f.knots.size(0);
  const int64_t query_rows = f.query_positions.size(0), key_rows = f.key_positions.size(0);
  auto out = backward_outputs<T>(query, key, grad, value, blocks, tile_width);
  auto options = query.options();
  const int64_t sums = form_grad ? count : 0;
  auto grad_intercept = at::zeros({sums, width + 1}, options), grad_slope = at::zeros({sums, width + 1}, options);
  auto row_gu = at::zeros({sums, q}, options), row_ga = at::zeros({sums, q}, options);
  const Operands<T>& o = out.operands;
  const int64_t* block_rows = blocks.data_ptr<int64_t>();
  const int64_t block_count = blocks.size(0), rows = out.rows, tile = out.tile;
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> probs(rows * tile), grads(rows * tile), u(rows * tile);
    std::vector<int32_t> bounds(rows * (width + 2));
    for (int64_t n = begin; n < end; ++n) {
      const int64_t batch = n / heads, head = n % heads;
      const int64_t qb = query_rows == 1 ? 0 : batch, kb = key_rows == 1 ? 0 : batch;
      FireBias<T> bias{f.query_positions.data_ptr<T>() + qb * q, f.key_positions.data_ptr<T>() + kb * kv,
                       f.normaliser.data_ptr<T>() + qb * q, f.query_slots.data_ptr<int64_t>(),
                       f.key_slots.data_ptr<int64_t>(), f.knots.data_ptr<T>(),
                       f.slope.data_ptr<T>() + head * (width + 1), f.intercept.data_ptr<T>() + head * (width + 1),
                       width, T(c), form_grad, c_grad,
                       form_grad ? grad_intercept.data_ptr<T>() + n * (width + 1) : nullptr,
                       form_grad ? grad_slope.data_ptr<T>() + n * (width + 1) : nullptr,
                       form_grad ? row_gu.data_ptr<T>() + n * q : nullptr,
                       form_grad ? row_ga.data_ptr<T>() + n * q : nullptr, u, bounds};
      head_backward<T>(o, n, block_rows, block_count, tile, T(scaling), bias, probs, grads);
    }
  });
  return {out.grad_query, out.grad_key, out.grad_value, grad_intercept, grad_slope, row_gu, row_ga};
}

void check_fire_inputs(const char* name, const FireInputs& f, const at::ScalarType dtype, int64_t q, int64_t kv) {
  TORCH_CHECK(f.query_positions.dim() == 2 && f.query_positions.size(1) == q && f.normaliser.sizes() ==
                  f.query_positions.sizes() && f.key_positions.dim() == 2 && f.key_positions.size(1) == kv,
              name, ": query positions and normaliser [B or 1, q], key positions [B or 1, kv]");
  TORCH_CHECK(f.query_slots.dim() == 1 && f.query_slots.size(0) == q && f.key_slots.dim() == 1 &&
                  f.key_slots.size(0) == kv && f.query_slots.scalar_type() == at::kLong &&
                  f.key_slots.scalar_type() == at::kLong && f.query_slots.is_contiguous() &&
                  f.key_slots.is_contiguous(),
              name, ": query slots [q], key slots [kv] int64");
  TORCH_CHECK(f.knots.dim() == 1 && f.slope.dim() == 2 && f.slope.size(1) == f.knots.size(0) + 1 &&
                  f.intercept.sizes() == f.slope.sizes(),
              name, ": knots [W], slope and intercept [H, W + 1]");
  for (const auto* t : {&f.query_positions, &f.key_positions, &f.normaliser, &f.knots, &f.slope, &f.intercept}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == dtype, name, ": contiguous, the operands' dtype");
  }
  // Each segment is a run of keys only where key positions rise along the row (FireBias).
  TORCH_CHECK(kv < 2 || (f.key_positions.narrow(1, 1, kv - 1) >= f.key_positions.narrow(1, 0, kv - 1)).all().item<bool>(),
              name, ": key positions must not fall along a row");
}

std::vector<at::Tensor> fire_backward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& grad,
                                      const at::Tensor& value, const at::Tensor& query_positions,
                                      const at::Tensor& key_positions, const at::Tensor& normaliser,
                                      const at::Tensor& query_slots, const at::Tensor& key_slots,
                                      const at::Tensor& knots, const at::Tensor& slope, const at::Tensor& intercept,
                                      const at::Tensor& blocks, int64_t tile_width, double scaling, double c,
                                      bool form_grad, bool c_grad) {
  TORCH_CHECK(query.device().is_cpu(), "fire_backward: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && grad.sizes() == query.sizes() && value.sizes() == key.sizes() &&
                  key.size(0) == query.size(0) && key.size(2) == query.size(2),
              "fire_backward: query, grad [N, q, D + 1], key, value [N, kv, D + 1]");
  for (const auto* t : {&query, &key, &grad, &value}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == query.scalar_type(), "fire_backward: contiguous, one dtype");
  }
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kDouble,
              "fire_backward: float32 or float64");
  const FireInputs f{query_positions, key_positions, normaliser, query_slots, key_slots, knots, slope, intercept};
  check_fire_inputs("fire_backward", f, query.scalar_type(), query.size(1), key.size(1));
  TORCH_CHECK(query.size(0) % slope.size(0) == 0 &&
                  (query_positions.size(0) == 1 || query_positions.size(0) * slope.size(0) == query.size(0)) &&
                  (key_positions.size(0) == 1 || key_positions.size(0) * slope.size(0) == query.size(0)),
              "fire_backward: N = B x H, positions of B rows or 1");
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) == 4 && blocks.scalar_type() == at::kLong && blocks.is_contiguous(),
              "fire_backward: blocks [n, 4] int64");
  const int64_t* b = blocks.data_ptr<int64_t>();
  for (int64_t i = 0; i < blocks.size(0); ++i) {  // every read stays inside the operands
    TORCH_CHECK(b[4 * i] >= 0 && b[4 * i + 1] > 0 && b[4 * i] + b[4 * i + 1] <= query.size(1) && b[4 * i + 2] > 0 &&
                    b[4 * i + 2] <= key.size(1),
                "fire_backward: block ", i, " reaches outside its operands");
  }
  if (query.scalar_type() == at::kDouble)
    return fire_backward_impl<double>(query, key, grad, value, f, blocks, tile_width, scaling, c, form_grad, c_grad);
  return fire_backward_impl<float>(query, key, grad, value, f, blocks, tile_width, scaling, c, form_grad, c_grad);
}

// FIRE's attention forward past its threshold, flash-style (FlashAttention, Dao et al. 2022): per batch row x query
// tile (in balanced_order, a thread each), per key tile, the tile's u and segments once for every head, then per head
// S = bias + scale Q K^T (the bias written first, the product added by the BLAS), the running softmax (tiles.h
// softmax_step) and O += P V; key tiles past the tile's last query slot are skipped (slots rise). Where the torch path
// wrote each block's [B, H, rows, keys] bias to memory and SDPA read it back (1.5x native's forward at 8192 tokens on an
// Intel Xeon), the bias stays in cache. Returns the output [N, q, E] and each row's logsumexp [N, q] (the backward's).
template <typename T>
std::vector<at::Tensor> fire_forward_impl(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                          const FireInputs& f, int64_t tile_rows, int64_t tile_keys, double scaling,
                                          double c) {
  const int64_t count = query.size(0), q = query.size(1), dim = query.size(2), kv = key.size(1);
  const int64_t width_v = value.size(2), heads = f.slope.size(0);
  const int64_t batch = count / heads, kv_heads = key.size(0) / batch, per_group = heads / kv_heads;
  const int64_t width = f.knots.size(0);
  auto output = at::empty({count, q, width_v}, query.options());
  auto log_sum = at::empty({count, q}, query.options());
  const int64_t tiles = (q + tile_rows - 1) / tile_rows;
  const std::vector<int64_t> order = balanced_order(tiles);
  const T *qp = f.query_positions.data_ptr<T>(), *kp = f.key_positions.data_ptr<T>(), *norm = f.normaliser.data_ptr<T>();
  const T *knots = f.knots.data_ptr<T>(), *slope = f.slope.data_ptr<T>(), *intercept = f.intercept.data_ptr<T>();
  const int64_t *query_slots = f.query_slots.data_ptr<int64_t>(), *key_slots = f.key_slots.data_ptr<int64_t>();
  const T *qd = query.data_ptr<T>(), *kd = key.data_ptr<T>(), *vd = value.data_ptr<T>();
  T *od = output.data_ptr<T>(), *ld = log_sum.data_ptr<T>();
  at::parallel_for(0, batch * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> u(tile_rows * tile_keys), s(tile_rows * tile_keys), most(heads * tile_rows), sum(heads * tile_rows);
    std::vector<T> out(heads * tile_rows * width_v);
    std::vector<int32_t> bounds(tile_rows * (width + 2));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / tiles, r0 = order[item % tiles] * tile_rows, nr = std::min(tile_rows, q - r0);
      const int64_t qb = f.query_positions.size(0) == 1 ? 0 : b, kb = f.key_positions.size(0) == 1 ? 0 : b;
      const T *qpos = qp + qb * q, *kpos = kp + kb * kv, *qnorm = norm + qb * q;
      std::fill(most.begin(), most.end(), -std::numeric_limits<T>::infinity());
      std::fill(sum.begin(), sum.end(), T(0));
      std::fill(out.begin(), out.end(), T(0));
      // keys up to the last row's slot (slots rise along the keys)
      const int64_t last_slot = query_slots[r0 + nr - 1];
      const int64_t keys = std::upper_bound(key_slots, key_slots + kv, last_slot) - key_slots;
      for (int64_t k0 = 0; k0 < keys; k0 += tile_keys) {
        const int nk = int(std::min(tile_keys, keys - k0));
        for (int64_t r = 0; r < nr; ++r)
          fire_row_u(u.data() + r * nk, bounds.data() + r * (width + 2), qpos[r0 + r], qnorm[r0 + r], kpos + k0, nk,
                     T(c), knots, width);
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t n = b * heads + h, kvn = b * kv_heads + h / per_group;
          T* p = s.data();
          for (int64_t r = 0; r < nr; ++r)
            fire_row_bias(p + r * nk, u.data() + r * nk, bounds.data() + r * (width + 2), slope + h * (width + 1),
                          intercept + h * (width + 1), width, key_slots + k0, query_slots[r0 + r], nk);
          times_transposed<T>(qd + (n * q + r0) * dim, kd + (kvn * kv + k0) * dim, p, int(nr), nk, int(dim),
                              T(scaling), T(1));
          T* o = out.data() + h * tile_rows * width_v;
          for (int64_t r = 0; r < nr; ++r)
            softmax_step(p + r * nk, nk, most[h * tile_rows + r], sum[h * tile_rows + r], o + r * width_v, width_v);
          times<T>(p, nk, vd + (kvn * kv + k0) * width_v, o, int(nr), nk, int(width_v), T(1));
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t n = b * heads + h;
        T* o = out.data() + h * tile_rows * width_v;
        softmax_finish(o, nr, width_v, most.data() + h * tile_rows, sum.data() + h * tile_rows, ld + n * q + r0);
        std::copy(o, o + nr * width_v, od + (n * q + r0) * width_v);
      }
    }
  });
  return {output, log_sum};
}

std::vector<at::Tensor> fire_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                     const at::Tensor& query_positions, const at::Tensor& key_positions,
                                     const at::Tensor& normaliser, const at::Tensor& query_slots,
                                     const at::Tensor& key_slots, const at::Tensor& knots, const at::Tensor& slope,
                                     const at::Tensor& intercept, int64_t tile_rows, int64_t tile_keys, double scaling,
                                     double c) {
  TORCH_CHECK(query.device().is_cpu(), "fire_forward: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && key.size(2) == query.size(2) &&
                  value.size(0) == key.size(0) && value.size(1) == key.size(1),
              "fire_forward: query [B*H, q, D], key [B*H_kv, kv, D], value [B*H_kv, kv, E]");
  for (const auto* t : {&query, &key, &value}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == query.scalar_type(), "fire_forward: contiguous, one dtype");
  }
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kDouble,
              "fire_forward: float32 or float64");
  const FireInputs f{query_positions, key_positions, normaliser, query_slots, key_slots, knots, slope, intercept};
  check_fire_inputs("fire_forward", f, query.scalar_type(), query.size(1), key.size(1));
  const int64_t heads = slope.size(0);
  TORCH_CHECK(query.size(0) % heads == 0 && key.size(0) % (query.size(0) / heads) == 0 &&
                  heads % (key.size(0) / (query.size(0) / heads)) == 0 &&
                  (query_positions.size(0) == 1 || query_positions.size(0) * heads == query.size(0)) &&
                  (key_positions.size(0) == 1 || key_positions.size(0) * heads == query.size(0)),
              "fire_forward: N = B x H query heads, B x H_kv key heads (H_kv divides H), positions of B rows or 1");
  const int64_t* ks = key_slots.data_ptr<int64_t>();
  for (int64_t k = 1; k < key_slots.size(0); ++k) TORCH_CHECK(ks[k] >= ks[k - 1], "fire_forward: key slots must rise");
  TORCH_CHECK(tile_rows > 0 && tile_keys > 0, "fire_forward: tiles of at least one row and key");
  if (query.scalar_type() == at::kDouble)
    return fire_forward_impl<double>(query, key, value, f, tile_rows, tile_keys, scaling, c);
  return fire_forward_impl<float>(query, key, value, f, tile_rows, tile_keys, scaling, c);
}

// The probability pass alone, on a copy (for tests: what it keeps and drops).
at::Tensor table_probabilities(const at::Tensor& logits) {
  auto out = logits.contiguous().clone();
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble, "float32 or float64");
  if (out.scalar_type() == at::kDouble) probabilities_in_place<double>(out.data_ptr<double>(), 1, out.numel(), nullptr, 0);
  else probabilities_in_place<float>(out.data_ptr<float>(), 1, out.numel(), nullptr, 0);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_posenc_cpu, m) {
  m.def("table_backward(Tensor query, Tensor key, Tensor grad, Tensor value, Tensor padded, Tensor blocks, "
        "int tile_width, float scaling, bool table_grad) -> Tensor[]");
  m.def("table_probabilities(Tensor logits) -> Tensor");
  m.def("fire_backward(Tensor query, Tensor key, Tensor grad, Tensor value, Tensor query_positions, "
        "Tensor key_positions, Tensor normaliser, Tensor query_slots, Tensor key_slots, Tensor knots, Tensor slope, "
        "Tensor intercept, Tensor blocks, int tile_width, float scaling, float c, bool form_grad, bool c_grad) "
        "-> Tensor[]");
  m.def("fire_forward(Tensor query, Tensor key, Tensor value, Tensor query_positions, Tensor key_positions, "
        "Tensor normaliser, Tensor query_slots, Tensor key_slots, Tensor knots, Tensor slope, Tensor intercept, "
        "int tile_rows, int tile_keys, float scaling, float c) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(hf_posenc_cpu, CPU, m) {
  m.impl("table_backward", table_backward);
  m.impl("table_probabilities", table_probabilities);
  m.impl("fire_backward", fire_backward);
  m.impl("fire_forward", fire_forward);
}
