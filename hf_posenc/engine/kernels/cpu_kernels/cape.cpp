// Fused CAPE attention for the CPU, forward and backward, on a causal square (query i is key i, no other mask) whose
// bias depends on the distance i - j alone (methods/cape.py has the method and its blocked reference, content_scores).
//
// CAPE (Zheng et al., NeurIPS 2024): with z_ij^h = scaling * q_i^h . k_j^h and the bias B_ij^h = table[h, i - j], an
// MLP across the heads corrects each pair's logits:
//   x_ij = [z_ij^1..H, B_ij^1..H],  a_ij = W1 x_ij + b1,  c_ij = W2 act(a_ij) + b2,
//   l_ij^h = z_ij^h + c_ij^h (+ B_ij^h where the bias is added: base="none"),
// act the method's activation (`activation`: LeakyReLU with `negative_slope`, the authors' default, or GELU), and each
// head's output the causal softmax of its l applied to its values. The MLP mixes heads, so a tile holds every
// head of one batch row (feature-major: each head's [rows, keys] pairs); the logits z come from BLAS per head, the
// softmax is flash attention's per head (a running maximum and sum per row; the backward recomputes each tile from the
// logsumexp).
// The MLP runs per chunk of one row's pairs (one vector: 8 floats under AVX2), its products over heads and hidden units
// on vectors in registers (`mix`): as BLAS products over a tile's pairs their inner sizes were H and W (9 and 32 for
// SmolLM2), and MKL's packing of the tile's [W, P] layers took a third of their time. The bias half of W1 sees the bias
// alone, which depends on the distance alone: its part of a_ij, with b1, is a column of E = W1[:, H:] table + b1
// [W, L] (once per call). E and the table are kept reversed (index u = L - 1 - i + j), so a chunk's consecutive keys
// read consecutive entries.
// Backward, per pair from the logsumexp: P = exp(l - lse), dl = P (dO . v - dO_i . o_i) per head; dc = dl,
// da = (W2^T dc) act'(a), dz = dl + W1[:, :H]^T da, da added to dE by distance (and dl to the table's where the bias
// is added and trained); per slab of rows dW2 += dc act(a)^T and dW1[:, :H] += da z^T as BLAS products over the
// slab's pairs; at the end dW1[:, H:] = dE table^T, db1 = dE 1, and (where `table_grad`: a trainable bias; else it
// stays zero) the table's gradient W1[:, H:]^T dE plus dl's sums; dq = scaling dz k, dk = scaling dz^T q.

#include "tiles.h"

#include <cstring>

