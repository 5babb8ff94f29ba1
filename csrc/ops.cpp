// SPDX-License-Identifier: Apache-2.0
// vllm_hidden_states._C: the capture and steering ops as compiled code.
//
// Schemas (the same arguments as torch.ops.vllm.hidden_states_capture and
// torch.ops.vllm.hidden_states_steer, which vLLM's direct_register_custom_op
// infers from worker/capture_points.py and worker/steering.py), the CPU
// kernels, the Meta kernels (no-ops: both ops only mutate an argument, so
// torch.compile's fake tensors and CUDA-graph capture trace them as they
// trace the Python ops), and the module init that lets Python import this
// library as vllm_hidden_states._C. The CUDA kernels are in ops.cu.
//
// CPU kernels read the count as a plain memory read and return at once when
// it is 0: the cost of a forward where nobody asked is one dispatcher call.
// Roundings follow the aten route bit for bit: sums and products in the
// dtype's op-math type (float for half and bfloat16), rounded to the
// output's dtype after each aten op would round.

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/index_add.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/sum.h>
#include <Python.h>
#include <torch/library.h>

#include "ops.h"

namespace vllm_hidden_states {
namespace {

// Rows of at least this many elements in all are copied in parallel.
constexpr int64_t kParallelGrain = 1 << 15;

// counts[i] of an int64 CPU tensor.
int64_t read_count(const at::Tensor& counts, int64_t i, const char* op) {
  TORCH_CHECK(counts.scalar_type() == at::kLong, op, ": counts must be int64, got ",
              counts.scalar_type());
  TORCH_CHECK_INDEX(i >= 0 && i < counts.numel(), op, ": point index ", i, " outside counts [",
                    counts.numel(), "]");
  return counts.const_data_ptr<int64_t>()[i * counts.stride(0)];
}

// `t` viewed as [rows, width] (a view: no copy for the stream's layouts).
at::Tensor as_rows(const at::Tensor& t, int64_t width) { return t.reshape({-1, width}); }

void check_stream(const at::Tensor& t, const at::Tensor& like, const char* what, const char* op) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), op, ": ", what, " is ", t.scalar_type(),
              ", expected ", like.scalar_type());
  TORCH_CHECK(t.device() == like.device(), op, ": ", what, " is on ", t.device(), ", expected ",
              like.device());
}

template <typename scalar_t, bool kUnitStride>
void capture_rows(const scalar_t* h, int64_t hs, int64_t hc, const scalar_t* s, int64_t ss,
                  int64_t sc, const int64_t* rows, int64_t n, scalar_t* o, int64_t os,
                  int64_t oc, int64_t width, double scale) {
  using opmath_t = at::opmath_type<scalar_t>;
  const opmath_t sc_f = static_cast<opmath_t>(scale);
  const bool scaled = scale != 1.0;
  const int64_t grain = std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(width, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t r = rows[j];
      const scalar_t* hr = h + r * hs;
      const scalar_t* sr = s == nullptr ? nullptr : s + r * ss;
      scalar_t* orow = o + j * os;
      for (int64_t c = 0; c < width; ++c) {
        const int64_t hi = kUnitStride ? c : c * hc;
        // The add rounds to the dtype (torch.add(..., out=)), then the
        // scale rounds again (out.mul_(scale)), as the aten route does.
        scalar_t v = sr == nullptr
                         ? hr[hi]
                         : static_cast<scalar_t>(static_cast<opmath_t>(hr[hi]) +
                                                 static_cast<opmath_t>(sr[kUnitStride ? c : c * sc]));
        if (scaled) v = static_cast<scalar_t>(static_cast<opmath_t>(v) * sc_f);
        orow[kUnitStride ? c : c * oc] = v;
      }
    }
  });
}

