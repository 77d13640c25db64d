// The decoder layers of a row-exact cached pass over one chain of tokens (one sequence, positions start ..
// start + T - 1), in C++: the same ATen operations on the same shapes as the Python layers (transformer.py's
// DecoderLayer, Attention, MLP, RMSNorm, apply_rope, KVCache.update; block_rows.py's BlockLinear) and the same
// custom kernels (specdraft::block_tiles_mm / block_rows_mm, specdraft::row_attention), called in the same order,
// so every output has the Python layers' bits; only the interpreter's work between them is gone (~120 Python
// calls a layer). Used for one-token steps, verify chains and prefills; tree passes and batches keep the Python
// layers, and give the same bits (tests/test_row_step.py).
//
// plan (ints): heads, kv heads, head size, q/k norms (0/1), layers, then per layer its four products
// (q/k/v, o, gate/up, down), each: parts, has bias, outputs it splits into (count, then sizes), per part: kind
// (0 tiles: one tensor; 1 rows: five), format, outputs, kernel path.
// weights (tensors), per layer: input norm, post-attention norm, [q norm, k norm], then the products' part
// tensors in order, each product's bias after its parts.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <vector>

namespace {

using TilesMm = at::Tensor(const at::Tensor&, int64_t, const at::Tensor&, int64_t, int64_t);
using RowsMm = at::Tensor(const at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, int64_t);
using Attend = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                          int64_t);

template <class F>
c10::TypedOperatorHandle<F> op(const char* name) {  // registered by the other kernels' extensions
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

struct Reader {  // the plan and weights, read in order
  at::IntArrayRef plan;
  at::TensorList w;
  size_t p = 0, t = 0;
  int64_t next() {
    TORCH_CHECK(p < plan.size(), "row_step: the plan ends early");
    return plan[p++];
  }
  const at::Tensor& tensor() {
    TORCH_CHECK(t < w.size(), "row_step: the weights end early");
    return w[t++];
  }
};

// BlockLinear.forward then Stacked's split: x [1, T, K] -> its outputs (one tensor, or the split's views)
std::vector<at::Tensor> product(const at::Tensor& x, Reader& r) {
  static const auto tiles = op<TilesMm>("specdraft::block_tiles_mm");
  static const auto rows_mm = op<RowsMm>("specdraft::block_rows_mm");
  const int64_t parts = r.next(), has_bias = r.next(), splits = r.next();
  std::vector<int64_t> sizes;
  for (int64_t i = 0; i < splits; ++i) sizes.push_back(r.next());
  const auto rows = x.reshape({-1, x.size(-1)});
  std::vector<at::Tensor> outs;
  for (int64_t i = 0; i < parts; ++i) {
    const int64_t kind = r.next(), format = r.next(), n = r.next(), path = r.next();
    if (kind == 0) {
      outs.push_back(tiles.call(rows, format, r.tensor(), n, path));
    } else {
      const auto& q = r.tensor();
      const auto& sc = r.tensor();
      const auto& mn = r.tensor();
      const auto& d = r.tensor();
      const auto& dm = r.tensor();
      outs.push_back(rows_mm.call(rows, format, q, sc, mn, d, dm, path));
    }
  }
  auto y = outs.size() == 1 ? outs[0] : at::cat(outs, -1);
  if (has_bias) y.add_(r.tensor());
  y = y.reshape({x.size(0), x.size(1), y.size(-1)});
  if (splits == 0) return {y};
  return y.split_with_sizes(sizes, -1);
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t h = x.size(-1) / 2;
  const auto rot = at::cat({at::neg(x.slice(-1, h)), x.slice(-1, 0, h)}, -1);
  return x * cos + rot * sin;
}

at::Tensor row_step(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, int64_t start,
                    at::TensorList weights, at::IntArrayRef plan, at::TensorList keys, at::TensorList values,
                    double eps) {
  static const auto attend = op<Attend>("specdraft::row_attention");
  Reader r{plan, weights};
  const int64_t nh = r.next(), nkv = r.next(), hd = r.next(), qk_norm = r.next(), layers = r.next();
  TORCH_CHECK(x_in.dim() == 3 && x_in.size(0) == 1, "row_step: x must be [1, T, hidden]");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == layers && static_cast<int64_t>(values.size()) == layers,
              "row_step: one key and one value buffer a layer");
  const int64_t T = x_in.size(1), H = x_in.size(2);
  TORCH_CHECK(start >= 0 && start + T <= keys[0].size(2), "row_step: positions ", start, "..", start + T - 1,
              " exceed the cache's ", keys[0].size(2), " slots");
  // query (head, t) reads slots 0 .. start + t (Attention's row calls: RowGroups, _RowCall.lengths)
  const auto lengths = at::arange(start + 1, start + T + 1, at::kLong).repeat({nh});
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  auto x = x_in;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const auto& in_norm = r.tensor();
    const auto& post_norm = r.tensor();
    const at::Tensor* qn = qk_norm ? &r.tensor() : nullptr;
    const at::Tensor* kn = qk_norm ? &r.tensor() : nullptr;
    // attention
    auto qkv = product(at::rms_norm(x, {H}, in_norm, eps), r);
    auto q = qkv[0].view({1, T, nh, hd}), k = qkv[1].view({1, T, nkv, hd}), v = qkv[2].view({1, T, nkv, hd});
    if (qk_norm) {
      q = at::rms_norm(q, {hd}, *qn, eps);
      k = at::rms_norm(k, {hd}, *kn, eps);
    }
    q = rope(q.transpose(1, 2), cos, sin);
    k = rope(k.transpose(1, 2), cos, sin);
    v = v.transpose(1, 2);
    keys[layer].slice(2, start, start + T).copy_(k);
    values[layer].slice(2, start, start + T).copy_(v);
    const auto y = attend.call(q.reshape({nh * T, hd}), keys[layer][0], values[layer][0], lengths, scale, 0)
                       .view({1, nh, T, hd});
    x = x + product(y.transpose(1, 2).reshape({1, T, nh * hd}), r)[0];
    // MLP
    const auto gate_up = product(at::rms_norm(x, {H}, post_norm, eps), r);
    x = x + product(at::silu(gate_up[0]) * gate_up[1], r)[0];
  }
  TORCH_CHECK(r.p == plan.size() && r.t == weights.size(), "row_step: the plan and weights are longer than ",
              layers, " layers");
  return x;
}

}  // namespace

TORCH_LIBRARY_IMPL(specdraft, CPU, m) { m.impl("row_step", row_step); }