namespace {

using namespace hf_posenc_cpu;

// ALiBi's bias at far distances (-1000 and less) reaches the MLP. With exp's argument floored after squaring, GELU's
// derivative took 4-6x longer at such inputs than at small ones (glibc's vector exp ended in its scalar path; measured,
// the cause inside the build not traced); with x clamped before squaring it takes the same time at any input. So
// erf's argument is kept within +-kErfCap, where erf is +-1 to float64's precision, and the density's x within
// +-kDensityCap, past which x phi(x) (under 1e-29) is nothing beside Phi(x).
constexpr double kErfCap = 8.0;
constexpr double kDensityCap = 12.0;

// The MLP's products run on GCC/Clang vectors the width of the machine's registers (the compiler keeps these in
// registers across a loop, where an array of a chunk's values went to memory and back at each step).
#ifdef __AVX__
constexpr int kVectorBytes = 32;
#else
constexpr int kVectorBytes = 16;
#endif
template <typename T>
struct VectorOf;
template <>
struct VectorOf<float> {
  typedef float type __attribute__((vector_size(kVectorBytes)));
};
template <>
struct VectorOf<double> {
  typedef double type __attribute__((vector_size(kVectorBytes)));
};
// Pairs of one query row that the MLP handles together: one vector.
template <typename T>
constexpr int kChunk = kVectorBytes / sizeof(T);
constexpr int kMostChunk = kVectorBytes / sizeof(float);

template <typename T>
inline typename VectorOf<T>::type load_chunk(const T* from) {
  typename VectorOf<T>::type chunk;
  std::memcpy(&chunk, from, sizeof(chunk));
  return chunk;
}

template <typename T>
inline void store_chunk(T* to, const typename VectorOf<T>::type& chunk) {
  std::memcpy(to, &chunk, sizeof(chunk));
}

// `rows` (up to 8) chunks through a small matrix at once, each an independent chain of multiply-adds: out_r = init_r +
// sum_k m[r * row_step + k * col_step] in_k, in_k `in_stride` apart, init_r `init_stride` and out_r `out_stride`
// apart (out may be init; no init: zero).
template <typename T, int rows>
inline void mix_rows(const T* m, int64_t row_step, int64_t col_step, int64_t depth, const T* in, int64_t in_stride,
                     const T* init, int64_t init_stride, T* out, int64_t out_stride) {
  using V = typename VectorOf<T>::type;
  V sum[rows];
#pragma GCC unroll 8
  for (int r = 0; r < rows; ++r) sum[r] = init == nullptr ? V{} : load_chunk(init + r * init_stride);
  for (int64_t k = 0; k < depth; ++k) {
    const V x = load_chunk(in + k * in_stride);
    const T* column = m + k * col_step;
#pragma GCC unroll 8
    for (int r = 0; r < rows; ++r) sum[r] += column[r * row_step] * x;
  }
#pragma GCC unroll 8
  for (int r = 0; r < rows; ++r) store_chunk(out + r * out_stride, sum[r]);
}

// mix_rows over any number of rows: blocks of 8, then of 4, then one at a time with its depth in four chains.
template <typename T>
void mix(const T* m, int64_t row_step, int64_t col_step, int64_t rows, int64_t depth, const T* in, int64_t in_stride,
         const T* init, int64_t init_stride, T* out, int64_t out_stride) {
  using V = typename VectorOf<T>::type;
  const auto init_at = [&](int64_t r) { return init == nullptr ? init : init + r * init_stride; };
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8)
    mix_rows<T, 8>(m + r * row_step, row_step, col_step, depth, in, in_stride, init_at(r), init_stride,
                   out + r * out_stride, out_stride);
  for (; r + 4 <= rows; r += 4)
    mix_rows<T, 4>(m + r * row_step, row_step, col_step, depth, in, in_stride, init_at(r), init_stride,
                   out + r * out_stride, out_stride);
  for (; r < rows; ++r) {
    const T* row = m + r * row_step;
    V sum[4] = {init == nullptr ? V{} : load_chunk(init + r * init_stride), V{}, V{}, V{}};
    int64_t k = 0;
    for (; k + 4 <= depth; k += 4) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) sum[j] += row[(k + j) * col_step] * load_chunk(in + (k + j) * in_stride);
    }
    for (; k < depth; ++k) sum[0] += row[k * col_step] * load_chunk(in + k * in_stride);
    store_chunk(out + r * out_stride, (sum[0] + sum[1]) + (sum[2] + sum[3]));
  }
}

// Heads' pair blocks and slab rows are this many values longer than they hold: blocks a power of two apart would
// share L1's sets, and a chunk reads one line from each.
constexpr int64_t kSkew = 16;
// Pairs per slab: the weights' gradients are BLAS products over a slab's pairs (at 1024 the calls' own cost showed;
// 4096 and 8192 measured alike here).
constexpr int64_t kSlabPairs = 4096;

template <typename T>
inline T normal_cdf(T x) {
  return T(0.5) * (T(1) + std::erf(std::clamp(x * T(M_SQRT1_2), T(-kErfCap), T(kErfCap))));
}

template <typename T>
inline T normal_density(T x) {
  const T near = std::clamp(x, T(-kDensityCap), T(kDensityCap));
  return T(0.5 * M_2_SQRTPI * M_SQRT1_2) * std::exp(T(-0.5) * near * near);
}

// A [W, L] row per distance d, reversed and padded to [W, reach]: entry u = L - 1 - d (past L: not a causal pair).
at::Tensor reversed(const at::Tensor& by_distance, int64_t reach) {
  return at::constant_pad_nd(by_distance.flip(1), {0, reach - by_distance.size(1)}).contiguous();
}