void capture_cpu(const at::Tensor& hidden, const std::optional<at::Tensor>& residual,
                 const at::Tensor& rows, const at::Tensor& counts, int64_t index,
                 const at::Tensor& out, double scale) {
  const int64_t n = read_count(counts, index, "capture");
  if (n == 0) return;  // nobody asked: this read is the whole cost
  TORCH_CHECK(out.dim() == 2, "capture: out must be [max_rows, width], got ", out.sizes());
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "capture: rows must be int64 [max_rows]");
  TORCH_CHECK_INDEX(n > 0 && n <= rows.size(0) && n <= out.size(0), "capture: count ", n,
                    " outside [0, ", std::min(rows.size(0), out.size(0)), "] (rows/out length)");
  const int64_t width = out.size(1);
  check_stream(hidden, out, "hidden", "capture");
  const at::Tensor h = as_rows(hidden, width);
  at::Tensor s;
  if (residual.has_value()) {
    check_stream(*residual, out, "residual", "capture");
    s = as_rows(*residual, width);
    TORCH_CHECK(s.size(0) == h.size(0), "capture: residual has ", s.size(0), " rows, hidden ",
                h.size(0));
  }
  const int64_t tokens = h.size(0);
  const at::Tensor rows_c = rows.narrow(0, 0, n).contiguous();
  const int64_t* r = rows_c.const_data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK_INDEX(r[j] >= 0 && r[j] < tokens, "capture: row ", r[j], " (entry ", j,
                      ") outside the forward's ", tokens, " tokens");
  }
  const bool unit = h.stride(1) == 1 && out.stride(1) == 1 && (!s.defined() || s.stride(1) == 1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "capture", [&] {
    const scalar_t* sp = s.defined() ? s.const_data_ptr<scalar_t>() : nullptr;
    const int64_t ss = s.defined() ? s.stride(0) : 0, sc = s.defined() ? s.stride(1) : 0;
    auto run = unit ? capture_rows<scalar_t, true> : capture_rows<scalar_t, false>;
    run(h.const_data_ptr<scalar_t>(), h.stride(0), h.stride(1), sp, ss, sc, r, n,
        out.mutable_data_ptr<scalar_t>(), out.stride(0), out.stride(1), width, scale);
  });
}

// The general formula at rows r / slots s, with aten ops in the order the
// Python body uses (so that the dot products reduce as aten reduces them).
void steer_general(const at::Tensor& flat, const std::optional<at::Tensor>& other,
                   const at::Tensor& r, const at::Tensor& s, const at::Tensor& adds,
                   const at::Tensor& dirs, double scale, const std::optional<at::Tensor>& enc,
                   const std::optional<at::Tensor>& dec, const std::optional<at::Tensor>& par) {
  const int64_t width = flat.size(1);
  at::Tensor x = flat.index_select(0, r).to(at::kFloat);
  if (other.has_value()) x = x + as_rows(*other, width).index_select(0, r).to(at::kFloat);
  if (scale != 1.0) x = x * scale;
  const at::Tensor d = dirs.index_select(0, s);
  at::Tensor delta = adds.index_select(0, s) - (x * d).sum(-1, /*keepdim=*/true) * d;
  if (enc.has_value() && dec.has_value() && par.has_value()) {
    const at::Tensor p = par->index_select(0, s);
    const at::Tensor pre = (x * enc->index_select(0, s)).sum(-1) + p.select(1, 0);
    const at::Tensor act = at::relu(pre) * (pre > p.select(1, 1));
    delta = delta + (p.select(1, 2) - act).unsqueeze(1) * dec->index_select(0, s);
  }
  if (scale != 1.0) delta = delta / scale;
  flat.index_add_(0, r, delta.to(flat.scalar_type()));
}

