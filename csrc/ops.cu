// SPDX-License-Identifier: Apache-2.0
// CUDA kernels of vllm_hidden_states._C (built where nvcc and a CUDA torch
// are found; schemas and CPU kernels in ops.cpp).
//
// Off CPU the count cannot be read on the host without a sync (nor at all
// inside CUDA-graph capture), so each op launches one kernel of one block
// per entry a forward of this many tokens can have; every block reads the
// point's count on the device and returns at once past it. A forward where
// nobody asked is one near-empty launch per point, replayed inside the CUDA
// graph without Python or the dispatcher. Only the current stream is used.

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops.h"

namespace vllm_hidden_states {
namespace {

constexpr int kThreads = 256;

// Block j < counts[index]: out[j] = (hidden[rows[j]] + residual[rows[j]]) *
// scale, the add rounded to the dtype, then the product rounded again (the
// aten route's roundings: bit for bit).
template <typename scalar_t>
__global__ void capture_kernel(const scalar_t* __restrict__ hidden,
                               const scalar_t* __restrict__ residual,
                               const int64_t* __restrict__ rows,
                               const int64_t* __restrict__ counts, scalar_t* __restrict__ out,
                               int64_t index, int64_t width, int64_t hs, int64_t rs, int64_t os,
                               at::opmath_type<scalar_t> scale, bool scaled) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t j = blockIdx.x;
  if (j >= counts[index]) return;
  const int64_t r = rows[j];
  const scalar_t* h = hidden + r * hs;
  const scalar_t* s = residual == nullptr ? nullptr : residual + r * rs;
  scalar_t* o = out + j * os;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    scalar_t v = s == nullptr ? h[c]
                              : static_cast<scalar_t>(static_cast<opmath_t>(h[c]) +
                                                      static_cast<opmath_t>(s[c]));
    if (scaled) v = static_cast<scalar_t>(static_cast<opmath_t>(v) * scale);
    o[c] = v;
  }
}

// Sum of one float per thread over the block (kThreads threads).
__device__ float block_sum(float v, float* shared) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffff, v, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // shared may still be read from a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) total += shared[w];
  return total;
}

// Block j < counts[index] with slot s != 0 steers row r = rows[j]: x = (t +
// other) * scale in float32; target[r] += round((adds[s] - (x . dirs[s])
// dirs[s] + (value - act(x . enc[s] + bias)) dec[s]) / scale). Without a
// projection armed at this point (counts[points + index] == 0) only adds[s]
// / scale, bit for bit as the aten route.
template <typename scalar_t>
__global__ void steer_kernel(scalar_t* __restrict__ target, const scalar_t* __restrict__ other,
                             const int64_t* __restrict__ rows, const int64_t* __restrict__ slots,
                             const int64_t* __restrict__ counts, int64_t points, int64_t index,
                             const float* __restrict__ adds, const float* __restrict__ dirs,
                             const float* __restrict__ enc, const float* __restrict__ dec,
                             const float* __restrict__ par, int64_t width, int64_t ts,
                             int64_t os, float scale) {
  using opmath_t = at::opmath_type<scalar_t>;
  __shared__ float shared[kThreads / 32];
  const int64_t j = blockIdx.x;
  if (j >= counts[index]) return;
  const int64_t s = slots[j];
  if (s == 0) return;
  scalar_t* t = target + rows[j] * ts;
  const scalar_t* o = other == nullptr ? nullptr : other + rows[j] * os;
  const float* a = adds + s * width;
  const bool scaled = scale != 1.f;
  // aten on CUDA divides a tensor by a host scalar as a product with the
  // scalar's reciprocal (computed in float): the same here, bit for bit.
  const float inv_scale = 1.f / scale;
  if (counts[points + index] == 0) {
    for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
      const scalar_t d = static_cast<scalar_t>(scaled ? a[c] * inv_scale : a[c]);
      t[c] = static_cast<scalar_t>(static_cast<opmath_t>(t[c]) + static_cast<opmath_t>(d));
    }
    return;
  }
  const float* d = dirs + s * width;
  const float* e = enc == nullptr ? nullptr : enc + s * width;
  float dot_d = 0.f, dot_e = 0.f;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    float x = static_cast<float>(t[c]);
    if (o != nullptr) x += static_cast<float>(o[c]);
    if (scaled) x *= scale;
    dot_d += x * d[c];
    if (e != nullptr) dot_e += x * e[c];
  }
  const float proj = block_sum(dot_d, shared);
  float coef = 0.f;
  if (e != nullptr) {
    const float pre = block_sum(dot_e, shared) + par[s * 3];
    const float act = pre > par[s * 3 + 1] ? fmaxf(pre, 0.f) : 0.f;
    coef = par[s * 3 + 2] - act;
  }
  const float* dc = e == nullptr ? nullptr : dec + s * width;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    float delta = a[c] - proj * d[c];
    if (dc != nullptr) delta += coef * dc[c];
    if (scaled) delta *= inv_scale;
    const scalar_t rounded = static_cast<scalar_t>(delta);
    t[c] = static_cast<scalar_t>(static_cast<opmath_t>(t[c]) + static_cast<opmath_t>(rounded));
  }
}

}  // namespace

