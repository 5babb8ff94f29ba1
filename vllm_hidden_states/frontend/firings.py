# SPDX-License-Identifier: Apache-2.0
"""Where probe action firings go in the front-end beside the output: the
server monitors' counted in vLLM's ``/metrics``, every firing written to the
activation store when the server has one.

``vllm:hidden_states_monitor_firings_total{monitor, then}``: one per firing
of a server monitor (a flag at each position where it held, a stop once),
counted in the process that serves ``/metrics``; the store's
``probe_firings`` table: a row per firing (``store/activation_store.py``).
"""

from typing import Any

_counter: Any = None
# The served model's name, for the store's rows (set by the API server).
model_id = ""


def record_firings(request_id: str, firings: list[Any]) -> None:
    """Count the monitor firings among ``firings`` (``ProbeFiring``) and
    queue every one for the activation store (if open; never blocks)."""
    global _counter
    for firing in firings:
        if not firing.monitor:
            continue
        if _counter is None:
            from prometheus_client import Counter

            _counter = Counter(
                "vllm:hidden_states_monitor_firings",
                "Firings of the server's probe monitors (--monitors), by monitor and action.",
                labelnames=["monitor", "then"],
            )
        _counter.labels(monitor=firing.label, then=firing.then).inc()
    from vllm_hidden_states.store import choice_writer

    store, _ = choice_writer.opened()
    if store is not None and firings:
        store.append_firings(request_id, model_id=model_id, firings=firings)
