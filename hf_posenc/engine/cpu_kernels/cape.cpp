// Fused CAPE attention for the CPU, forward and backward, on a causal square (query i is key i, no other mask) whose
// bias depends on the distance i - j alone (methods/cape.py has the method and its blocked reference, content_scores).
//
// CAPE (Zheng et al., NeurIPS 2024): with z_ij^h = scaling * q_i^h . k_j^h and the bias B_ij^h = table[h, i - j], an
// MLP across the heads corrects each pair's logits:
//   x_ij = [z_ij^1..H, B_ij^1..H],  a_ij = W1 x_ij + b1,  c_ij = W2 gelu(a_ij) + b2,
//   l_ij^h = z_ij^h + c_ij^h (+ B_ij^h where the bias is added: base="none"),
// and each head's output the causal softmax of its l applied to its values. The MLP mixes heads, so a tile holds every
// head of one batch row: per tile of query rows and key tile, the pairs' features are laid out feature-major ([2H, P],
// P = rows x keys pairs) and the MLP is two BLAS products over all P pairs at once; the softmax is flash attention's
// per head (a running maximum and sum per row; the backward recomputes each tile from the logsumexp).
// The bias half of W1 sees the bias alone, which depends on the distance alone: its part of a_ij, with b1, is a
// column of E = W1[:, H:] table + b1 [W, L] (once per call), so the per-pair product is W1[:, :H] z_ij only.
// Backward: dl = P (dO . v - dO_i . o_i) per head; dc = dl, dW2 += dc gelu(a)^T, da = (W2^T dc) gelu'(a),
// dW1[:, :H] += da z^T, dz = dl + W1[:, :H]^T da, and da summed along each diagonal into dE [W, L]; at the end
// dW1[:, H:] = dE table^T, db1 = dE 1, and (where `table_grad`: a trainable bias; else it stays zero) the table's
// gradient W1[:, H:]^T dE plus dl's diagonal sums where the bias is added; dq = scaling dz k, dk = scaling dz^T q.

#include "tiles.h"

namespace {

using namespace hf_posenc_cpu;

// ALiBi's bias at far distances (-1000 and less) reaches the MLP. With exp's argument floored after squaring, GELU's
// derivative took 4-6x longer at such inputs than at small ones (glibc's vector exp ended in its scalar path; measured,
// the cause inside the build not traced); with x clamped before squaring it takes the same time at any input. So
// erf's argument is kept within +-kErfCap, where erf is +-1 to float64's precision, and the density's x within
// +-kDensityCap, past which x phi(x) (under 1e-29) is nothing beside Phi(x).
constexpr double kErfCap = 8.0;
constexpr double kDensityCap = 12.0;

template <typename T>
inline T normal_cdf(T x) {
  return T(0.5) * (T(1) + std::erf(std::clamp(x * T(M_SQRT1_2), T(-kErfCap), T(kErfCap))));
}

template <typename T>
inline T gelu(T x) {
  return x * normal_cdf(x);
}

template <typename T>
inline T gelu_slope(T x) {  // d gelu / dx = Phi(x) + x phi(x)
  const T near = std::clamp(x, T(-kDensityCap), T(kDensityCap));
  return normal_cdf(x) + x * T(0.5 * M_2_SQRTPI * M_SQRT1_2) * std::exp(T(-0.5) * near * near);
}

// d gelu(a) / da for n values in place.
template <typename T>
void gelu_slopes(T* a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) a[i] = gelu_slope(a[i]);
}

// A tile's [nr, nk] pairs, each the value of `by_distance` (a row over distances 0..L-1) at its distance i - j
// (masked pairs, j > i, at distance 0).
template <typename T>
void spread_by_distance(const T* by_distance, int64_t r0, int64_t c0, int nr, int nk, T* out) {
  for (int r = 0; r < nr; ++r) {
    const int64_t top = r0 + r - c0;  // key c0's distance
    const int count = std::clamp<int64_t>(top + 1, 0, nk);
    T* row = out + r * nk;
    for (int c = 0; c < count; ++c) row[c] = by_distance[top - c];
    std::fill(row + count, row + nk, by_distance[0]);
  }
}

