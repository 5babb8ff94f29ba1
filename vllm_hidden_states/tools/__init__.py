# SPDX-License-Identifier: Apache-2.0
"""Commands around the product, not part of serving: the ``vllm-hidden-states``
console script (:mod:`.cli`), the patch tool (:mod:`.patching`), tiny
random-weight models (:mod:`.tiny_models`) and ``make serve`` (:mod:`.serve`)."""
