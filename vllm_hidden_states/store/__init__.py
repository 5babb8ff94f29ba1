# SPDX-License-Identifier: Apache-2.0
"""Writing hidden states and SAE features to disk, off the engine's path.

* :mod:`.parquet_shards`: the harvest writer behind ``vllm-hidden-states
  collect`` (one row per token per layer, sharded Parquet or safetensors, a
  manifest that makes a rerun skip finished documents).
* :mod:`.activation_store`: the server-side activation store (top-k SAE
  features, optionally hidden states, per request; date partitions, retention,
  DuckDB queries).
* :mod:`.choice_writer`: the API server's finished choices appended to that
  store.

The stores need the ``store`` extra (``pip install vllm-hidden-states[store]``:
pyarrow, duckdb, safetensors); none of them imports vLLM or torch at import time.
"""
