// Fused stick-breaking attention for the CPU, forward and backward, on a causal square (query i is key i, no other
// mask): the per-pair logits, weights and gradients live in small tiles and are never written out for the whole
// block (methods/stick_breaking.py has the method and its blocked reference; engine/fused_cpu.py builds this file).
//
// Stick-breaking (Tan et al., ICLR 2025): with z_ij = scaling * q_i . k_j, beta = sigmoid(z), the keys j that break
// the stick for query i being j < i (j <= i with attend_current),
//   L_ij = log beta_ij + sum_{j<k, k breaks} log(1 - beta_ik),   A_ij = exp(max(L_ij, -80)),
//   R_i  = exp(sum_{k breaks} log(1 - beta_ik)),                  o_i = sum_j A_ij v_j + R_i v_i.
// Forward, per tile of query rows: key tiles from the diagonal leftwards, each row carrying its running sum of
// log(1 - beta) over the keys already seen (to its right), as flash attention carries its running maximum.
// Backward, the same order: with dL = (dO . v) A, dR_i = (dO_i . v_i) R_i and
// T_i = sum_j dL_ij = dO_i . (o_i - R_i v_i),   dz_ij = dL_ij - sigmoid(z_ij) (T_i + dR_i - sum_{k>j} dL_ik),
// the suffix sum carried like the forward's. Tile products go to the BLAS that torch links (tiles.h).

#include "tiles.h"

namespace {

using namespace hf_posenc_cpu;

constexpr double kLogWeightFloor = kExpFloor;

// log(beta) and log(1 - beta) of z, exact for any z: with t = log(1 + exp(-|z|)), min(z, 0) - t and -max(z, 0) - t.
template <typename T>
inline void log_betas(const T* z, T* log_beta, T* log_rest, int n) {
  const T cap = T(-kLogWeightFloor);
#pragma omp simd
  for (int c = 0; c < n; ++c) {
    const T x = z[c];
    const T t = std::log1p(std::exp(-std::min(std::abs(x), cap)));
    log_beta[c] = std::min(x, T(0)) - t;
    log_rest[c] = -std::max(x, T(0)) - t;
  }
}

template <typename T>
struct Tiles {
  int64_t heads, length, dim, value_dim, rows, keys;
  T scaling;
  int64_t current;  // 1 where the query's own key breaks the stick (attend_current)

  // The exclusive end of row r's breaking keys.
  int64_t key_end(int64_t r) const { return r + current; }

  // One key tile for the rows [r0, r1): fills log_beta (then the weights A) and log_rest, carries `carry` (the
  // running sum of log(1 - beta) of the keys right of the tile) to the tile's left edge. Entries of keys that do
  // not break for a row are 0.
  void weights(const T* q, const T* k, int64_t r0, int64_t r1, int64_t c0, int64_t c1, T* log_beta, T* log_rest,
               T* carry, T* sigmoid = nullptr) const {
    const int nr = r1 - r0, nk = c1 - c0;
    times_transposed<T>(q + r0 * dim, k + c0 * dim, log_beta, nr, nk, dim, scaling, T(0));
    for (int r = 0; r < nr; ++r) {
      T* lb = log_beta + r * nk;
      T* lr = log_rest + r * nk;
      const int end = std::clamp<int64_t>(key_end(r0 + r) - c0, 0, nk);
      log_betas(lb, lb, lr, end);
      T run = carry[r];
      for (int c = end - 1; c >= 0; --c) {  // the suffix sum: sequential per row
        const T rest = lr[c];
        lr[c] = run;  // from here on: the sum of log(1 - beta) right of key c
        run += rest;
      }
      carry[r] = run;
      if (sigmoid != nullptr) {
        T* s = sigmoid + r * nk;
#pragma omp simd
        for (int c = 0; c < end; ++c) s[c] = std::exp(lb[c]);
      }
      // Floored as the blocked path floors them (methods/stick_breaking.py): an exp whose result would underflow
      // float32 takes a path many times slower, and most of a long row's keys are that far down the stick.
      const T floor = T(kLogWeightFloor);
#pragma omp simd
      for (int c = 0; c < end; ++c) lb[c] = std::exp(std::max(lb[c] + lr[c], floor));
      std::fill(lb + end, lb + nk, T(0));
    }
  }
};

template <typename T>
std::vector<at::Tensor> forward_impl(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                     double scaling, bool attend_current, int64_t rows, int64_t keys) {
  const int64_t heads = query.size(0), length = query.size(1), dim = query.size(2), value_dim = value.size(2);
  auto output = at::empty({heads, length, value_dim}, value.options());
  auto log_remainder = at::empty({heads, length}, value.options());
  Tiles<T> tiles{heads, length, dim, value_dim, rows, keys, T(scaling), attend_current ? 1 : 0};
  const int64_t row_tiles = (length + rows - 1) / rows;
  const auto order = balanced_order(row_tiles);
  const T* q_all = query.data_ptr<T>();
  const T* k_all = key.data_ptr<T>();
  const T* v_all = value.data_ptr<T>();
  T* o_all = output.data_ptr<T>();
  T* lr_all = log_remainder.data_ptr<T>();
  at::parallel_for(0, heads * row_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> log_beta(rows * keys), log_rest(rows * keys), carry(rows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / row_tiles, r0 = order[item % row_tiles] * rows;
      const int64_t r1 = std::min(r0 + rows, length), nr = r1 - r0;
      const T* q = q_all + h * length * dim;
      const T* k = k_all + h * length * dim;
      const T* v = v_all + h * length * value_dim;
      T* o = o_all + h * length * value_dim + r0 * value_dim;
      std::fill(carry.begin(), carry.end(), T(0));
      std::fill(o, o + nr * value_dim, T(0));
      for (int64_t c1 = tiles.key_end(r1 - 1); c1 > 0; c1 -= keys) {
        const int64_t c0 = std::max<int64_t>(0, c1 - keys), nk = c1 - c0;
        tiles.weights(q, k, r0, r1, c0, c1, log_beta.data(), log_rest.data(), carry.data());
        times<T>(log_beta.data(), nk, v + c0 * value_dim, o, nr, nk, value_dim, T(1));
      }
      for (int64_t r = 0; r < nr; ++r) {
        const T remainder = std::exp(carry[r]);
        const T* own = v + (r0 + r) * value_dim;
        T* out = o + r * value_dim;
        for (int64_t d = 0; d < value_dim; ++d) out[d] += remainder * own[d];
        lr_all[h * length + r0 + r] = carry[r];
      }
    }
  });
  return {output, log_remainder};
}

