// The learned distance-table attention's backward tiles for the CPU (engine/attention/table_attention.py has the
// method, the widened operands and the torch-op tiles this replaces; engine/fused_cpu.py builds this file).
//
// Per batch x head, per query block, per key tile, in one thread's cache: the bias written into the tile, then
//   S = bias + scale Q K^T,  P = exp(S - lse) (0 where at most kSmallestProbability),  dV += P^T dO,
//   dS = (dO V^T - delta) * P, the table's gradient += dS's anti-diagonal sums,  dQ += scale dS K,  dK += dS^T (scale Q),
// the five products by the BLAS torch links (tiles.h), the passes between them one loop each over the tile, where
// the torch-op tiles take about ten (a bias copy, clamp, exp, threshold, the multiply, the skewed buffer's column sum)
// at memory speed across a batch of heads. A tile whose every probability is dropped (the far keys of a steep ALiBi)
// skips its four later products.

#include "tiles.h"

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
  const T *query, *key, *grad, *value, *padded;  // [N, q, W], [N, kv, W], [N, q, W], [N, kv, W] (W = D + 1), [H, P]
  T *grad_query, *grad_key, *grad_value, *grad_padded;  // [N, q, D], [N, kv, D], [N, kv, D], [N, P] (or null)
  int64_t heads, q, kv, dim, padded_width;
};

// One batch x head `n`: every block's tiles, in order.
template <typename T>
void head_backward(const Operands<T>& o, int64_t n, const int64_t* blocks, int64_t block_count, int64_t tile_width,
                   T scaling, std::vector<T>& probs, std::vector<T>& grads) {
  const int64_t wide = o.dim + 1, dim = o.dim;
  const T* qw = o.query + n * o.q * wide;
  const T* kw = o.key + n * o.kv * wide;
  const T* gw = o.grad + n * o.q * wide;
  const T* vw = o.value + n * o.kv * wide;
  const T* bias = o.padded + (n % o.heads) * o.padded_width;
  T* dq = o.grad_query + n * o.q * dim;
  T* dk = o.grad_key + n * o.kv * dim;
  T* dv = o.grad_value + n * o.kv * dim;
  T* dtable = o.grad_padded ? o.grad_padded + n * o.padded_width : nullptr;
  for (int64_t b = 0; b < block_count; ++b) {
    const int64_t first = blocks[4 * b], rows = blocks[4 * b + 1], keys = blocks[4 * b + 2], start = blocks[4 * b + 3];
    const int nr = int(rows);
    for (int64_t tile = 0; tile < keys; tile += tile_width) {
      const int nk = int(std::min(tile_width, keys - tile));
      const int64_t c0 = o.kv - keys + tile, offset = start + tile;  // entry (r, c): bias[offset + r + c]
      T* p = probs.data();
      T* g = grads.data();
      for (int r = 0; r < nr; ++r) std::copy(bias + offset + r, bias + offset + r + nk, p + int64_t(r) * nk);
      // -lse and -delta (the widened operands' last columns) are added in the passes: the products run at depth D,
      // which the BLAS takes faster than D + 1.
      times_transposed<T>(qw + first * wide, kw + c0 * wide, p, nr, nk, int(dim), T(1), T(1), wide, wide);
      if (!probabilities_in_place(p, nr, nk, qw + first * wide + dim, wide)) continue;  // dS = 0: no gradient
      // dV[c0:] += P^T dO   (dO: the first D columns of dO')
      gemm('N', 'T', int(dim), nk, nr, T(1), gw + first * wide, int(wide), p, nk, T(1), dv + c0 * dim, int(dim));
      times_transposed<T>(gw + first * wide, vw + c0 * wide, g, nr, nk, int(dim), T(1), T(0), wide, wide);  // dP
      for (int r = 0; r < nr; ++r) {  // dS = (dP - delta) * P, and its anti-diagonal sums into the table's gradient
        T* gr = g + int64_t(r) * nk;
        const T* pr = p + int64_t(r) * nk;
        const T centre = gw[(first + r) * wide + dim];
        if (dtable != nullptr) {
          T* sums = dtable + offset + r;
#pragma omp simd
          for (int c = 0; c < nk; ++c) {
            const T ds = (gr[c] + centre) * pr[c];
            gr[c] = ds;
            sums[c] += ds;
          }
        } else {
#pragma omp simd
          for (int c = 0; c < nk; ++c) gr[c] = (gr[c] + centre) * pr[c];
        }
      }
      // dQ[first:] += scale dS K,  dK[c0:] += dS^T (scale Q)   (K, scale Q: the first D columns of K', Q')
      gemm('N', 'N', int(dim), nr, nk, scaling, kw + c0 * wide, int(wide), g, nk, T(1), dq + first * dim, int(dim));
      gemm('N', 'T', int(dim), nk, nr, T(1), qw + first * wide, int(wide), g, nk, T(1), dk + c0 * dim, int(dim));
    }
  }
}

template <typename T>
std::vector<at::Tensor> backward_impl(const at::Tensor& query, const at::Tensor& key, const at::Tensor& grad,
                                      const at::Tensor& value, const at::Tensor& padded, const at::Tensor& blocks,
                                      int64_t tile_width, double scaling, bool table_grad) {
  const int64_t count = query.size(0), q = query.size(1), kv = key.size(1), dim = query.size(2) - 1;
  const int64_t heads = padded.size(0), width = padded.size(1);
  auto options = query.options();
  auto grad_query = at::zeros({count, q, dim}, options);
  auto grad_key = at::zeros({count, kv, dim}, options);
  auto grad_value = at::zeros({count, kv, dim}, options);
  auto grad_padded = table_grad ? at::zeros({count, width}, options) : at::Tensor();
  Operands<T> o{query.data_ptr<T>(), key.data_ptr<T>(), grad.data_ptr<T>(), value.data_ptr<T>(),
                padded.data_ptr<T>(), grad_query.data_ptr<T>(), grad_key.data_ptr<T>(), grad_value.data_ptr<T>(),
                table_grad ? grad_padded.data_ptr<T>() : nullptr, heads, q, kv, dim, width};
  const int64_t* block_rows = blocks.data_ptr<int64_t>();
  const int64_t block_count = blocks.size(0);
  int64_t most_rows = 1;
  for (int64_t b = 0; b < block_count; ++b) most_rows = std::max(most_rows, block_rows[4 * b + 1]);
  const int64_t tile = std::max<int64_t>(1, tile_width);
  // Every batch x head writes its own gradients (a key or value head shared by a group is summed by the caller).
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> probs(most_rows * tile), grads(most_rows * tile);
    for (int64_t n = begin; n < end; ++n) head_backward<T>(o, n, block_rows, block_count, tile, T(scaling), probs, grads);
  });
  if (!table_grad) return {grad_query, grad_key, grad_value};
  return {grad_query, grad_key, grad_value, grad_padded};
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
}

TORCH_LIBRARY_IMPL(hf_posenc_cpu, CPU, m) {
  m.impl("table_backward", table_backward);
  m.impl("table_probabilities", table_probabilities);
}
