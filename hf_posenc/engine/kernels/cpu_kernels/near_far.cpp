// Fused near/far attention for the CPU, forward and backward, on a causal square (query i is key i, no other mask):
// Self-Extend's and ReRoPE's two position assignments merged before one softmax (methods/neighbour_window.py), where
// the far keys of query i are exactly j <= i - far_from (engine/attention.py checks that before calling). The logits
// are s * nq_i . nk_j for the near keys and s * fq_i . fk_j for the far ones; the softmax is flash attention's (a
// running maximum and sum per row; the backward recomputes each tile from the logsumexp). A key tile wholly near or
// wholly far takes one product; only the tiles the boundary j = i - far_from crosses take both.
//
// With far_from = the length no key is far: plain causal flash attention (the causal ops below), whose query and key
// head size may differ from the values' (SDPA's CPU kernel needs one head size and otherwise pads both sides to it).

#include "tiles.h"

namespace {

using namespace hf_posenc_cpu;

template <typename T>
struct NearFar {
  int64_t length, dim, value_dim, far_from;
  T scaling;
  const T *near_query, *near_key, *far_query, *far_key;  // one head's

  // The logits of rows [r0, r1) against keys [c0, c1) into `out` (far where j <= i - far_from, near elsewhere;
  // `other`: a second buffer for tiles that need both); returns how many of the tile's rows' keys are far per
  // row through `far_count`.
  void logits(int64_t r0, int64_t r1, int64_t c0, int64_t c1, T* out, T* other, int* far_count) const {
    const int nr = r1 - r0, nk = c1 - c0;
    const bool any_far = c0 <= r1 - 1 - far_from, any_near = c1 - 1 > r0 - far_from;
    const T* fq = far_query + r0 * dim;
    const T* nq = near_query + r0 * dim;
    if (any_far) times_transposed<T>(fq, far_key + c0 * dim, out, nr, nk, dim, scaling, T(0));
    if (any_near) times_transposed<T>(nq, near_key + c0 * dim, any_far ? other : out, nr, nk, dim, scaling, T(0));
    for (int r = 0; r < nr; ++r) {
      const int n = causal_keys(r0 + r, c0, nk);
      const int f = std::clamp<int64_t>(r0 + r - far_from + 1 - c0, 0, n);
      far_count[r] = f;
      if (any_far && any_near) std::copy(other + r * nk + f, other + r * nk + n, out + r * nk + f);
    }
  }
};

template <typename T>
std::vector<at::Tensor> forward_impl(const at::Tensor& near_query, const at::Tensor& near_key,
                                     const at::Tensor& far_query, const at::Tensor& far_key, const at::Tensor& value,
                                     int64_t far_from, double scaling, int64_t rows, int64_t keys) {
  const int64_t heads = near_query.size(0), length = near_query.size(1), dim = near_query.size(2);
  const int64_t value_dim = value.size(2);
  auto output = at::empty({heads, length, value_dim}, value.options());
  auto log_sum = at::empty({heads, length}, value.options());
  const int64_t row_tiles = (length + rows - 1) / rows;
  const auto order = balanced_order(row_tiles);
  T* o_all = output.data_ptr<T>();
  T* lse_all = log_sum.data_ptr<T>();
  at::parallel_for(0, heads * row_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> score(rows * keys), other(rows * keys), most(rows), sum(rows);
    std::vector<int> far_count(rows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / row_tiles, r0 = order[item % row_tiles] * rows;
      const int64_t r1 = std::min(r0 + rows, length), nr = r1 - r0;
      const int64_t offset = h * length * dim;
      NearFar<T> parts{length, dim, value_dim, far_from, T(scaling), near_query.data_ptr<T>() + offset,
                       near_key.data_ptr<T>() + offset, far_query.data_ptr<T>() + offset,
                       far_key.data_ptr<T>() + offset};
      const T* v = value.data_ptr<T>() + h * length * value_dim;
      T* o = o_all + h * length * value_dim + r0 * value_dim;
      std::fill(most.begin(), most.end(), T(-1e30));
      std::fill(sum.begin(), sum.end(), T(0));
      std::fill(o, o + nr * value_dim, T(0));
      for (int64_t c0 = 0; c0 < r1; c0 += keys) {
        const int64_t c1 = std::min(c0 + keys, r1), nk = c1 - c0;
        parts.logits(r0, r1, c0, c1, score.data(), other.data(), far_count.data());
        for (int64_t r = 0; r < nr; ++r) {
          const int n = causal_keys(r0 + r, c0, nk);
          T* s = score.data() + r * nk;
          if (n > 0) softmax_step(s, n, most[r], sum[r], o + r * value_dim, value_dim);
          std::fill(s + n, s + nk, T(0));
        }
        times<T>(score.data(), nk, v + c0 * value_dim, o, nr, nk, value_dim, T(1));
      }
      softmax_finish(o, nr, value_dim, most.data(), sum.data(), lse_all + h * length + r0);
    }
  });
  return {output, log_sum};
}

