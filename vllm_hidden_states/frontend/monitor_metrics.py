# SPDX-License-Identifier: Apache-2.0
"""Firings of the server's probe monitors, counted in vLLM's ``/metrics``.

``vllm:hidden_states_monitor_firings_total{monitor, then}``: one per firing
(a flag at each position where it held, a stop once), counted where the
front-end receives them (:meth:`HiddenStatesTracker.receive`), in the process
that serves ``/metrics``.
"""

from typing import Any

_counter: Any = None


def count_firings(firings: list[Any]) -> None:
    """Count the monitor firings among ``firings`` (``ProbeFiring``)."""
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
