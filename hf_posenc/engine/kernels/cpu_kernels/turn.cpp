// Queries or keys turned by per-token position features, forward and backward, for the CPU (TAPE, methods/tape.py):
// per rotary plane k (dimensions k and k + d/2 of the half-split layout) out = x * z as complex numbers, z = c + i s
// per (batch, key-value head, token, plane), shared by the `group` heads of x that use one key-value head; the
// dimensions past the features' d pass through. One pass over the tensors each way, where the eager form (repeat the
// features per head, concatenate, rotate, multiply, add; and each one's backward) takes about ten.

#include "tiles.h"

namespace {

struct TurnShape {
  int64_t batch, heads, tokens, dim, kv_heads, feature_dim, group;
  int64_t stride_b, stride_h, stride_t;  // x's (its last dimension is contiguous)
};

TurnShape turn_shape(const char* name, const at::Tensor& x, const at::Tensor& features) {
  TORCH_CHECK(x.dim() == 4 && features.dim() == 4, name, ": x [B, H, n, D] and features [B, G, n, d]");
  TORCH_CHECK(x.scalar_type() == features.scalar_type(), name, ": x and features of one dtype");
  TORCH_CHECK(features.is_contiguous() && x.stride(3) == 1, name, ": contiguous features, x contiguous per row");
  TurnShape s{x.size(0), x.size(1), x.size(2), x.size(3), features.size(1), features.size(3), 0,
              x.stride(0), x.stride(1), x.stride(2)};
  TORCH_CHECK(features.size(0) == s.batch && features.size(2) == s.tokens && s.kv_heads > 0 &&
                  s.heads % s.kv_heads == 0 && s.feature_dim % 2 == 0 && s.feature_dim <= s.dim,
              name, ": features [B, G, n, d] with G dividing H and an even d <= D");
  s.group = s.heads / s.kv_heads;
  return s;
}

// Items are (batch, key-value head, token): each reads its features once and handles the group's heads, so the
// backward's features gradient (a sum over the group) needs no reduction across threads. `start(item)` runs first,
// then `row(item, x_row, out_row)` per head of the group: x's row offset (strided) and the contiguous [B, H, n, D]
// outputs' row offset.
template <typename Start, typename Row>
void for_each_item(const TurnShape& s, Start start, Row row) {
  at::parallel_for(0, s.batch * s.kv_heads * s.tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item % s.tokens, bg = item / s.tokens, b = bg / s.kv_heads, g = bg % s.kv_heads;
      start(item);
      for (int64_t h = g * s.group; h < (g + 1) * s.group; ++h)
        row(item, b * s.stride_b + h * s.stride_h + t * s.stride_t, ((b * s.heads + h) * s.tokens + t) * s.dim);
    }
  });
}

template <typename T>
void forward_impl(const TurnShape& s, const T* x, const T* features, T* out) {
  const int64_t half = s.feature_dim / 2;
  for_each_item(s, [](int64_t) {}, [=](int64_t item, int64_t x_row, int64_t out_row) {
    const T* c = features + item * s.feature_dim;
    const T* sn = c + half;
    const T* xr = x + x_row;
    T* o = out + out_row;
    for (int64_t k = 0; k < half; ++k) {
      const T x1 = xr[k], x2 = xr[half + k];
      o[k] = x1 * c[k] - x2 * sn[k];
      o[half + k] = x2 * c[k] + x1 * sn[k];
    }
    std::copy(xr + s.feature_dim, xr + s.dim, o + s.feature_dim);
  });
}

template <typename T>
void backward_impl(const TurnShape& s, const T* x, const T* features, const T* grad_out, T* grad_x,
                   T* grad_features) {
  const int64_t half = s.feature_dim / 2;
  for_each_item(
      s, [=](int64_t item) { std::fill_n(grad_features + item * s.feature_dim, s.feature_dim, T(0)); },
      [=](int64_t item, int64_t x_row, int64_t out_row) {
        const T* c = features + item * s.feature_dim;
        const T* sn = c + half;
        T* gc = grad_features + item * s.feature_dim;
        T* gs = gc + half;
        const T* xr = x + x_row;
        const T* go = grad_out + out_row;
        T* gx = grad_x + out_row;
        for (int64_t k = 0; k < half; ++k) {
          const T x1 = xr[k], x2 = xr[half + k], g1 = go[k], g2 = go[half + k];
          gx[k] = g1 * c[k] + g2 * sn[k];
          gx[half + k] = g2 * c[k] - g1 * sn[k];
          gc[k] += g1 * x1 + g2 * x2;
          gs[k] += g2 * x1 - g1 * x2;
        }
        std::copy(go + s.feature_dim, go + s.dim, gx + s.feature_dim);
      });
}

at::Tensor turn_forward(const at::Tensor& x, const at::Tensor& features) {
  const TurnShape s = turn_shape("turn_forward", x, features);
  auto out = at::empty({s.batch, s.heads, s.tokens, s.dim}, x.options());
  if (x.scalar_type() == at::kDouble)
    forward_impl<double>(s, x.data_ptr<double>(), features.data_ptr<double>(), out.data_ptr<double>());
  else
    forward_impl<float>(s, x.data_ptr<float>(), features.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

std::vector<at::Tensor> turn_backward(const at::Tensor& x, const at::Tensor& features, const at::Tensor& grad_out) {
  const TurnShape s = turn_shape("turn_backward", x, features);
  TORCH_CHECK(grad_out.is_contiguous() && grad_out.sizes() == at::IntArrayRef({s.batch, s.heads, s.tokens, s.dim}),
              "turn_backward: a contiguous grad_out of x's shape");
  auto grad_x = at::empty({s.batch, s.heads, s.tokens, s.dim}, x.options());
  auto grad_features = at::empty_like(features);
  if (x.scalar_type() == at::kDouble)
    backward_impl<double>(s, x.data_ptr<double>(), features.data_ptr<double>(), grad_out.data_ptr<double>(),
                          grad_x.data_ptr<double>(), grad_features.data_ptr<double>());
  else
    backward_impl<float>(s, x.data_ptr<float>(), features.data_ptr<float>(), grad_out.data_ptr<float>(),
                         grad_x.data_ptr<float>(), grad_features.data_ptr<float>());
  return {grad_x, grad_features};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_posenc_cpu, m) {
  m.def("turn_forward(Tensor x, Tensor features) -> Tensor");
  m.def("turn_backward(Tensor x, Tensor features, Tensor grad_out) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(hf_posenc_cpu, CPU, m) {
  m.impl("turn_forward", turn_forward);
  m.impl("turn_backward", turn_backward);
}