// The inverse: summed over threads' buffers [threads, W, reach] -> [W, L].
at::Tensor by_distance_from(const at::Tensor& reversed_buffers, int64_t length) {
  return reversed_buffers.sum(0).narrow(1, 0, length).flip(1).contiguous();
}

// The MLP's activations (methods/cape.py ACTIVATIONS passes these codes).
enum Activation : int64_t { kGelu = 0, kLeakyRelu = 1 };

template <typename T>
struct Cape {
  static constexpr int chunk = kChunk<T>;
  int64_t heads, width, reach;  // reach: the reversed rows' length
  bool add_bias;
  bool gelu;  // else LeakyReLU with negative_slope
  T negative_slope;
  const T* mlp_in;   // E by reversed distance [W, reach]
  const T* bias_in;  // the table by reversed distance [H, reach]
  const T *w1, *w2t, *b2;  // W1 [W, 2H] (its first H columns here), W2^T [W, H], b2 [H]

  // A chunk's hidden layer act(a) [W, chunk] (and act'(a) [W, chunk] where `slope` is not null) from its logits z
  // (heads `stride` apart); u: its first pair's reversed distance.
  void hidden_of(const T* z, int64_t stride, int64_t u, T* hidden, T* slope) const {
    mix(w1, 2 * heads, int64_t(1), width, heads, z, stride, mlp_in + u, reach, hidden, int64_t(chunk));  // a
    const int64_t n = width * chunk;
    if (!gelu) {  // LeakyReLU; its derivative at 0 is the negative slope, as torch's leaky_relu_backward has it
      const T low = negative_slope;
      if (slope == nullptr) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) hidden[i] = hidden[i] > T(0) ? hidden[i] : low * hidden[i];
      } else {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          const T x = hidden[i];
          const bool up = x > T(0);
          hidden[i] = up ? x : low * x;
          slope[i] = up ? T(1) : low;
        }
      }
    } else if (slope == nullptr) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) hidden[i] *= normal_cdf(hidden[i]);
    } else {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const T x = hidden[i], cdf = normal_cdf(x);
        hidden[i] = x * cdf;
        slope[i] = cdf + x * normal_density(x);  // d gelu / da = Phi(a) + a phi(a)
      }
    }
  }

  // A chunk's logits l = z + b2 + W2 hidden (+ the bias), heads `stride` apart (l may be z).
  void logits_of(const T* z, int64_t stride, int64_t u, const T* hidden, T* l) const {
    for (int64_t h = 0; h < heads; ++h) {
      auto sum = load_chunk(z + h * stride) + b2[h];
      if (add_bias) sum += load_chunk(bias_in + h * reach + u);
      store_chunk(l + h * stride, sum);
    }
    mix(w2t, int64_t(1), heads, heads, width, hidden, int64_t(chunk), l, stride, l, stride);
  }

  // One chunk's backward from its logits z and dO . v (`dots`), heads `stride` apart, its row's logsumexp and
  // dO_i . o_i per head; pairs from `valid` on are not causal (or past the tile) and get zeros. Out: the
  // probabilities, dl and dz (heads `stride` apart); the hidden layer and da [W, chunk] into the slab's rows,
  // `layer` apart (`scratch`: 3 x [W, chunk]); da added to dE's reversed rows, and dl to the table's where
  // `grad_bias_in` is not null.
  void backward(const T* z, const T* dots, int64_t stride, int64_t u, int valid, const T* log_sum, const T* centre,
                T* prob, T* grad_logits, T* grad_z, T* hidden_layer, T* grad_a_layer, int64_t layer, T* scratch,
                T* grad_mlp_in, T* grad_bias_in) const {
    T* hidden = scratch;
    T* slope = scratch + width * chunk;
    T* grad_a = scratch + 2 * width * chunk;
    hidden_of(z, stride, u, hidden, slope);
    for (int64_t w = 0; w < width; ++w) store_chunk(hidden_layer + w * layer, load_chunk(hidden + w * chunk));
    logits_of(z, stride, u, hidden, prob);
    const T floor = T(kExpFloor);
    for (int64_t h = 0; h < heads; ++h) {
      T* p = prob + h * stride;
      T* dl = grad_logits + h * stride;
      const T* dot = dots + h * stride;
      const T lse = log_sum[h], mid = centre[h];
#pragma omp simd
      for (int c = 0; c < chunk; ++c) {
        const T causal = c < valid ? std::exp(std::max(p[c] - lse, floor)) : T(0);
        p[c] = causal;
        dl[c] = causal * (dot[c] - mid);
      }
      if (grad_bias_in != nullptr) {
        T* into = grad_bias_in + h * reach + u;
        store_chunk(into, load_chunk(into) + load_chunk(dl));
      }
    }
    mix(w2t, heads, int64_t(1), width, heads, grad_logits, stride, static_cast<const T*>(nullptr), int64_t(0),
        grad_a, int64_t(chunk));  // W2^T dl
    for (int64_t w = 0; w < width; ++w) {
      const auto da = load_chunk(grad_a + w * chunk) * load_chunk(slope + w * chunk);
      store_chunk(grad_a + w * chunk, da);
      store_chunk(grad_a_layer + w * layer, da);
      T* into = grad_mlp_in + w * reach + u;
      store_chunk(into, load_chunk(into) + da);
    }
    mix(w1, int64_t(1), 2 * heads, heads, width, grad_a, int64_t(chunk), grad_logits, stride, grad_z, stride);  // dz
  }
};