template <typename T>
std::vector<at::Tensor> backward_impl(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                      const at::Tensor& output, const at::Tensor& log_remainder,
                                      const at::Tensor& grad_output, double scaling, bool attend_current,
                                      int64_t rows, int64_t keys) {
  const int64_t heads = query.size(0), length = query.size(1), dim = query.size(2), value_dim = value.size(2);
  Tiles<T> tiles{heads, length, dim, value_dim, rows, keys, T(scaling), attend_current ? 1 : 0};
  const int64_t row_tiles = (length + rows - 1) / rows;
  const auto order = balanced_order(row_tiles);
  const int64_t parts = runs_per_head(heads, row_tiles);
  auto grad_query = at::zeros_like(query);
  auto grad_key = at::zeros({parts, heads, length, dim}, query.options());
  auto grad_value = at::zeros({parts, heads, length, value_dim}, query.options());
  const T* q_all = query.data_ptr<T>();
  const T* k_all = key.data_ptr<T>();
  const T* v_all = value.data_ptr<T>();
  const T* o_all = output.data_ptr<T>();
  const T* lr_all = log_remainder.data_ptr<T>();
  const T* do_all = grad_output.data_ptr<T>();
  T* dq_all = grad_query.data_ptr<T>();
  T* dk_all = grad_key.data_ptr<T>();
  T* dv_all = grad_value.data_ptr<T>();
  at::parallel_for(0, heads * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> log_beta(rows * keys), log_rest(rows * keys), carry(rows), grad(rows * keys), sigmoids(rows * keys);
    // sum_{k<=j} dL_ik as T_i less the running suffix sum of dL cancels to about nothing far left of the diagonal,
    // where the rounding of T_i (a constant per row) would add up over thousands of keys in dQ: the difference is
    // clamped to its bound |sum_{k<=j} dL_ik| <= max_k |dO_i . v_k| sum_{k<=j} A_ik <= |dO_i| max_k |v_k| exp(S_ij),
    // S_ij the log of the stick left right of key j (float32 at 4096 tokens: dQ within 1e-4 of float64 without it,
    // 1.8e-6 with it; the blocked path, which sums from the left, 2e-7).
    std::vector<T> carry_grad(rows), total(rows), to_own(rows), bound(rows);
    const T floor = T(kLogWeightFloor), floored = T(length) * T(std::exp(kLogWeightFloor));  // the weights' floors
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / parts, part = item % parts;
      const T* q = q_all + h * length * dim;
      const T* k = k_all + h * length * dim;
      const T* v = v_all + h * length * value_dim;
      T longest = 0;  // max_k |v_k|
      for (int64_t j = 0; j < length; ++j) {
        T norm = 0;
        for (int64_t d = 0; d < value_dim; ++d) norm += v[j * value_dim + d] * v[j * value_dim + d];
        longest = std::max(longest, norm);
      }
      longest = std::sqrt(longest);
      T* dq = dq_all + h * length * dim;
      T* dk = dk_all + (part * heads + h) * length * dim;
      T* dv = dv_all + (part * heads + h) * length * value_dim;
      for (int64_t t = row_tiles * part / parts; t < row_tiles * (part + 1) / parts; ++t) {
        const int64_t r0 = order[t] * rows, r1 = std::min(r0 + rows, length), nr = r1 - r0;
        const T* go = do_all + h * length * value_dim + r0 * value_dim;
        for (int64_t r = 0; r < nr; ++r) {  // T_i + dR_i, and the own key's share of the value gradient
          const int64_t i = r0 + r;
          const T remainder = std::exp(lr_all[h * length + i]);
          const T* o = o_all + h * length * value_dim + i * value_dim;
          const T* own = v + i * value_dim;
          const T* g = go + r * value_dim;
          double through = 0, on_own = 0, norm = 0;
          for (int64_t d = 0; d < value_dim; ++d) {
            through += g[d] * (o[d] - remainder * own[d]);
            on_own += g[d] * own[d];
            norm += g[d] * g[d];
            dv[i * value_dim + d] += remainder * g[d];
          }
          total[r] = T(through);
          to_own[r] = T(on_own * remainder);
          bound[r] = T(std::sqrt(norm)) * longest;
          carry[r] = 0;
          carry_grad[r] = 0;
        }
        for (int64_t c1 = tiles.key_end(r1 - 1); c1 > 0; c1 -= keys) {
          const int64_t c0 = std::max<int64_t>(0, c1 - keys), nk = c1 - c0;
          tiles.weights(q, k, r0, r1, c0, c1, log_beta.data(), log_rest.data(), carry.data(), sigmoids.data());
          times_transposed<T>(go, v + c0 * value_dim, grad.data(), nr, nk, value_dim, T(1), T(0));  // dO . v
          transposed_times<T>(log_beta.data(), nk, go, dv + c0 * value_dim, nr, nk, value_dim);  // dV += A^T dO
          for (int64_t r = 0; r < nr; ++r) {
            const int end = std::clamp<int64_t>(tiles.key_end(r0 + r) - c0, 0, nk);
            T* a = log_beta.data() + r * nk;
            T* g = grad.data() + r * nk;
            const T* s = sigmoids.data() + r * nk;
#pragma omp simd
            for (int c = 0; c < end; ++c) g[c] *= a[c];  // dL
            T run = carry_grad[r];
            for (int c = end - 1; c >= 0; --c) {  // a[c] becomes sum_{k>c} dL
              const T dl = g[c];
              a[c] = run;
              run += dl;
            }
            carry_grad[r] = run;
            // sum_{k<=c} dL + dR = T - sum_{k>c} dL + dR, the difference within its bound
            const T* log_left = log_rest.data() + r * nk;  // S_ij (its exp floored: see weights())
            const T most = bound[r], whole = total[r], own_share = to_own[r], scale = tiles.scaling;
#pragma omp simd
            for (int c = 0; c < end; ++c) {
              const T limit = most * (std::exp(std::max(log_left[c], floor)) + floored);
              g[c] = scale * (g[c] - s[c] * (std::clamp(whole - a[c], -limit, limit) + own_share));
            }
            std::fill(g + end, g + nk, T(0));
          }
          times<T>(grad.data(), nk, k + c0 * dim, dq + r0 * dim, nr, nk, dim, T(1));  // dQ += dZ K
          transposed_times<T>(grad.data(), nk, q + r0 * dim, dk + c0 * dim, nr, nk, dim);  // dK += dZ^T Q
        }
      }
    }
  });
  return {grad_query, parts > 1 ? grad_key.sum(0) : grad_key.squeeze(0),
          parts > 1 ? grad_value.sum(0) : grad_value.squeeze(0)};
}

