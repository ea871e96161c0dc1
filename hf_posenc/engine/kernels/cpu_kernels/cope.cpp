// Fused CoPE attention for the CPU, forward and backward, on a causal square (query i is key i, no other mask):
// the per-pair gates, positions, logits and probabilities live in small tiles (methods/cope.py has the method and its
// blocked reference, ContextualScores; engine/fused_cpu.py builds this file).
//
// CoPE (Golovneva, Wang, Weston, Sukhbaatar 2024): with z_ij = scaling * q_i . k_j, gates g_ij = sigmoid(z_ij) and
// positions p_ij = min(sum_{k=j..i} g_ik, max_pos), the logits are
//   l_ij = z_ij + I_i[f] + w R_i[f],   f = floor p_ij, w = p_ij - f,   I_i[n] = q_i . e[n], R_i[n] = I_i[n+1] - I_i[n]
// (R_i[max_pos] = 0), and the output the softmax of l over keys j <= i applied to the values.
// Forward, per tile of query rows: key tiles from the diagonal leftwards, each row carrying its running sum of gates
// (double) and, as flash attention, its running maximum and sum of exponentials. Positions only grow leftwards: once
// a row's reaches max_pos, every key further left is clamped (l = z + I[max_pos], no gate needed), so only a window
// of keys next to the diagonal takes the whole chain (about 2 max_pos keys with gates near 1/2; the whole row where
// the gates are small). Saved: each row's logsumexp, its last clamped key b_i and its window's sum of gates
// W_i = sum_{b_i<k<=i} g_ik. Backward, key tiles from the left, so that the reverse cumulative sum's adjoint (a running
// sum from the left) is carried as it is: in the window, positions p_ij = W_i - sum_{b_i<k<j} g_ik (double, so that
// they equal the forward's to far below float32's rounding); P = exp(l - lse), dl = P (dO . v - dO_i . o_i),
// dI[f] += (1 - w) dl, dI[f + 1] += w dl, dp = dl R[f] (0 where clamped), dg_ij = sum_{k<=j} dp_ik,
// dz = dl + dg g (1 - g).

#include "tiles.h"

namespace {

using namespace hf_posenc_cpu;

template <typename T>
struct Cope {
  int64_t length, dim, value_dim, positions;  // positions: max_pos + 1 embeddings
  T scaling, max_pos;
  const T* embeddings;  // [dim, positions]

  // I and R of rows [r0, r0 + nr): [nr, positions] each.
  void integers(const T* q, int64_t r0, int64_t nr, T* integer, T* rise) const {
    times<T>(q + r0 * dim, dim, embeddings, integer, nr, dim, positions, T(0));
    for (int64_t r = 0; r < nr; ++r) {
      const T* in = integer + r * positions;
      T* up = rise + r * positions;
      for (int64_t n = 0; n + 1 < positions; ++n) up[n] = in[n + 1] - in[n];
      up[positions - 1] = 0;
    }
  }

  // gates: sigmoid(z), the exp's argument kept within +-80 (no overflow, no underflow slow path: see tiles.h)
  static void gates(const T* z, T* gate, int n) {
    const T cap = T(-kExpFloor);
#pragma omp simd
    for (int c = 0; c < n; ++c) gate[c] = T(1) / (T(1) + std::exp(std::clamp(-z[c], -cap, cap)));
  }

