# SPDX-License-Identifier: Apache-2.0
"""Harness shared by the tests and ``benchmarks/`` (not shipped in the wheel):
a ``vllm serve`` process on loopback (:mod:`.server_process`) and a logits
processor that holds a request mid-generation (:mod:`.request_gate`)."""
