// SPDX-License-Identifier: Apache-2.0
// The capture and steering ops of vllm_hidden_states._C: declarations shared
// by the CPU translation unit (schemas, CPU and Meta kernels) and the CUDA one.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace vllm_hidden_states {

// The op library's namespace: torch.ops.vllm_hidden_states.<op>.
#define VLLM_HIDDEN_STATES_NS vllm_hidden_states

// out[:n] = ((hidden + residual) * scale)[rows[:n]], n = counts[index].
void capture_cuda(const at::Tensor& hidden, const std::optional<at::Tensor>& residual,
                  const at::Tensor& rows, const at::Tensor& counts, int64_t index,
                  const at::Tensor& out, double scale);

// target[r] += delta(x[r], slot s) / scale for the armed entries of point
// `index` (see steering.py's module doc for the formula).
void steer_cuda(const at::Tensor& target, const std::optional<at::Tensor>& other,
                const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& counts,
                int64_t index, const at::Tensor& adds, const at::Tensor& dirs, double scale,
                const std::optional<at::Tensor>& enc, const std::optional<at::Tensor>& dec,
                const std::optional<at::Tensor>& par);

}  // namespace vllm_hidden_states