// The causal pairs of a tile summed along its diagonals into `by_distance` (the transpose of spread_by_distance).
template <typename T>
void sum_by_distance(const T* pairs, int64_t r0, int64_t c0, int nr, int nk, T* by_distance) {
  for (int r = 0; r < nr; ++r) {
    const int64_t top = r0 + r - c0;
    const int count = std::clamp<int64_t>(top + 1, 0, nk);
    const T* row = pairs + r * nk;
    T* at_distance = by_distance + top;
    for (int c = 0; c < count; ++c) at_distance[-c] += row[c];
  }
}

template <typename T>
struct Cape {
  int64_t heads, length, dim, value_dim, width;
  T scaling;
  bool add_bias;
  // query, key: one batch row's [H, L, D]; table [H, L]; by_distance: E = W1[:, H:] table + b1 [W, L]
  const T *query, *key, *table, *by_distance, *w1, *w2, *b2;

  // The tile's pairs (rows [r0, r1) x keys [c0, c1), feature-major, P = nr * nk): logits z [H, P], the MLP's
  // pre-activation a [W, P] and hidden gelu(a) [W, P], logits l [H, P] (masked pairs j > i hold junk).
  void pairs(int64_t r0, int64_t r1, int64_t c0, int64_t c1, T* z, T* a, T* hidden, T* logits) const {
    const int nr = r1 - r0, nk = c1 - c0, p = nr * nk;
    for (int64_t h = 0; h < heads; ++h)
      times_transposed<T>(query + (h * length + r0) * dim, key + (h * length + c0) * dim, z + h * p, nr, nk, dim,
                          scaling, T(0));
    for (int64_t w = 0; w < width; ++w) spread_by_distance(by_distance + w * length, r0, c0, nr, nk, a + w * p);
    times<T>(w1, 2 * heads, z, a, width, heads, p, T(1));
#pragma omp simd
    for (int64_t i = 0; i < width * p; ++i) hidden[i] = gelu(a[i]);
    for (int64_t h = 0; h < heads; ++h) {
      T* l = logits + h * p;
      const T* zh = z + h * p;
      if (add_bias) spread_by_distance(table + h * length, r0, c0, nr, nk, l);
      const T offset = b2[h];
      if (add_bias) {
#pragma omp simd
        for (int i = 0; i < p; ++i) l[i] += zh[i] + offset;
      } else {
#pragma omp simd
        for (int i = 0; i < p; ++i) l[i] = zh[i] + offset;
      }
    }
    times<T>(w2, width, hidden, logits, heads, width, p, T(1));
  }
};

struct Sizes {
  int64_t batch, heads, length, dim, value_dim, width;
};

template <typename T>
Cape<T> layer_of(const Sizes& n, const at::Tensor& query, const at::Tensor& key, const at::Tensor& table,
                 const at::Tensor& by_distance, const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& b2,
                 int64_t b, double scaling, bool add_bias) {
  const int64_t offset = b * n.heads * n.length * n.dim;
  return Cape<T>{n.heads, n.length, n.dim, n.value_dim, n.width, T(scaling), add_bias,
                 query.data_ptr<T>() + offset, key.data_ptr<T>() + offset, table.data_ptr<T>(),
                 by_distance.data_ptr<T>(), w1.data_ptr<T>(), w2.data_ptr<T>(), b2.data_ptr<T>()};
}

// E = W1[:, H:] table + b1 [W, L]: the bias half of the MLP's first layer, per distance.
at::Tensor by_distance_of(const at::Tensor& table, const at::Tensor& w1, const at::Tensor& b1) {
  return at::addmm(b1.unsqueeze(1), w1.narrow(1, table.size(0), table.size(0)), table).contiguous();
}