std::vector<at::Tensor> stick_breaking_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                               double scaling, bool attend_current, int64_t rows, int64_t keys) {
  check_square("stick_breaking_forward", query, key, value);
  if (query.scalar_type() == at::kDouble)
    return forward_impl<double>(query, key, value, scaling, attend_current, rows, keys);
  return forward_impl<float>(query, key, value, scaling, attend_current, rows, keys);
}

std::vector<at::Tensor> stick_breaking_backward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                                const at::Tensor& output, const at::Tensor& log_remainder,
                                                const at::Tensor& grad_output, double scaling, bool attend_current,
                                                int64_t rows, int64_t keys) {
  check_square("stick_breaking_backward", query, key, value);
  TORCH_CHECK(output.is_contiguous() && grad_output.is_contiguous() && log_remainder.is_contiguous(),
              "stick_breaking_backward: contiguous");
  if (query.scalar_type() == at::kDouble)
    return backward_impl<double>(query, key, value, output, log_remainder, grad_output, scaling, attend_current,
                                 rows, keys);
  return backward_impl<float>(query, key, value, output, log_remainder, grad_output, scaling, attend_current, rows,
                              keys);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_posenc_cpu, m) {
  m.def("stick_breaking_forward(Tensor query, Tensor key, Tensor value, float scaling, bool attend_current, "
        "int rows, int keys) -> Tensor[]");
  m.def("stick_breaking_backward(Tensor query, Tensor key, Tensor value, Tensor output, Tensor log_remainder, "
        "Tensor grad_output, float scaling, bool attend_current, int rows, int keys) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(hf_posenc_cpu, CPU, m) {
  m.impl("stick_breaking_forward", stick_breaking_forward);
  m.impl("stick_breaking_backward", stick_breaking_backward);
}
