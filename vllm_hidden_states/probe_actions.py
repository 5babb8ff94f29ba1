# SPDX-License-Identifier: Apache-2.0
"""Probe actions and server monitors: the request form and its checks.

A request's ``probe_actions`` (HTTP body field; ``SamplingParams.extra_args``
in Python) is a list of objects::

    {"probe": "harm", "above": 0.8, "for": 2, "then": "stop"}
    {"probe": "topic", "below": -1.5, "output": 1, "then": "flag"}
    {"probe": "harm", "above": 0.8, "then": {"steer": [
        {"point": "resid_pre.3", "op": "add", "name": "calm", "strength": 4}]}}

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

from vllm_hidden_states.contract import Intervention, ProbeAction

FIELD = "probe_actions"
MONITORS_FIELD = "probe_monitors"
THENS: tuple[str, ...] = ("stop", "flag")
STEER = "steer"
# The ops a steer action may turn on: additive ones, whose table row can be
# switched on in the worker without re-arming anything else.
GATED_OPS: tuple[str, ...] = ("add",)
THEN_FORM = '"stop", "flag" or {"steer": [interventions]}'
KEYS: frozenset[str] = frozenset({"probe", "above", "below", "for", "output", "then"})
MAX_ACTIONS = 16
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
FORM = (
    'each action is {"probe": NAME, "above" or "below": a finite number, '
    '"for": n consecutive positions (optional, default 1), "output": the probe '
    'output to read (needed when the probe has several), "then": "stop", "flag" or '
    '{"steer": [interventions as in steering, op "add", no "positions"]}}'
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
    for item, name in zip(value, names):
        if isinstance(item, dict) and isinstance(item.get("then"), dict):
            raise ValueError(
                f"monitor {name!r}: 'then' must be one of {list(THENS)}; a steer action "
                "is a request's own (its probe_actions), not a server monitor's"
            )
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
    steer: list[dict[str, Any]] = []
    if isinstance(then, dict):
        steer = _check_steer(then, where)
        then = STEER
    elif then not in THENS:
        raise ValueError(f"{where}: 'then' must be {THEN_FORM}, got {then!r}")
    return ProbeAction(
        label=name,
        probe=name,
        threshold=float(threshold),
        above=sides[0] == "above",
        column=int(column),
        consecutive=consecutive,
        then=then,
        steer=steer,
    )


def _check_steer(then: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The interventions of ``{"steer": [...]}``, form-checked: what can be
    told without the engine's steering (points, vectors and strengths are
    checked against it by the front-end, as ``steering`` entries)."""
    if set(then) != {STEER}:
        raise ValueError(f"{where}: 'then' must be {THEN_FORM}, got an object with {sorted(then)}")
    items = then[STEER]
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(
            f"{where}: 'then.steer' must be a non-empty list of interventions such as "
            '{"point": "resid_pre.3", "op": "add", "name": "calm", "strength": 4}'
        )
    for j, x in enumerate(items):
        if not isinstance(x, dict):
            raise ValueError(f"{where}: then.steer[{j}] must be an object (a steering entry)")
        if "positions" in x:
            raise ValueError(
                f"{where}: then.steer[{j}]: 'positions' is not allowed in a steer action: "
                "its interventions apply from the generated position after the firing "
                "one to the end of the request"
            )
        op = x.get("op", "add")
        if op not in GATED_OPS:
            raise ValueError(
                f"{where}: then.steer[{j}]: op {op!r} cannot be turned on by a probe "
                f"action; allowed: {list(GATED_OPS)} (additive steering vectors, by "
                "name, inline or sae_feature)"
            )
    return [dict(x) for x in items]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def action_probes(actions: list[ProbeAction], asked: tuple[str, ...]) -> tuple[str, ...]:
    """The probes a request scores: those it asked for, then those only its
    actions read (each once, in first-seen order)."""
    extra = [a.probe for a in actions if a.probe not in asked]
    return (*asked, *dict.fromkeys(extra))


def steered_from(steering: list[Intervention], fired: dict[int, int]) -> list[Intervention]:
    """A request's steering (wire form) once steer actions fired: ``fired``
    maps an action's index to its firing position; that action's gated
    entries become plain ones from the position after it (and not before
    their own start, the first generated position)."""
    return [
        msgspec.structs.replace(item, gate=None, start=max(fired[item.gate.action] + 1, item.start))
        if item.gate is not None and item.gate.action in fired
        else item
        for item in steering
    ]


def steer_action_of(actions: list[ProbeAction], firing: Any, taken: set[int]) -> int | None:
    """The index of the steer action in ``actions`` that ``firing`` (a
    :class:`~vllm_hidden_states.contract.ProbeFiring`) reports: the first
    not in ``taken`` with its label whose condition holds at its score."""
    for i, a in enumerate(actions):
        if i in taken or a.then != STEER or a.label != firing.label:
            continue
        if (firing.score > a.threshold) if a.above else (firing.score < a.threshold):
            return i
    return None