Sizes sizes_of(const at::Tensor& query, const at::Tensor& value, const at::Tensor& w1) {
  return Sizes{query.size(0), query.size(1), query.size(2), query.size(3), value.size(3), w1.size(0)};
}

template <typename T>
std::vector<at::Tensor> forward_impl(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                     const at::Tensor& table, const at::Tensor& w1, const at::Tensor& b1,
                                     const at::Tensor& w2, const at::Tensor& b2, double scaling, bool add_bias,
                                     int64_t rows, int64_t keys) {
  const Sizes n = sizes_of(query, value, w1);
  const at::Tensor by_distance = by_distance_of(table, w1, b1);
  auto output = at::empty({n.batch, n.heads, n.length, n.value_dim}, value.options());
  auto log_sum = at::empty({n.batch, n.heads, n.length}, value.options());
  const int64_t row_tiles = (n.length + rows - 1) / rows;
  const auto order = balanced_order(row_tiles);
  at::parallel_for(0, n.batch * row_tiles, 1, [&](int64_t begin, int64_t end) {
    const int64_t p = rows * keys;
    std::vector<T> z(n.heads * p), a(n.width * p), hidden(n.width * p), logits(n.heads * p);
    std::vector<T> most(n.heads * rows), sum(n.heads * rows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / row_tiles, r0 = order[item % row_tiles] * rows;
      const int64_t r1 = std::min(r0 + rows, n.length), nr = r1 - r0;
      const Cape<T> cape = layer_of<T>(n, query, key, table, by_distance, w1, w2, b2, b, scaling, add_bias);
      std::fill(most.begin(), most.end(), T(-1e30));
      std::fill(sum.begin(), sum.end(), T(0));
      for (int64_t h = 0; h < n.heads; ++h) {
        T* o = output.data_ptr<T>() + ((b * n.heads + h) * n.length + r0) * n.value_dim;
        std::fill(o, o + nr * n.value_dim, T(0));
      }
      for (int64_t c0 = 0; c0 < r1; c0 += keys) {
        const int64_t c1 = std::min(c0 + keys, r1), nk = c1 - c0, tile = nr * nk;
        cape.pairs(r0, r1, c0, c1, z.data(), a.data(), hidden.data(), logits.data());
        for (int64_t h = 0; h < n.heads; ++h) {
          T* o = output.data_ptr<T>() + ((b * n.heads + h) * n.length + r0) * n.value_dim;
          const T* v = value.data_ptr<T>() + ((b * n.heads + h) * n.length + c0) * n.value_dim;
          T* l = logits.data() + h * tile;
          for (int64_t r = 0; r < nr; ++r) {
            const int count = std::clamp<int64_t>(r0 + r + 1 - c0, 0, nk);
            T* s = l + r * nk;
            if (count > 0) softmax_step(s, count, most[h * rows + r], sum[h * rows + r], o + r * n.value_dim,
                                        n.value_dim);
            std::fill(s + count, s + nk, T(0));
          }
          times<T>(l, nk, v, o, nr, nk, n.value_dim, T(1));
        }
      }
      for (int64_t h = 0; h < n.heads; ++h) {
        const int64_t at_row = (b * n.heads + h) * n.length + r0;
        softmax_finish(output.data_ptr<T>() + at_row * n.value_dim, nr, n.value_dim, most.data() + h * rows,
                       sum.data() + h * rows, log_sum.data_ptr<T>() + at_row);
      }
    }
  });
  return {output, log_sum};
}