  // l = z + I[f] + w R[f] from positions p (clamped to max_pos here), in place of z; f and w kept where asked.
  void logits(T* z, const T* position, const T* integer, const T* rise, int n, int32_t* floors = nullptr,
              T* weights = nullptr) const {
    for (int c = 0; c < n; ++c) {
      const T p = std::min(position[c], max_pos);
      const int32_t f = static_cast<int32_t>(p);  // p >= 0
      const T w = p - T(f);
      z[c] += integer[f] + w * rise[f];
      if (floors != nullptr) {
        floors[c] = f;
        weights[c] = w;
      }
    }
  }
};

template <typename T>
std::vector<at::Tensor> forward_impl(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                     const at::Tensor& embeddings, double scaling, double max_pos, int64_t rows,
                                     int64_t keys) {
  const int64_t heads = query.size(0), length = query.size(1), dim = query.size(2), value_dim = value.size(2);
  const int64_t positions = embeddings.size(1);
  Cope<T> cope{length, dim, value_dim, positions, T(scaling), T(max_pos), embeddings.data_ptr<T>()};
  auto output = at::empty({heads, length, value_dim}, value.options());
  auto log_sum = at::empty({heads, length}, value.options());
  auto window = at::empty({heads, length, 2}, value.options().dtype(at::kDouble));
  const int64_t row_tiles = (length + rows - 1) / rows;
  const auto order = balanced_order(row_tiles);
  const T* q_all = query.data_ptr<T>();
  const T* k_all = key.data_ptr<T>();
  const T* v_all = value.data_ptr<T>();
  T* o_all = output.data_ptr<T>();
  T* lse_all = log_sum.data_ptr<T>();
  double* window_all = window.data_ptr<double>();
  at::parallel_for(0, heads * row_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> z(rows * keys), gate(rows * keys), integer(rows * positions), rise(rows * positions), most(rows),
        sum(rows);
    std::vector<double> carry(rows);
    std::vector<int64_t> clamped(rows);  // each row's last key whose position is clamped (-1: none so far)
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / row_tiles, r0 = order[item % row_tiles] * rows;
      const int64_t r1 = std::min(r0 + rows, length), nr = r1 - r0;
      const T* q = q_all + h * length * dim;
      const T* k = k_all + h * length * dim;
      const T* v = v_all + h * length * value_dim;
      T* o = o_all + h * length * value_dim + r0 * value_dim;
      cope.integers(q, r0, nr, integer.data(), rise.data());
      std::fill(most.begin(), most.end(), T(-1e30));
      std::fill(sum.begin(), sum.end(), T(0));
      std::fill(carry.begin(), carry.end(), 0.0);
      std::fill(clamped.begin(), clamped.end(), int64_t(-1));
      std::fill(o, o + nr * value_dim, T(0));
      for (int64_t c1 = r1; c1 > 0; c1 -= keys) {
        const int64_t c0 = std::max<int64_t>(0, c1 - keys), nk = c1 - c0;
        times_transposed<T>(q + r0 * dim, k + c0 * dim, z.data(), nr, nk, dim, cope.scaling, T(0));
        for (int64_t r = 0; r < nr; ++r) {
          const int n = causal_keys(r0 + r, c0, nk);
          T* zr = z.data() + r * nk;
          T* g = gate.data() + r * nk;
          if (n > 0) {
            const T* in = integer.data() + r * positions;
            if (clamped[r] >= 0) {  // every key of the tile is clamped: l = z + I[max_pos]
              const T last = in[positions - 1];
#pragma omp simd
              for (int c = 0; c < n; ++c) zr[c] += last;
            } else {
              Cope<T>::gates(zr, g, n);
              double run = carry[r];
              for (int c = n - 1; c >= 0; --c) {  // the gates' suffix sum: key c's position
                const double before = run;
                run += g[c];
                g[c] = T(run);
                if (run >= double(cope.max_pos)) {  // positions only grow leftwards: the rest are clamped too
                  clamped[r] = c0 + c;
                  run = before;  // the window's sum: the gates of the keys right of the clamped ones
                  std::fill(g, g + c, cope.max_pos);
                  break;
                }
              }
              carry[r] = run;
              cope.logits(zr, g, in, rise.data() + r * positions, n);
            }
            softmax_step(zr, n, most[r], sum[r], o + r * value_dim, value_dim);
          }
          std::fill(zr + n, zr + nk, T(0));
        }
        times<T>(z.data(), nk, v + c0 * value_dim, o, nr, nk, value_dim, T(1));
      }
      softmax_finish(o, nr, value_dim, most.data(), sum.data(), lse_all + h * length + r0);
      for (int64_t r = 0; r < nr; ++r) {
        window_all[(h * length + r0 + r) * 2] = carry[r];
        window_all[(h * length + r0 + r) * 2 + 1] = double(clamped[r]);
      }
    }
  });
  return {output, log_sum, window};
}