// `count` values of each of `blocks` blocks, `from_stride` apart, to blocks `to_stride` apart; zeros after `count`
// up to `pad_to` in each.
template <typename T>
void copy_blocks(const T* from, int64_t from_stride, T* to, int64_t to_stride, int64_t blocks, int count,
                 int pad_to) {
  for (int64_t b = 0; b < blocks; ++b) {
    std::copy(from + b * from_stride, from + b * from_stride + count, to + b * to_stride);
    std::fill(to + b * to_stride + count, to + b * to_stride + pad_to, T(0));
  }
}

struct Sizes {
  int64_t batch, heads, length, dim, value_dim, width;
};

Sizes sizes_of(const at::Tensor& query, const at::Tensor& value, const at::Tensor& w1) {
  return Sizes{query.size(0), query.size(1), query.size(2), query.size(3), value.size(3), w1.size(0)};
}

// What every call builds once: E and the table by reversed distance, W2^T.
template <typename T>
struct Shared {
  at::Tensor mlp_in, bias_in, w2t;
  int64_t reach;

  Shared(const at::Tensor& table, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2, int64_t rows) {
    const int64_t length = table.size(1), heads = table.size(0);
    reach = length + rows + kMostChunk;  // a chunk's keys reach at most rows - 1 + chunk past its query
    const at::Tensor by_distance = at::addmm(b1.unsqueeze(1), w1.narrow(1, heads, heads), table);  // E [W, L]
    mlp_in = reversed(by_distance, reach);
    bias_in = reversed(table, reach);
    w2t = w2.t().contiguous();
  }

  Cape<T> cape(const at::Tensor& w1, const at::Tensor& b2, bool add_bias, int64_t activation,
              double negative_slope) const {
    return Cape<T>{bias_in.size(0), mlp_in.size(0), reach, add_bias, activation == kGelu, T(negative_slope),
                   mlp_in.data_ptr<T>(), bias_in.data_ptr<T>(), w1.data_ptr<T>(), w2t.data_ptr<T>(), b2.data_ptr<T>()};
  }
};