template <typename T>
std::vector<at::Tensor> backward_impl(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                      const at::Tensor& table, const at::Tensor& w1, const at::Tensor& b1,
                                      const at::Tensor& w2, const at::Tensor& b2, const at::Tensor& output,
                                      const at::Tensor& log_sum, const at::Tensor& grad_output, double scaling,
                                      bool add_bias, bool table_grad, int64_t rows, int64_t keys) {
  const Sizes n = sizes_of(query, value, w1);
  const int64_t row_tiles = (n.length + rows - 1) / rows;
  const auto order = balanced_order(row_tiles);
  // Each thread adds into buffers of its own (summed at the end): keys, values and every shared parameter.
  const int64_t threads = at::get_num_threads();
  auto grad_query = at::zeros_like(query);
  auto grad_key = at::zeros({threads, n.batch, n.heads, n.length, n.dim}, query.options());
  auto grad_value = at::zeros({threads, n.batch, n.heads, n.length, n.value_dim}, query.options());
  const at::Tensor by_distance = by_distance_of(table, w1, b1);
  auto grad_table = at::zeros({threads, n.heads, n.length}, query.options());  // the bias added to the logits
  auto grad_w1 = at::zeros({threads, n.width, n.heads}, query.options());  // W1[:, :H]
  auto grad_by_distance = at::zeros({threads, n.width, n.length}, query.options());
  auto grad_w2 = at::zeros({threads, n.heads, n.width}, query.options());
  auto grad_b2 = at::zeros({threads, n.heads}, query.options());
  at::parallel_for(0, n.batch * row_tiles, 1, [&](int64_t begin, int64_t end) {
    const int64_t thread = at::get_thread_num();
    TORCH_CHECK(thread < threads, "cape_backward: more threads than buffers");
    const int64_t p = rows * keys;
    std::vector<T> z(n.heads * p), a(n.width * p), hidden(n.width * p), prob(n.heads * p), grad(n.heads * p);
    std::vector<T> grad_hidden(n.width * p), grad_z(n.heads * p), delta(n.heads * rows);
    T* dw1 = grad_w1.data_ptr<T>() + thread * n.width * n.heads;
    T* de = grad_by_distance.data_ptr<T>() + thread * n.width * n.length;
    T* dw2 = grad_w2.data_ptr<T>() + thread * n.heads * n.width;
    T* db2 = grad_b2.data_ptr<T>() + thread * n.heads;
    T* dtable = grad_table.data_ptr<T>() + thread * n.heads * n.length;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / row_tiles, r0 = order[item % row_tiles] * rows;
      const int64_t r1 = std::min(r0 + rows, n.length), nr = r1 - r0;
      const Cape<T> cape = layer_of<T>(n, query, key, table, by_distance, w1, w2, b2, b, scaling, add_bias);
      for (int64_t h = 0; h < n.heads; ++h) {
        const int64_t at_row = (b * n.heads + h) * n.length + r0;
        row_dots(grad_output.data_ptr<T>() + at_row * n.value_dim, output.data_ptr<T>() + at_row * n.value_dim, nr,
                 n.value_dim, delta.data() + h * rows);
      }
      for (int64_t c0 = 0; c0 < r1; c0 += keys) {
        const int64_t c1 = std::min(c0 + keys, r1), nk = c1 - c0, tile = nr * nk;
        cape.pairs(r0, r1, c0, c1, z.data(), a.data(), hidden.data(), prob.data());
        for (int64_t h = 0; h < n.heads; ++h) {  // probabilities, then dl = P (dO . v - D) per head
          const int64_t head_row = (b * n.heads + h) * n.length;
          const T* go = grad_output.data_ptr<T>() + (head_row + r0) * n.value_dim;
          const T* v = value.data_ptr<T>() + (head_row + c0) * n.value_dim;
          T* dv = grad_value.data_ptr<T>() + ((thread * n.batch + b) * n.heads * n.length + h * n.length + c0) *
                                                  n.value_dim;
          T* pr = prob.data() + h * tile;
          T* dl = grad.data() + h * tile;
          for (int64_t r = 0; r < nr; ++r) {
            const int count = std::clamp<int64_t>(r0 + r + 1 - c0, 0, nk);
            const T lse = log_sum.data_ptr<T>()[head_row + r0 + r];
            T* row = pr + r * nk;
            probabilities(row, count, lse);
            std::fill(row + count, row + nk, T(0));
          }
          times_transposed<T>(go, v, dl, nr, nk, n.value_dim, T(1), T(0));  // dO . v
          transposed_times<T>(pr, nk, go, dv, nr, nk, n.value_dim);  // dV += P^T dO
          for (int64_t r = 0; r < nr; ++r) {
            const int count = std::clamp<int64_t>(r0 + r + 1 - c0, 0, nk);
            const T centre = delta[h * rows + r];
            const T* row = pr + r * nk;
            T* d = dl + r * nk;
#pragma omp simd
            for (int c = 0; c < count; ++c) d[c] = row[c] * (d[c] - centre);
            std::fill(d + count, d + nk, T(0));
          }
          T total = 0;
#pragma omp simd reduction(+ : total)
          for (int64_t i = 0; i < tile; ++i) total += dl[i];
          db2[h] += total;
        }
        // The MLP's backward over all pairs: dW2 += dc hidden^T, d hidden = W2^T dc, da = d hidden * gelu'(a).
        times_transposed<T>(grad.data(), hidden.data(), dw2, n.heads, n.width, tile, T(1), T(1));
        std::fill(grad_hidden.begin(), grad_hidden.begin() + n.width * tile, T(0));
        transposed_times<T>(w2.data_ptr<T>(), n.width, grad.data(), grad_hidden.data(), n.heads, n.width, tile);
        gelu_slopes(a.data(), n.width * tile);
        for (int64_t w = 0; w < n.width; ++w) {
          T* d = grad_hidden.data() + w * tile;
          const T* slope = a.data() + w * tile;
#pragma omp simd
          for (int64_t i = 0; i < tile; ++i) d[i] *= slope[i];
          sum_by_distance(d, r0, c0, nr, nk, de + w * n.length);
        }
        times_transposed<T>(grad_hidden.data(), z.data(), dw1, n.width, n.heads, tile, T(1), T(1));
        std::fill(grad_z.begin(), grad_z.begin() + n.heads * tile, T(0));
        transposed_times<T>(w1.data_ptr<T>(), 2 * n.heads, grad_hidden.data(), grad_z.data(), n.width, n.heads,
                            tile);
        for (int64_t h = 0; h < n.heads; ++h) {  // dz = dl + W1[:, :H]^T da: into q and k; dl into the added bias
          const int64_t head_row = (b * n.heads + h) * n.length;
          T* dz = grad_z.data() + h * tile;
          const T* dl = grad.data() + h * tile;
#pragma omp simd
          for (int64_t i = 0; i < tile; ++i) dz[i] += dl[i];
          if (add_bias && table_grad) sum_by_distance(dl, r0, c0, nr, nk, dtable + h * n.length);
          times<T>(dz, nk, cape.key + (h * n.length + c0) * n.dim,
                   grad_query.data_ptr<T>() + (head_row + r0) * n.dim, nr, nk, n.dim, T(1));
          T* dk = grad_key.data_ptr<T>() + ((thread * n.batch + b) * n.heads * n.length + h * n.length + c0) * n.dim;
          transposed_times<T>(dz, nk, cape.query + (h * n.length + r0) * n.dim, dk, nr, nk, n.dim);
        }
      }
    }
  });
  grad_query.mul_(scaling);
  const at::Tensor by_distance_grad = grad_by_distance.sum(0);  // dE [W, L]
  at::Tensor table_grad_sum = grad_table.sum(0);
  if (table_grad) table_grad_sum.addmm_(w1.narrow(1, n.heads, n.heads).t(), by_distance_grad);
  return {grad_query, grad_key.sum(0).mul_(scaling), grad_value.sum(0), table_grad_sum,
          at::cat({grad_w1.sum(0), at::mm(by_distance_grad, table.t())}, 1), by_distance_grad.sum(1),
          grad_w2.sum(0), grad_b2.sum(0)};
}

