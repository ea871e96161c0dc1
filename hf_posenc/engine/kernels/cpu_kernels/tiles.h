// What the fused CPU kernels share (engine/fused_cpu.py builds them into one extension): the BLAS calls on row-major
// tiles, the order of a head's query tiles, and how a head's work splits among threads.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}

namespace hf_posenc_cpu {

// An exp whose result would underflow float32 (an argument under about -88) takes a path many times slower in the
// vector math library; arguments are floored here, where the result is negligible beside the row's others.
constexpr double kExpFloor = -80.0;

// How many of the keys [c0, c0 + nk) query `row` of a causal square sees (those at or before it).
inline int causal_keys(int64_t row, int64_t c0, int64_t nk) { return int(std::clamp<int64_t>(row + 1 - c0, 0, nk)); }

// Column-major BLAS on row-major data: every call below is written as the column-major product of the transposes.
inline void gemm(char ta, char tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
                 float beta, float* c, int ldc) {
  sgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}
inline void gemm(char ta, char tb, int m, int n, int k, double alpha, const double* a, int lda, const double* b,
                 int ldb, double beta, double* c, int ldc) {
  dgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

// row-major C[r x c] (+)= alpha A[r x d] . B[c x d]^T   (rows of A `lda` apart and of B `ldb` apart; default d)
template <typename T>
inline void times_transposed(const T* a, const T* b, T* c, int rows, int cols, int depth, T alpha, T beta,
                             int64_t lda = 0, int64_t ldb = 0) {
  gemm('T', 'N', cols, rows, depth, alpha, b, int(ldb ? ldb : depth), a, int(lda ? lda : depth), beta, c, cols);
}
// row-major C[r x d] (+)= A[r x c] . B[c x d]   (A's rows `lda` apart)
template <typename T>
inline void times(const T* a, int lda, const T* b, T* c, int rows, int cols, int depth, T beta) {
  gemm('N', 'N', depth, rows, cols, T(1), b, depth, a, lda, beta, c, depth);
}
// row-major C[c x d] += A[r x c]^T . B[r x d]   (A's rows `lda` apart)
template <typename T>
inline void transposed_times(const T* a, int lda, const T* b, T* c, int rows, int cols, int depth) {
  gemm('N', 'T', depth, cols, rows, T(1), b, depth, a, lda, T(1), c, depth);
}

// Flash attention's running softmax, one row of one key tile: the logits s[0, n) become exp(s - max); the row's running
// maximum and sum of exponentials, and its output so far (`out`, `width` wide), are rescaled where the maximum rose.
template <typename T>
inline void softmax_step(T* s, int n, T& most, T& sum, T* out, int64_t width) {
  const T floor = T(kExpFloor);
  T top = most;
  for (int c = 0; c < n; ++c) top = std::max(top, s[c]);
  if (top > most) {
    const T factor = std::exp(std::max(most - top, floor));
    sum *= factor;
    for (int64_t d = 0; d < width; ++d) out[d] *= factor;
    most = top;
  }
  T added = 0;
#pragma omp simd reduction(+ : added)
  for (int c = 0; c < n; ++c) {
    s[c] = std::exp(std::max(s[c] - top, floor));
    added += s[c];
  }
  sum += added;
}

// The end of softmax_step's rows: each output divided by its sum, each row's logsumexp into `log_sum`.
template <typename T>
inline void softmax_finish(T* out, int64_t rows, int64_t width, const T* most, const T* sum, T* log_sum) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < width; ++d) out[r * width + d] /= sum[r];
    log_sum[r] = most[r] + std::log(sum[r]);
  }
}

// A row's probabilities from its logits and logsumexp, in place: exp(s - lse) (floored as softmax_step's).
template <typename T>
inline void probabilities(T* s, int n, T lse) {
  const T floor = T(kExpFloor);
#pragma omp simd
  for (int c = 0; c < n; ++c) s[c] = std::exp(std::max(s[c] - lse, floor));
}

// dO_i . o_i for each row of a tile (summed in double): flash attention's D_i, the softmax backward's centre.
template <typename T>
inline void row_dots(const T* grad_output, const T* output, int64_t rows, int64_t width, T* dots) {
  for (int64_t r = 0; r < rows; ++r) {
    double dot = 0;
    for (int64_t d = 0; d < width; ++d) dot += double(grad_output[r * width + d]) * output[r * width + d];
    dots[r] = T(dot);
  }
}

// Query tiles of a head in an order whose every contiguous run costs about the same (a tile's cost grows with its
// row): 0, last, 1, last - 1, ...
inline std::vector<int64_t> balanced_order(int64_t tiles) {
  std::vector<int64_t> order;
  order.reserve(tiles);
  for (int64_t lo = 0, hi = tiles - 1; lo <= hi; ++lo, --hi) {
    order.push_back(lo);
    if (hi != lo) order.push_back(hi);
  }
  return order;
}

// Runs per head of the backward's query tiles, so that heads * runs divides evenly among the threads; each run adds
// its key and value gradients into a buffer of its own (summed at the end), the query gradients into their rows.
inline int64_t runs_per_head(int64_t heads, int64_t row_tiles) {
  const int64_t threads = at::get_num_threads();
  return std::max<int64_t>(1, std::min<int64_t>(row_tiles, threads / std::gcd(heads, threads)));
}

// The three inputs of a causal square: [N, L, D] queries and keys, [N, L, E] values, contiguous, one float dtype.
inline void check_square(const char* name, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value) {
  TORCH_CHECK(query.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && key.sizes() == query.sizes() && value.dim() == 3 &&
                  value.size(0) == query.size(0) && value.size(1) == query.size(1),
              name, ": query and key [N, L, D], value [N, L, E]");
  TORCH_CHECK(query.is_contiguous() && key.is_contiguous() && value.is_contiguous(), name, ": contiguous inputs");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type() &&
                  (query.scalar_type() == at::kFloat || query.scalar_type() == at::kDouble),
              name, ": one dtype, float32 or float64");
}

}  // namespace hf_posenc_cpu