template <typename T>
std::vector<at::Tensor> forward_impl(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                     const at::Tensor& table, const at::Tensor& w1, const at::Tensor& b1,
                                     const at::Tensor& w2, const at::Tensor& b2, double scaling, bool add_bias,
                                     int64_t activation, double negative_slope, int64_t rows, int64_t keys) {
  const Sizes n = sizes_of(query, value, w1);
  const Shared<T> shared(table, w1, b1, w2, rows);
  const Cape<T> cape = shared.cape(w1, b2, add_bias, activation, negative_slope);
  constexpr int chunk = Cape<T>::chunk;
  auto output = at::empty({n.batch, n.heads, n.length, n.value_dim}, value.options());
  auto log_sum = at::empty({n.batch, n.heads, n.length}, value.options());
  const int64_t row_tiles = (n.length + rows - 1) / rows;
  const auto order = balanced_order(row_tiles);
  at::parallel_for(0, n.batch * row_tiles, 1, [&](int64_t begin, int64_t end) {
    const int64_t stride = rows * keys + kSkew;  // between heads' pair blocks
    std::vector<T> logits(n.heads * stride), hidden(n.width * chunk), z_part(n.heads * chunk),
        l_part(n.heads * chunk);
    std::vector<T> most(n.heads * rows), sum(n.heads * rows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / row_tiles, r0 = order[item % row_tiles] * rows;
      const int64_t r1 = std::min(r0 + rows, n.length), nr = r1 - r0;
      const int64_t batch_row = b * n.heads * n.length;
      std::fill(most.begin(), most.end(), T(-1e30));
      std::fill(sum.begin(), sum.end(), T(0));
      for (int64_t h = 0; h < n.heads; ++h) {
        T* o = output.data_ptr<T>() + (batch_row + h * n.length + r0) * n.value_dim;
        std::fill(o, o + nr * n.value_dim, T(0));
      }
      for (int64_t c0 = 0; c0 < r1; c0 += keys) {
        const int64_t c1 = std::min(c0 + keys, r1), nk = c1 - c0;
        for (int64_t h = 0; h < n.heads; ++h)  // z, then the logits in place
          times_transposed<T>(query.data_ptr<T>() + (batch_row + h * n.length + r0) * n.dim,
                              key.data_ptr<T>() + (batch_row + h * n.length + c0) * n.dim,
                              logits.data() + h * stride, nr, nk, n.dim, T(scaling), T(0));
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t causal = causal_keys(r0 + r, c0, nk);
          for (int64_t at = 0; at < causal; at += chunk) {
            T* l = logits.data() + r * nk + at;
            const int64_t u = n.length - 1 - (r0 + r) + c0 + at;
            const int count = std::min<int64_t>(chunk, nk - at);
            if (count == chunk) {
              cape.hidden_of(l, stride, u, hidden.data(), nullptr);
              cape.logits_of(l, stride, u, hidden.data(), l);
            } else {
              copy_blocks(l, stride, z_part.data(), chunk, n.heads, count, chunk);
              cape.hidden_of(z_part.data(), chunk, u, hidden.data(), nullptr);
              cape.logits_of(z_part.data(), chunk, u, hidden.data(), l_part.data());
              copy_blocks(l_part.data(), chunk, l, stride, n.heads, count, count);
            }
          }
        }
        for (int64_t h = 0; h < n.heads; ++h) {
          T* o = output.data_ptr<T>() + (batch_row + h * n.length + r0) * n.value_dim;
          const T* v = value.data_ptr<T>() + (batch_row + h * n.length + c0) * n.value_dim;
          T* l = logits.data() + h * stride;
          for (int64_t r = 0; r < nr; ++r) {
            const int count = causal_keys(r0 + r, c0, nk);
            T* s = l + r * nk;
            if (count > 0) softmax_step(s, count, most[h * rows + r], sum[h * rows + r], o + r * n.value_dim,
                                        n.value_dim);
            std::fill(s + count, s + nk, T(0));
          }
          times<T>(l, nk, v, o, nr, nk, n.value_dim, T(1));
        }
      }
      for (int64_t h = 0; h < n.heads; ++h) {
        const int64_t at_row = batch_row + h * n.length + r0;
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
                                      bool add_bias, bool table_grad, int64_t activation, double negative_slope,
                                      int64_t rows, int64_t keys) {
  const Sizes n = sizes_of(query, value, w1);
  const Shared<T> shared(table, w1, b1, w2, rows);
  const Cape<T> cape = shared.cape(w1, b2, add_bias, activation, negative_slope);
  constexpr int chunk = Cape<T>::chunk;
  const int64_t row_tiles = (n.length + rows - 1) / rows;
  const auto order = balanced_order(row_tiles);
  // Each thread adds into buffers of its own (summed at the end): keys, values and every shared parameter.
  const int64_t threads = at::get_num_threads();
  auto grad_query = at::zeros_like(query);
  auto grad_key = at::zeros({threads, n.batch, n.heads, n.length, n.dim}, query.options());
  auto grad_value = at::zeros({threads, n.batch, n.heads, n.length, n.value_dim}, query.options());
  const bool bias_grad = add_bias && table_grad;  // dl's part of the table's gradient
  const at::Tensor grad_bias_in = at::zeros({bias_grad ? threads : 0, n.heads, shared.reach}, query.options());
  // dE by reversed distance
  const at::Tensor grad_mlp_in = at::zeros({threads, n.width, shared.reach}, query.options());
  auto grad_w1 = at::zeros({threads, n.width, n.heads}, query.options());  // W1[:, :H]
  auto grad_w2 = at::zeros({threads, n.heads, n.width}, query.options());
  auto grad_b2 = at::zeros({threads, n.heads}, query.options());
  at::parallel_for(0, n.batch * row_tiles, 1, [&](int64_t begin, int64_t end) {
    const int64_t thread = at::get_thread_num();
    TORCH_CHECK(thread < threads, "cape_backward: more threads than buffers");
    const int64_t stride = rows * keys + kSkew;  // between heads' pair blocks
    const int64_t slab_stride = std::max(kSlabPairs, keys) + kSkew;  // between the slab layers' rows
    std::vector<T> z(n.heads * stride), dots(n.heads * stride), prob(n.heads * stride), grad(n.heads * stride),
        grad_z(n.heads * stride);
    std::vector<T> hidden_slab(n.width * slab_stride), grad_a_slab(n.width * slab_stride);
    std::vector<T> scratch(3 * n.width * chunk);
    std::vector<T> part(5 * n.heads * chunk);  // a chunk past the tile's keys: z, dots, prob, dl, dz
    std::vector<T> delta(n.heads * rows), row_log_sum(n.heads), row_delta(n.heads);
    T* dw1 = grad_w1.data_ptr<T>() + thread * n.width * n.heads;
    T* dw2 = grad_w2.data_ptr<T>() + thread * n.heads * n.width;
    T* db2 = grad_b2.data_ptr<T>() + thread * n.heads;
    T* de = grad_mlp_in.data_ptr<T>() + thread * n.width * shared.reach;
    T* dbias = bias_grad ? grad_bias_in.data_ptr<T>() + thread * n.heads * shared.reach : nullptr;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / row_tiles, r0 = order[item % row_tiles] * rows;
      const int64_t r1 = std::min(r0 + rows, n.length), nr = r1 - r0;
      const int64_t batch_row = b * n.heads * n.length;
      for (int64_t h = 0; h < n.heads; ++h) {
        const int64_t at_row = batch_row + h * n.length + r0;
        row_dots(grad_output.data_ptr<T>() + at_row * n.value_dim, output.data_ptr<T>() + at_row * n.value_dim, nr,
                 n.value_dim, delta.data() + h * rows);
      }
      for (int64_t c0 = 0; c0 < r1; c0 += keys) {
        const int64_t c1 = std::min(c0 + keys, r1), nk = c1 - c0, tile = nr * nk;
        for (int64_t h = 0; h < n.heads; ++h) {  // z and dO . v per head
          const int64_t head_row = batch_row + h * n.length;
          times_transposed<T>(query.data_ptr<T>() + (head_row + r0) * n.dim,
                              key.data_ptr<T>() + (head_row + c0) * n.dim, z.data() + h * stride, nr, nk, n.dim,
                              T(scaling), T(0));
          times_transposed<T>(grad_output.data_ptr<T>() + (head_row + r0) * n.value_dim,
                              value.data_ptr<T>() + (head_row + c0) * n.value_dim, dots.data() + h * stride, nr, nk,
                              n.value_dim, T(1), T(0));
        }
        const int64_t slab_rows = std::max<int64_t>(1, kSlabPairs / nk);
        for (int64_t s0 = 0; s0 < nr; s0 += slab_rows) {
          const int64_t s1 = std::min(nr, s0 + slab_rows);
          for (int64_t r = s0; r < s1; ++r) {
            const int64_t i = r0 + r, causal = causal_keys(i, c0, nk);
            for (int64_t h = 0; h < n.heads; ++h) {
              row_log_sum[h] = log_sum.data_ptr<T>()[batch_row + h * n.length + i];
              row_delta[h] = delta[h * rows + r];
            }
            for (int64_t at = 0; at < nk; at += chunk) {
              const int64_t p = r * nk + at, q = (r - s0) * nk + at;
              const int count = std::min<int64_t>(chunk, nk - at);
              const int valid = std::clamp<int64_t>(causal - at, 0, count);
              if (valid == 0) {  // no causal pair: zeros where the products below read
                for (T* block : {prob.data(), grad.data(), grad_z.data()})
                  for (int64_t h = 0; h < n.heads; ++h) std::fill_n(block + h * stride + p, count, T(0));
                for (T* slab : {hidden_slab.data(), grad_a_slab.data()})
                  for (int64_t w = 0; w < n.width; ++w) std::fill_n(slab + w * slab_stride + q, count, T(0));
                continue;
              }
              const int64_t u = n.length - 1 - i + c0 + at;
              // The hidden layer and da straight into the slab (a chunk past the tile's keys writes junk past them,
              // which the next row overwrites or the products below do not read).
              T* hidden = hidden_slab.data() + q;
              T* grad_a = grad_a_slab.data() + q;
              if (count == chunk) {
                cape.backward(z.data() + p, dots.data() + p, stride, u, valid, row_log_sum.data(), row_delta.data(),
                              prob.data() + p, grad.data() + p, grad_z.data() + p, hidden, grad_a, slab_stride,
                              scratch.data(), de, dbias);
              } else {
                T* parts[5];
                for (int k = 0; k < 5; ++k) parts[k] = part.data() + k * n.heads * chunk;
                copy_blocks(z.data() + p, stride, parts[0], chunk, n.heads, count, chunk);
                copy_blocks(dots.data() + p, stride, parts[1], chunk, n.heads, count, chunk);
                cape.backward(parts[0], parts[1], chunk, u, valid, row_log_sum.data(), row_delta.data(), parts[2],
                              parts[3], parts[4], hidden, grad_a, slab_stride, scratch.data(), de, dbias);
                copy_blocks(parts[2], chunk, prob.data() + p, stride, n.heads, count, count);
                copy_blocks(parts[3], chunk, grad.data() + p, stride, n.heads, count, count);
                copy_blocks(parts[4], chunk, grad_z.data() + p, stride, n.heads, count, count);
              }
            }
          }
          // The weights' gradients over the slab's pairs: dW2 += dl hidden^T, dW1[:, :H] += da z^T.
          const int slab = int((s1 - s0) * nk);
          times_transposed<T>(grad.data() + s0 * nk, hidden_slab.data(), dw2, n.heads, n.width, slab, T(1), T(1),
                              stride, slab_stride);
          times_transposed<T>(grad_a_slab.data(), z.data() + s0 * nk, dw1, n.width, n.heads, slab, T(1), T(1),
                              slab_stride, stride);
        }
        for (int64_t h = 0; h < n.heads; ++h) {  // dV += P^T dO; dz into q and k
          const int64_t head_row = batch_row + h * n.length;
          const T* dl = grad.data() + h * stride;
          T total = 0;
#pragma omp simd reduction(+ : total)
          for (int64_t i = 0; i < tile; ++i) total += dl[i];
          db2[h] += total;
          const int64_t own = (thread * n.batch + b) * n.heads * n.length + h * n.length + c0;
          transposed_times<T>(prob.data() + h * stride, nk, grad_output.data_ptr<T>() + (head_row + r0) * n.value_dim,
                              grad_value.data_ptr<T>() + own * n.value_dim, nr, nk, n.value_dim);
          const T* dz = grad_z.data() + h * stride;
          times<T>(dz, nk, key.data_ptr<T>() + (head_row + c0) * n.dim,
                   grad_query.data_ptr<T>() + (head_row + r0) * n.dim, nr, nk, n.dim, T(1));
          transposed_times<T>(dz, nk, query.data_ptr<T>() + (head_row + r0) * n.dim,
                              grad_key.data_ptr<T>() + own * n.dim, nr, nk, n.dim);
        }
      }
    }
  });
  grad_query.mul_(scaling);
  const at::Tensor by_distance_grad = by_distance_from(grad_mlp_in, n.length);  // dE [W, L]
  at::Tensor table_grad_sum = bias_grad ? by_distance_from(grad_bias_in, n.length)
                                        : at::zeros({n.heads, n.length}, query.options());
  if (table_grad) table_grad_sum.addmm_(w1.narrow(1, n.heads, n.heads).t(), by_distance_grad);
  return {grad_query, grad_key.sum(0).mul_(scaling), grad_value.sum(0), table_grad_sum,
          at::cat({grad_w1.sum(0), at::mm(by_distance_grad, table.t())}, 1), by_distance_grad.sum(1),
          grad_w2.sum(0), grad_b2.sum(0)};
}

void check(const char* name, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
           const at::Tensor& table, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
           const at::Tensor& b2, int64_t activation) {
  TORCH_CHECK(query.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(activation == kGelu || activation == kLeakyRelu, name, ": activation 0 (GELU) or 1 (LeakyReLU)");
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
                                     bool table_grad, int64_t activation, double negative_slope, int64_t rows,
                                     int64_t keys) {
  check("cape_forward", query, key, value, table, w1, b1, w2, b2, activation);
  if (query.scalar_type() == at::kDouble)
    return forward_impl<double>(query, key, value, table, w1, b1, w2, b2, scaling, add_bias, activation,
                                negative_slope, rows, keys);
  return forward_impl<float>(query, key, value, table, w1, b1, w2, b2, scaling, add_bias, activation, negative_slope,
                             rows, keys);
}

std::vector<at::Tensor> cape_backward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                      const at::Tensor& table, const at::Tensor& w1, const at::Tensor& b1,
                                      const at::Tensor& w2, const at::Tensor& b2, const at::Tensor& output,
                                      const at::Tensor& log_sum, const at::Tensor& grad_output, double scaling,
                                      bool add_bias, bool table_grad, int64_t activation, double negative_slope,
                                      int64_t rows, int64_t keys) {
  check("cape_backward", query, key, value, table, w1, b1, w2, b2, activation);
  TORCH_CHECK(output.is_contiguous() && grad_output.is_contiguous() && log_sum.is_contiguous(),
              "cape_backward: contiguous saved tensors");
  if (query.scalar_type() == at::kDouble)
    return backward_impl<double>(query, key, value, table, w1, b1, w2, b2, output, log_sum, grad_output, scaling,
                                 add_bias, table_grad, activation, negative_slope, rows, keys);
  return backward_impl<float>(query, key, value, table, w1, b1, w2, b2, output, log_sum, grad_output, scaling,
                              add_bias, table_grad, activation, negative_slope, rows, keys);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_posenc_cpu, m) {
  m.def("cape_forward(Tensor query, Tensor key, Tensor value, Tensor table, Tensor w1, Tensor b1, Tensor w2, "
        "Tensor b2, float scaling, bool add_bias, bool table_grad, int activation, float negative_slope, int rows, "
        "int keys) -> Tensor[]");
  m.def("cape_backward(Tensor query, Tensor key, Tensor value, Tensor table, Tensor w1, Tensor b1, Tensor w2, "
        "Tensor b2, Tensor output, Tensor log_sum, Tensor grad_output, float scaling, bool add_bias, bool table_grad, "
        "int activation, float negative_slope, int rows, int keys) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(hf_posenc_cpu, CPU, m) {
  m.impl("cape_forward", cape_forward);
  m.impl("cape_backward", cape_backward);
}