template <typename T>
std::vector<at::Tensor> backward_impl(const at::Tensor& near_query, const at::Tensor& near_key,
                                      const at::Tensor& far_query, const at::Tensor& far_key, const at::Tensor& value,
                                      const at::Tensor& output, const at::Tensor& log_sum,
                                      const at::Tensor& grad_output, int64_t far_from, double scaling, int64_t rows,
                                      int64_t keys) {
  const int64_t heads = near_query.size(0), length = near_query.size(1), dim = near_query.size(2);
  const int64_t value_dim = value.size(2);
  const int64_t row_tiles = (length + rows - 1) / rows;
  const auto order = balanced_order(row_tiles);
  const int64_t parts = runs_per_head(heads, row_tiles);
  const int64_t far_heads = far_from < length ? heads : 0;  // no far key: no far gradients to hold
  auto grad_near_query = at::zeros_like(near_query);
  auto grad_far_query = at::zeros({far_heads, length, dim}, near_query.options());
  auto grad_near_key = at::zeros({parts, heads, length, dim}, near_query.options());
  auto grad_far_key = at::zeros({parts, far_heads, length, dim}, near_query.options());
  auto grad_value = at::zeros({parts, heads, length, value_dim}, near_query.options());
  const T* o_all = output.data_ptr<T>();
  const T* lse_all = log_sum.data_ptr<T>();
  const T* do_all = grad_output.data_ptr<T>();
  at::parallel_for(0, heads * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> prob(rows * keys), other(rows * keys), grad(rows * keys), delta(rows);
    std::vector<int> far_count(rows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / parts, part = item % parts;
      const int64_t offset = h * length * dim, part_offset = (part * heads + h) * length * dim;
      NearFar<T> nf{length, dim, value_dim, far_from, T(scaling), near_query.data_ptr<T>() + offset,
                    near_key.data_ptr<T>() + offset, far_query.data_ptr<T>() + offset,
                    far_key.data_ptr<T>() + offset};
      const T* v = value.data_ptr<T>() + h * length * value_dim;
      T* dnq = grad_near_query.data_ptr<T>() + offset;
      T* dfq = far_heads ? grad_far_query.data_ptr<T>() + offset : nullptr;
      T* dnk = grad_near_key.data_ptr<T>() + part_offset;
      T* dfk = far_heads ? grad_far_key.data_ptr<T>() + part_offset : nullptr;
      T* dv = grad_value.data_ptr<T>() + (part * heads + h) * length * value_dim;
      for (int64_t t = row_tiles * part / parts; t < row_tiles * (part + 1) / parts; ++t) {
        const int64_t r0 = order[t] * rows, r1 = std::min(r0 + rows, length), nr = r1 - r0;
        const T* go = do_all + h * length * value_dim + r0 * value_dim;
        row_dots(go, o_all + h * length * value_dim + r0 * value_dim, nr, value_dim, delta.data());
        for (int64_t c0 = 0; c0 < r1; c0 += keys) {
          const int64_t c1 = std::min(c0 + keys, r1), nk = c1 - c0;
          nf.logits(r0, r1, c0, c1, prob.data(), other.data(), far_count.data());
          for (int64_t r = 0; r < nr; ++r) {
            const int n = causal_keys(r0 + r, c0, nk);
            const T lse = lse_all[h * length + r0 + r];
            T* p = prob.data() + r * nk;
            probabilities(p, n, lse);
            std::fill(p + n, p + nk, T(0));
          }
          times_transposed<T>(go, v + c0 * value_dim, grad.data(), nr, nk, value_dim, T(1), T(0));  // dO . v
          transposed_times<T>(prob.data(), nk, go, dv + c0 * value_dim, nr, nk, value_dim);  // dV += P^T dO
          for (int64_t r = 0; r < nr; ++r) {
            const int n = causal_keys(r0 + r, c0, nk);
            const T* p = prob.data() + r * nk;
            T* ds = grad.data() + r * nk;
            const T centre = delta[r], scale = nf.scaling;
#pragma omp simd
            for (int c = 0; c < n; ++c) ds[c] = scale * p[c] * (ds[c] - centre);
            std::fill(ds + n, ds + nk, T(0));
          }
          const bool any_far = c0 <= r1 - 1 - far_from, any_near = c1 - 1 > r0 - far_from;
          const T* fq = nf.far_query + r0 * dim;
          const T* nq = nf.near_query + r0 * dim;
          if (any_far && any_near) {  // split dS: the far keys' part into `other`, zeros where near (and back)
            for (int64_t r = 0; r < nr; ++r) {
              T* ds = grad.data() + r * nk;
              T* far = other.data() + r * nk;
              const int f = far_count[r];
              std::copy(ds, ds + f, far);
              std::fill(far + f, far + nk, T(0));
              std::fill(ds, ds + f, T(0));
            }
          }
          if (any_far) {
            const T* ds = any_near ? other.data() : grad.data();
            times<T>(ds, nk, nf.far_key + c0 * dim, dfq + r0 * dim, nr, nk, dim, T(1));  // dQ_far += dS K_far
            transposed_times<T>(ds, nk, fq, dfk + c0 * dim, nr, nk, dim);  // dK_far += dS^T Q_far
          }
          if (any_near) {
            times<T>(grad.data(), nk, nf.near_key + c0 * dim, dnq + r0 * dim, nr, nk, dim, T(1));
            transposed_times<T>(grad.data(), nk, nq, dnk + c0 * dim, nr, nk, dim);
          }
        }
      }
    }
  });
  return {grad_near_query, grad_near_key.sum(0), grad_far_query, grad_far_key.sum(0), grad_value.sum(0)};
}