void capture_cuda(const at::Tensor& hidden, const std::optional<at::Tensor>& residual,
                  const at::Tensor& rows, const at::Tensor& counts, int64_t index,
                  const at::Tensor& out, double scale) {
  const int64_t width = out.size(-1);
  const at::Tensor h = hidden.reshape({-1, width});
  const at::Tensor s = residual.has_value() ? residual->reshape({-1, width}) : at::Tensor();
  TORCH_CHECK(h.stride(1) == 1 && out.stride(1) == 1 && (!s.defined() || s.stride(1) == 1),
              "capture (CUDA): tensors must have unit stride along their width");
  TORCH_CHECK(rows.is_contiguous() && counts.is_contiguous() && rows.scalar_type() == at::kLong &&
                  counts.scalar_type() == at::kLong,
              "capture (CUDA): rows and counts must be contiguous int64");
  TORCH_CHECK(h.scalar_type() == out.scalar_type() &&
                  (!s.defined() || s.scalar_type() == out.scalar_type()),
              "capture (CUDA): hidden, residual and out must share a dtype");
  // Static per CUDA graph, as the token count is.
  const int64_t grid = std::min(rows.size(0), h.size(0));
  if (grid == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "capture_cuda", [&] {
    capture_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
        h.const_data_ptr<scalar_t>(), s.defined() ? s.const_data_ptr<scalar_t>() : nullptr,
        rows.const_data_ptr<int64_t>(), counts.const_data_ptr<int64_t>(),
        out.mutable_data_ptr<scalar_t>(), index, width, h.stride(0),
        s.defined() ? s.stride(0) : 0, out.stride(0),
        static_cast<at::opmath_type<scalar_t>>(scale), scale != 1.0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void steer_cuda(const at::Tensor& target, const std::optional<at::Tensor>& other,
                const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& counts,
                int64_t index, const at::Tensor& adds, const at::Tensor& dirs, double scale,
                const std::optional<at::Tensor>& enc, const std::optional<at::Tensor>& dec,
                const std::optional<at::Tensor>& par) {
  const int64_t width = target.size(-1);
  const at::Tensor flat = target.view({-1, width});
  const at::Tensor o = other.has_value() ? other->reshape({-1, width}) : at::Tensor();
  TORCH_CHECK(flat.stride(1) == 1 && (!o.defined() || o.stride(1) == 1),
              "steer (CUDA): target and other must have unit stride along their width");
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous() && slots.is_contiguous() &&
                  counts.is_contiguous() && adds.is_contiguous() && dirs.is_contiguous() &&
                  adds.scalar_type() == at::kFloat,
              "steer (CUDA): rows/slots/counts and float32 tables must be contiguous");
  const bool clamp = enc.has_value() && dec.has_value() && par.has_value();
  const int64_t grid = std::min(rows.size(1), flat.size(0));
  if (grid == 0) return;
  const c10::cuda::CUDAGuard guard(target.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t offset = index * rows.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "steer_cuda", [&] {
    steer_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
        flat.mutable_data_ptr<scalar_t>(), o.defined() ? o.const_data_ptr<scalar_t>() : nullptr,
        rows.const_data_ptr<int64_t>() + offset, slots.const_data_ptr<int64_t>() + offset,
        counts.const_data_ptr<int64_t>(), counts.size(0) / 2, index,
        adds.const_data_ptr<float>(), dirs.const_data_ptr<float>(),
        clamp ? enc->const_data_ptr<float>() : nullptr,
        clamp ? dec->const_data_ptr<float>() : nullptr,
        clamp ? par->const_data_ptr<float>() : nullptr, width, flat.stride(0),
        o.defined() ? o.stride(0) : 0, static_cast<float>(scale));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace vllm_hidden_states

TORCH_LIBRARY_IMPL(vllm_hidden_states, CUDA, m) {
  m.impl("capture", &vllm_hidden_states::capture_cuda);
  m.impl("steer", &vllm_hidden_states::steer_cuda);
}
