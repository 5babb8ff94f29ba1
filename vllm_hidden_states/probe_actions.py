# SPDX-License-Identifier: Apache-2.0
"""Probe actions and server monitors: the request form and its checks.

A request's ``probe_actions`` (HTTP body field; ``SamplingParams.extra_args``
in Python) is a list of objects::

    {"probe": "harm", "above": 0.8, "for": 2, "then": "stop"}
    {"probe": "topic", "below": -1.5, "output": 1, "then": "flag"}

The engine scores the probe at every position the request's positions
cover, in the step that computes it, and decides there
(``engine/probe_actions.py``); this module turns the request form into
:class:`~vllm_hidden_states.contract.ProbeAction` structs or says what is
wrong and what is allowed. A server monitor (``--monitors FILE``) is the
same object with a ``"name"``; the API server puts the monitors on every
request it serves (``extra_args["probe_monitors"]``). It imports neither
vLLM nor torch.
"""

import math
import re
from typing import Any

import msgspec

from vllm_hidden_states.contract import ProbeAction

FIELD = "probe_actions"
MONITORS_FIELD = "probe_monitors"
THENS: tuple[str, ...] = ("stop", "flag")
KEYS: frozenset[str] = frozenset({"probe", "above", "below", "for", "output", "then"})
MAX_ACTIONS = 16
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
FORM = (
    'each action is {"probe": NAME, "above" or "below": a finite number, '
    '"for": n consecutive positions (optional, default 1), "output": the probe '
    'output to read (needed when the probe has several), "then": "stop" or "flag"}'
)


def check_probe_actions(value: Any, probes: dict[str, dict[str, Any]]) -> list[ProbeAction]:
    """``probe_actions`` checked against the engine's ``probes`` (name ->
    its entry, with ``k``); ValueError naming the action, what was wrong
    and what is allowed."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{FIELD} must be a non-empty list of actions; {FORM}; got {value!r}")
    if len(value) > MAX_ACTIONS:
        raise ValueError(f"{FIELD} holds {len(value)} actions; at most {MAX_ACTIONS} are allowed")
    return [_check_one(item, i, probes) for i, item in enumerate(value)]


def check_monitors(value: Any, probes: dict[str, dict[str, Any]]) -> list[ProbeAction]:
    """Server monitors (each an action with a ``"name"``, its label) checked
    against the engine's ``probes``; ValueError naming the monitor."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"monitors must be a non-empty list of named actions; {FORM}")
    names = [item.get("name") if isinstance(item, dict) else None for item in value]
    for i, name in enumerate(names):
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(
                f"monitor {i}: 'name' must be a plain name (letters, digits, '_', '-', "
                f"'.'), got {name!r}"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"monitor names must be distinct, got {names}")
    return [
        msgspec.structs.replace(
            _check_one(
                {k: v for k, v in item.items() if k != "name"}, i, probes, f"monitor {name!r}"
            ),
            label=name,
            monitor=True,
        )
        for i, (item, name) in enumerate(zip(value, names))
    ]


def _check_one(
    item: Any, i: int, probes: dict[str, dict[str, Any]], where: str = ""
) -> ProbeAction:
    where = where or f"{FIELD}[{i}]"
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be an object; {FORM}; got {item!r}")
    unknown = sorted(set(item) - KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; {FORM}")
    name = item.get("probe")
    if not isinstance(name, str):
        raise ValueError(f"{where}: 'probe' must be a probe name; {FORM}")
    if not probes:
        raise ValueError(
            f"{where}: this engine has no probes; start it with probes=DIR "
            "(LLM / EngineArgs) or `vllm serve MODEL --probes DIR`"
        )
    if name not in probes:
        raise ValueError(
            f"{where}: probe {name!r} is not loaded on this engine; available probes: "
            f"{sorted(probes)} (GET /v1/probes lists them)"
        )
    sides = [side for side in ("above", "below") if side in item]
    if len(sides) != 1:
        raise ValueError(f"{where}: give exactly one of 'above' and 'below'; {FORM}")
    threshold = item[sides[0]]
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise ValueError(f"{where}: {sides[0]!r} must be a number, got {threshold!r}")
    if not math.isfinite(threshold):
        raise ValueError(f"{where}: {sides[0]!r} must be finite, got {threshold!r}")
    k = int(probes[name]["k"])
    column: Any = item.get("output", 0 if k == 1 else None)
    if not (_is_int(column) and 0 <= column < k):
        raise ValueError(
            f"{where}: probe {name!r} has {k} outputs; 'output' must be an integer "
            f"in 0..{k - 1}" + (" (needed when a probe has several)" if k > 1 else "")
        )
    consecutive = item.get("for", 1)
    if not _is_int(consecutive) or consecutive < 1:
        raise ValueError(f"{where}: 'for' must be an integer >= 1, got {consecutive!r}")
    then = item.get("then", "stop")
    if isinstance(then, dict) and "steer" in then:
        raise ValueError(
            f"{where}: 'then': {{'steer': ...}} is not supported yet; 'then' must be "
            f"one of {list(THENS)}"
        )
    if then not in THENS:
        raise ValueError(f"{where}: 'then' must be one of {list(THENS)}, got {then!r}")
    return ProbeAction(
        label=name,
        probe=name,
        threshold=float(threshold),
        above=sides[0] == "above",
        column=int(column),
        consecutive=consecutive,
        then=then,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def action_probes(actions: list[ProbeAction], asked: tuple[str, ...]) -> tuple[str, ...]:
    """The probes a request scores: those it asked for, then those only its
    actions read (each once, in first-seen order)."""
    extra = [a.probe for a in actions if a.probe not in asked]
    return (*asked, *dict.fromkeys(extra))