std::vector<at::Tensor> near_far_forward(const at::Tensor& near_query, const at::Tensor& near_key,
                                         const at::Tensor& far_query, const at::Tensor& far_key,
                                         const at::Tensor& value, int64_t far_from, double scaling, int64_t rows,
                                         int64_t keys) {
  check_square("near_far_forward", near_query, near_key, value);
  check_square("near_far_forward", far_query, far_key, value);
  TORCH_CHECK(far_from >= 1, "near_far_forward: far_from >= 1");
  if (near_query.scalar_type() == at::kDouble)
    return forward_impl<double>(near_query, near_key, far_query, far_key, value, far_from, scaling, rows, keys);
  return forward_impl<float>(near_query, near_key, far_query, far_key, value, far_from, scaling, rows, keys);
}

std::vector<at::Tensor> near_far_backward(const at::Tensor& near_query, const at::Tensor& near_key,
                                          const at::Tensor& far_query, const at::Tensor& far_key,
                                          const at::Tensor& value, const at::Tensor& output,
                                          const at::Tensor& log_sum, const at::Tensor& grad_output, int64_t far_from,
                                          double scaling, int64_t rows, int64_t keys) {
  check_square("near_far_backward", near_query, near_key, value);
  check_square("near_far_backward", far_query, far_key, value);
  TORCH_CHECK(output.is_contiguous() && grad_output.is_contiguous() && log_sum.is_contiguous(),
              "near_far_backward: contiguous saved tensors");
  auto grads = near_query.scalar_type() == at::kDouble
                   ? backward_impl<double>(near_query, near_key, far_query, far_key, value, output, log_sum,
                                           grad_output, far_from, scaling, rows, keys)
                   : backward_impl<float>(near_query, near_key, far_query, far_key, value, output, log_sum,
                                          grad_output, far_from, scaling, rows, keys);
  if (far_from >= near_query.size(1)) {  // no key was far: the far pair's gradients are zeros of its shape
    grads[2] = at::zeros_like(far_query);
    grads[3] = at::zeros_like(far_key);
  }
  return grads;
}

std::vector<at::Tensor> causal_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                       double scaling, int64_t rows, int64_t keys) {
  check_square("causal_forward", query, key, value);
  const int64_t length = query.size(1);
  if (query.scalar_type() == at::kDouble)
    return forward_impl<double>(query, key, query, key, value, length, scaling, rows, keys);
  return forward_impl<float>(query, key, query, key, value, length, scaling, rows, keys);
}

std::vector<at::Tensor> causal_backward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                        const at::Tensor& output, const at::Tensor& log_sum,
                                        const at::Tensor& grad_output, double scaling, int64_t rows, int64_t keys) {
  check_square("causal_backward", query, key, value);
  TORCH_CHECK(output.is_contiguous() && grad_output.is_contiguous() && log_sum.is_contiguous(),
              "causal_backward: contiguous saved tensors");
  const int64_t length = query.size(1);
  auto grads = query.scalar_type() == at::kDouble
                   ? backward_impl<double>(query, key, query, key, value, output, log_sum, grad_output, length,
                                           scaling, rows, keys)
                   : backward_impl<float>(query, key, query, key, value, output, log_sum, grad_output, length,
                                          scaling, rows, keys);
  return {grads[0], grads[1], grads[4]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_posenc_cpu, m) {
  m.def("near_far_forward(Tensor near_query, Tensor near_key, Tensor far_query, Tensor far_key, Tensor value, "
        "int far_from, float scaling, int rows, int keys) -> Tensor[]");
  m.def("near_far_backward(Tensor near_query, Tensor near_key, Tensor far_query, Tensor far_key, Tensor value, "
        "Tensor output, Tensor log_sum, Tensor grad_output, int far_from, float scaling, int rows, int keys) "
        "-> Tensor[]");
  m.def("causal_forward(Tensor query, Tensor key, Tensor value, float scaling, int rows, int keys) -> Tensor[]");
  m.def("causal_backward(Tensor query, Tensor key, Tensor value, Tensor output, Tensor log_sum, Tensor grad_output, "
        "float scaling, int rows, int keys) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(hf_posenc_cpu, CPU, m) {
  m.impl("near_far_forward", near_far_forward);
  m.impl("near_far_backward", near_far_backward);
  m.impl("causal_forward", causal_forward);
  m.impl("causal_backward", causal_backward);
}