template <typename T>
std::vector<at::Tensor> backward_impl(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                      const at::Tensor& embeddings, const at::Tensor& output,
                                      const at::Tensor& log_sum, const at::Tensor& window,
                                      const at::Tensor& grad_output, double scaling, double max_pos, int64_t rows,
                                      int64_t keys) {
  const int64_t heads = query.size(0), length = query.size(1), dim = query.size(2), value_dim = value.size(2);
  const int64_t positions = embeddings.size(1);
  Cope<T> cope{length, dim, value_dim, positions, T(scaling), T(max_pos), embeddings.data_ptr<T>()};
  const int64_t row_tiles = (length + rows - 1) / rows;
  const auto order = balanced_order(row_tiles);
  const int64_t parts = runs_per_head(heads, row_tiles);
  auto grad_query = at::zeros_like(query);
  auto grad_key = at::zeros({parts, heads, length, dim}, query.options());
  auto grad_value = at::zeros({parts, heads, length, value_dim}, query.options());
  auto grad_embeddings = at::zeros({parts * heads, dim, positions}, query.options());
  const T* q_all = query.data_ptr<T>();
  const T* k_all = key.data_ptr<T>();
  const T* v_all = value.data_ptr<T>();
  const T* o_all = output.data_ptr<T>();
  const T* lse_all = log_sum.data_ptr<T>();
  const double* window_all = window.data_ptr<double>();
  const T* do_all = grad_output.data_ptr<T>();
  T* dq_all = grad_query.data_ptr<T>();
  T* dk_all = grad_key.data_ptr<T>();
  T* dv_all = grad_value.data_ptr<T>();
  T* de_all = grad_embeddings.data_ptr<T>();
  at::parallel_for(0, heads * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> prob(rows * keys), gate(rows * keys), grad(rows * keys), weight(rows * keys),
        integer(rows * positions), rise(rows * positions), grad_integer(rows * positions), delta(rows),
        carry_grad(rows);
    std::vector<int32_t> floors(rows * keys);
    std::vector<double> carry(rows);
    const T floor = T(kExpFloor);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / parts, part = item % parts;
      const T* q = q_all + h * length * dim;
      const T* k = k_all + h * length * dim;
      const T* v = v_all + h * length * value_dim;
      T* dq = dq_all + h * length * dim;
      T* dk = dk_all + (part * heads + h) * length * dim;
      T* dv = dv_all + (part * heads + h) * length * value_dim;
      T* de = de_all + (part * heads + h) * dim * positions;
      for (int64_t t = row_tiles * part / parts; t < row_tiles * (part + 1) / parts; ++t) {
        const int64_t r0 = order[t] * rows, r1 = std::min(r0 + rows, length), nr = r1 - r0;
        const T* go = do_all + h * length * value_dim + r0 * value_dim;
        cope.integers(q, r0, nr, integer.data(), rise.data());
        std::fill(grad_integer.begin(), grad_integer.end(), T(0));
        row_dots(go, o_all + h * length * value_dim + r0 * value_dim, nr, value_dim, delta.data());
        std::fill(carry.begin(), carry.end(), 0.0);
        std::fill(carry_grad.begin(), carry_grad.end(), T(0));
        for (int64_t c0 = 0; c0 < r1; c0 += keys) {
          const int64_t c1 = std::min(c0 + keys, r1), nk = c1 - c0;
          times_transposed<T>(q + r0 * dim, k + c0 * dim, prob.data(), nr, nk, dim, cope.scaling, T(0));
          for (int64_t r = 0; r < nr; ++r) {
            const int64_t i = r0 + r;
            const int n = causal_keys(i, c0, nk);
            // keys [0, m) of the tile are clamped (l = z + I[max_pos]); the window's [m, n) take the whole chain
            const int m = std::clamp<int64_t>(int64_t(window_all[2 * (h * length + i) + 1]) + 1 - c0, 0, n);
            const T* in = integer.data() + r * positions;
            const T lse = lse_all[h * length + i], last = in[positions - 1];
            T* p = prob.data() + r * nk;
#pragma omp simd
            for (int c = 0; c < m; ++c) p[c] = std::exp(std::max(p[c] + last - lse, floor));
            if (n > m) {
              T* pw = p + m;
              T* g = gate.data() + r * nk + m;
              T* position = grad.data() + r * nk + m;  // the positions, until dP overwrites them below
              Cope<T>::gates(pw, g, n - m);
              const double whole = window_all[2 * (h * length + i)];
              double before = carry[r];
              for (int c = 0; c < n - m; ++c) {  // key c's position: the gates from c to the row's own key
                position[c] = T(whole - before);
                before += g[c];
              }
              carry[r] = before;
              cope.logits(pw, position, in, rise.data() + r * positions, n - m, floors.data() + r * nk + m,
                          weight.data() + r * nk + m);
              probabilities(pw, n - m, lse);
            }
            std::fill(p + n, p + nk, T(0));
          }
          times_transposed<T>(go, v + c0 * value_dim, grad.data(), nr, nk, value_dim, T(1), T(0));  // dO . v
          transposed_times<T>(prob.data(), nk, go, dv + c0 * value_dim, nr, nk, value_dim);  // dV += P^T dO
          for (int64_t r = 0; r < nr; ++r) {
            const int64_t i = r0 + r;
            const int n = causal_keys(i, c0, nk);
            const int m = std::clamp<int64_t>(int64_t(window_all[2 * (h * length + i) + 1]) + 1 - c0, 0, n);
            const T* p = prob.data() + r * nk;
            T* dl = grad.data() + r * nk;
            T* di = grad_integer.data() + r * positions;
            const T centre = delta[r], scale = cope.scaling;
            T to_last = 0;  // the clamped keys' share of dI[max_pos]; their dp is 0 (R[max_pos] = 0), so is their dg
#pragma omp simd reduction(+ : to_last)
            for (int c = 0; c < m; ++c) {
              dl[c] = p[c] * (dl[c] - centre);
              to_last += dl[c];
              dl[c] *= scale;
            }
            di[positions - 1] += to_last;
            const T* g = gate.data() + r * nk;
            T* w = weight.data() + r * nk;
            const int32_t* f = floors.data() + r * nk;
            const T* up = rise.data() + r * positions;
#pragma omp simd
            for (int c = m; c < n; ++c) dl[c] = p[c] * (dl[c] - centre);
            for (int c = m; c < n; ++c) {  // the interpolation's adjoint; then w holds dp = dl R[f]
              const T share = dl[c] * w[c];
              di[f[c]] += dl[c] - share;
              if (f[c] + 1 < positions) di[f[c] + 1] += share;
              w[c] = dl[c] * up[f[c]];
            }
            T run = carry_grad[r];
            for (int c = m; c < n; ++c) {  // dg_ij = sum_{k<=j} dp_ik (0 over the clamped keys)
              run += w[c];
              w[c] = run;
            }
            carry_grad[r] = run;
#pragma omp simd
            for (int c = m; c < n; ++c) dl[c] = scale * (dl[c] + w[c] * g[c] * (T(1) - g[c]));
            std::fill(dl + n, dl + nk, T(0));
          }
          times<T>(grad.data(), nk, k + c0 * dim, dq + r0 * dim, nr, nk, dim, T(1));  // dQ += dZ K
          transposed_times<T>(grad.data(), nk, q + r0 * dim, dk + c0 * dim, nr, nk, dim);  // dK += dZ^T Q
        }
        // dQ += dI E^T, dE += Q^T dI
        times_transposed<T>(grad_integer.data(), cope.embeddings, dq + r0 * dim, nr, dim, positions, T(1), T(1));
        transposed_times<T>(q + r0 * dim, dim, grad_integer.data(), de, nr, dim, positions);
      }
    }
  });
  return {grad_query, grad_key.sum(0), grad_value.sum(0), grad_embeddings.sum(0)};
}