void check(const char* name, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
           const at::Tensor& table, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
           const at::Tensor& b2) {
  TORCH_CHECK(query.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(query.dim() == 4 && key.sizes() == query.sizes() && value.dim() == 4 &&
                  value.size(0) == query.size(0) && value.size(1) == query.size(1) && value.size(2) == query.size(2),
              name, ": query and key [B, H, L, D], value [B, H, L, E]");
  const int64_t heads = query.size(1), width = w1.size(0);
  TORCH_CHECK(table.dim() == 2 && table.size(0) == heads && table.size(1) == query.size(2), name, ": table [H, L]");
  TORCH_CHECK(w1.dim() == 2 && w1.size(1) == 2 * heads && b1.dim() == 1 && b1.size(0) == width && w2.dim() == 2 &&
                  w2.size(0) == heads && w2.size(1) == width && b2.dim() == 1 && b2.size(0) == heads,
              name, ": w1 [W, 2H], b1 [W], w2 [H, W], b2 [H]");
  for (const at::Tensor* t : {&query, &key, &value, &table, &w1, &b1, &w2, &b2}) {
    TORCH_CHECK(t->is_contiguous(), name, ": contiguous inputs");
    TORCH_CHECK(t->scalar_type() == query.scalar_type() &&
                    (query.scalar_type() == at::kFloat || query.scalar_type() == at::kDouble),
                name, ": one dtype, float32 or float64");
  }
}

std::vector<at::Tensor> cape_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                     const at::Tensor& table, const at::Tensor& w1, const at::Tensor& b1,
                                     const at::Tensor& w2, const at::Tensor& b2, double scaling, bool add_bias,
                                     bool table_grad, int64_t rows, int64_t keys) {
  check("cape_forward", query, key, value, table, w1, b1, w2, b2);
  if (query.scalar_type() == at::kDouble)
    return forward_impl<double>(query, key, value, table, w1, b1, w2, b2, scaling, add_bias, rows, keys);
  return forward_impl<float>(query, key, value, table, w1, b1, w2, b2, scaling, add_bias, rows, keys);
}

