# SPDX-License-Identifier: Apache-2.0
"""vllm-hidden-states: per-request hidden states for vLLM 0.32 v1.

Layer index ``k`` follows HF transformers' ``output_hidden_states[k]``:
0 = embedding output, 1..L-1 = residual stream after decoder layer k,
L = -1 = final post-norm state (the LM-head input).
"""

__version__ = "0.1.0"