void check_embeddings(const at::Tensor& query, const at::Tensor& embeddings) {
  TORCH_CHECK(embeddings.dim() == 2 && embeddings.size(0) == query.size(2) && embeddings.is_contiguous() &&
                  embeddings.scalar_type() == query.scalar_type(),
              "cope: embeddings [D, max_pos + 1], contiguous, the queries' dtype");
}

std::vector<at::Tensor> cope_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                     const at::Tensor& embeddings, double scaling, double max_pos, int64_t rows,
                                     int64_t keys) {
  check_square("cope_forward", query, key, value);
  check_embeddings(query, embeddings);
  if (query.scalar_type() == at::kDouble)
    return forward_impl<double>(query, key, value, embeddings, scaling, max_pos, rows, keys);
  return forward_impl<float>(query, key, value, embeddings, scaling, max_pos, rows, keys);
}

std::vector<at::Tensor> cope_backward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                      const at::Tensor& embeddings, const at::Tensor& output,
                                      const at::Tensor& log_sum, const at::Tensor& window,
                                      const at::Tensor& grad_output, double scaling, double max_pos, int64_t rows,
                                      int64_t keys) {
  check_square("cope_backward", query, key, value);
  check_embeddings(query, embeddings);
  TORCH_CHECK(output.is_contiguous() && grad_output.is_contiguous() && log_sum.is_contiguous() &&
                  window.is_contiguous() && window.scalar_type() == at::kDouble,
              "cope_backward: contiguous saved tensors, the windows in float64");
  if (query.scalar_type() == at::kDouble)
    return backward_impl<double>(query, key, value, embeddings, output, log_sum, window, grad_output, scaling,
                                 max_pos, rows, keys);
  return backward_impl<float>(query, key, value, embeddings, output, log_sum, window, grad_output, scaling,
                              max_pos, rows, keys);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_posenc_cpu, m) {
  m.def("cope_forward(Tensor query, Tensor key, Tensor value, Tensor embeddings, float scaling, float max_pos, "
        "int rows, int keys) -> Tensor[]");
  m.def("cope_backward(Tensor query, Tensor key, Tensor value, Tensor embeddings, Tensor output, Tensor log_sum, "
        "Tensor window, Tensor grad_output, float scaling, float max_pos, int rows, int keys) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(hf_posenc_cpu, CPU, m) {
  m.impl("cope_forward", cope_forward);
  m.impl("cope_backward", cope_backward);
}