void steer_cpu(const at::Tensor& target, const std::optional<at::Tensor>& other,
               const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& counts,
               int64_t index, const at::Tensor& adds, const at::Tensor& dirs, double scale,
               const std::optional<at::Tensor>& enc, const std::optional<at::Tensor>& dec,
               const std::optional<at::Tensor>& par) {
  const int64_t n = read_count(counts, index, "steer");
  if (n == 0) return;  // nobody steers here: this read is the whole cost
  const int64_t width = target.size(-1);
  TORCH_CHECK(rows.dim() == 2 && slots.sizes() == rows.sizes() && rows.scalar_type() == at::kLong &&
                  slots.scalar_type() == at::kLong,
              "steer: rows and slots must be int64 [points, max_tokens]");
  TORCH_CHECK_INDEX(index < rows.size(0) && n <= rows.size(1), "steer: count ", n, " at point ",
                    index, " outside rows ", rows.sizes());
  TORCH_CHECK(adds.scalar_type() == at::kFloat && dirs.scalar_type() == at::kFloat &&
                  adds.dim() == 2 && adds.size(1) == width && adds.is_contiguous(),
              "steer: adds/dirs must be contiguous float32 [slots, ", width, "]");
  if (other.has_value()) check_stream(*other, target, "other", "steer");
  // A view: the add lands in target.
  const at::Tensor flat = target.view({-1, width});
  const at::Tensor r = rows.select(0, index).narrow(0, 0, n);
  const at::Tensor s = slots.select(0, index).narrow(0, 0, n);
  const int64_t tokens = flat.size(0), num_slots = adds.size(0);
  const at::Tensor r_c = r.contiguous(), s_c = s.contiguous();
  const int64_t* rp = r_c.const_data_ptr<int64_t>();
  const int64_t* sp = s_c.const_data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK_INDEX(rp[j] >= 0 && rp[j] < tokens, "steer: row ", rp[j], " (entry ", j,
                      ") outside the forward's ", tokens, " tokens");
    TORCH_CHECK_INDEX(sp[j] >= 0 && sp[j] < num_slots, "steer: slot ", sp[j], " outside the ",
                      num_slots, " table slots");
  }
  if (read_count(counts, counts.size(0) / 2 + index, "steer") != 0) {
    steer_general(flat, other, r, s, adds, dirs, scale, enc, dec, par);
    return;
  }
  // Only adds armed at this point: target[r] += round(adds[s] / scale), the
  // delta rounded to the target's dtype before the add, as index_add_ of the
  // rounded delta does.
  TORCH_CHECK(flat.stride(1) == 1, "steer: target must have unit stride along its width");
  const float* ap = adds.const_data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const bool scaled = scale != 1.0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "steer", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    scalar_t* tp = flat.mutable_data_ptr<scalar_t>();
    const int64_t ts = flat.stride(0);
    for (int64_t j = 0; j < n; ++j) {
      scalar_t* row = tp + rp[j] * ts;
      const float* a = ap + sp[j] * width;
      for (int64_t c = 0; c < width; ++c) {
        const scalar_t d = static_cast<scalar_t>(scaled ? a[c] / sc : a[c]);
        row[c] = static_cast<scalar_t>(static_cast<opmath_t>(row[c]) + static_cast<opmath_t>(d));
      }
    }
  });
}

// Meta (fake) kernels: both ops only write into an argument, whose shape and
// dtype do not change.
void capture_meta(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                  const at::Tensor&, int64_t, const at::Tensor&, double) {}

void steer_meta(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&,
                const at::Tensor&, double, const std::optional<at::Tensor>&,
                const std::optional<at::Tensor>&, const std::optional<at::Tensor>&) {}

}  // namespace
}  // namespace vllm_hidden_states

TORCH_LIBRARY(vllm_hidden_states, m) {
  m.def(
      "capture(Tensor hidden, Tensor? residual, Tensor rows, Tensor counts, SymInt index, "
      "Tensor(a!) out, float scale) -> ()");
  m.def(
      "steer(Tensor(a!) target, Tensor? other, Tensor rows, Tensor slots, Tensor counts, "
      "SymInt index, Tensor adds, Tensor dirs, float scale, Tensor? enc=None, Tensor? dec=None, "
      "Tensor? par=None) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_hidden_states, CPU, m) {
  m.impl("capture", &vllm_hidden_states::capture_cpu);
  m.impl("steer", &vllm_hidden_states::steer_cpu);
}

TORCH_LIBRARY_IMPL(vllm_hidden_states, Meta, m) {
  m.impl("capture", &vllm_hidden_states::capture_meta);
  m.impl("steer", &vllm_hidden_states::steer_meta);
}

// `import vllm_hidden_states._C` loads this library (registering the ops
// above) and gets an empty module: the ops are reached through torch.ops.
PyMODINIT_FUNC PyInit__C() {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C",
                               "vllm_hidden_states' compiled ops (torch.ops.vllm_hidden_states)",
                               -1, nullptr};
  return PyModule_Create(&module);
}