std::vector<at::Tensor> cape_backward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                      const at::Tensor& table, const at::Tensor& w1, const at::Tensor& b1,
                                      const at::Tensor& w2, const at::Tensor& b2, const at::Tensor& output,
                                      const at::Tensor& log_sum, const at::Tensor& grad_output, double scaling,
                                      bool add_bias, bool table_grad, int64_t rows, int64_t keys) {
  check("cape_backward", query, key, value, table, w1, b1, w2, b2);
  TORCH_CHECK(output.is_contiguous() && grad_output.is_contiguous() && log_sum.is_contiguous(),
              "cape_backward: contiguous saved tensors");
  if (query.scalar_type() == at::kDouble)
    return backward_impl<double>(query, key, value, table, w1, b1, w2, b2, output, log_sum, grad_output, scaling,
                                 add_bias, table_grad, rows, keys);
  return backward_impl<float>(query, key, value, table, w1, b1, w2, b2, output, log_sum, grad_output, scaling,
                              add_bias, table_grad, rows, keys);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_posenc_cpu, m) {
  m.def("cape_forward(Tensor query, Tensor key, Tensor value, Tensor table, Tensor w1, Tensor b1, Tensor w2, "
        "Tensor b2, float scaling, bool add_bias, bool table_grad, int rows, int keys) -> Tensor[]");
  m.def("cape_backward(Tensor query, Tensor key, Tensor value, Tensor table, Tensor w1, Tensor b1, Tensor w2, "
        "Tensor b2, Tensor output, Tensor log_sum, Tensor grad_output, float scaling, bool add_bias, bool table_grad, "
        "int rows, int keys) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(hf_posenc_cpu, CPU, m) {
  m.impl("cape_forward", cape_forward);
  m.impl("cape_backward", cape_backward);
}
