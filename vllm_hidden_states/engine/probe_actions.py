# SPDX-License-Identifier: Apache-2.0
"""Probe actions decided in the engine process, in the step that scored them.

:class:`ActionWatch` lives on the scheduler's
:class:`~vllm_hidden_states.engine.planner.CapturePlanner`. In
``update_from_output`` it reads the probe scores of the step's captured
row groups (float32 ``[rows, sum of k]``, already on the host) for the
requests that carry actions, and:

* ``"stop"``: the request finishes in this step. Its output keeps the tokens
  up to the firing position; the token sampled from it is dropped, so no
  token after the firing one is generated. ``finish_reason`` is "stop",
  ``stop_reason`` the action's label (the probe's name). A firing at a prompt
  position stops the request before its first token.
* ``"flag"``: the position is reported, the request goes on.
* ``{"steer": [...]}``: decided in the worker, on the device, in the step
  that scored the position (``worker/probe_gates.py``), from the same
  float32 scores; here the first firing is reported once (position, score)
  and the request goes on. The firing is also written into the request's
  ``steering`` (its gated entries become plain ones from the next
  position), so a request recomputed after preemption is steered from the
  same position on.

Each firing travels to the front-end as a one-request group carrying
:class:`~vllm_hidden_states.contract.OpResults` only. Requests without
actions cost nothing here: the watch is empty.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from vllm.logger import init_logger
from vllm_hidden_states.contract import CapturedRows, OpResults, ProbeAction, ProbeFiring
from vllm_hidden_states.probe_actions import STEER, steered_from

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.request import Request

logger = init_logger(__name__)


@dataclass
class _Watched:
    """One request's actions and where its scores stand.

    Attributes:
        actions: its actions.
        columns: each action's column in the request's probe scores.
        position: the position after the last row evaluated (a row group
            starting elsewhere follows quiet rows, which ended every run).
        runs: each action's run of consecutive positions where its
            condition held, up to ``position``.
    """

    actions: list[ProbeAction]
    columns: list[int]
    position: int
    runs: list[int] = field(default_factory=list)
    flagged: set[str] = field(default_factory=set)  # actions whose first flag was logged
    steered: set[int] = field(default_factory=set)  # steer actions that fired
    # (action index, position) of steer firings not yet written to the request
    new_steers: list[tuple[int, int]] = field(default_factory=list)


class ActionWatch:
    """The probe actions of the scheduler's running requests."""

    def __init__(self) -> None:
        self.watched: dict[str, _Watched] = {}
        # Every watched action's (column, threshold, above), counted over the
        # watched requests: a step where none of them holds at any row (a
        # monitor that does not fire, the common case) is read with one
        # comparison per distinct condition, not per request (:meth:`_quiet`).
        self._conditions: dict[tuple[int, float, bool], int] = {}
        # Requests a stop finished whose output the front-end trims (the
        # engine's token list keeps the dropped token): the front-end, which
        # holds the sequence as output, sends their extracts.
        self.trimmed: set[str] = set()
        # Requests freed since the last step's decision: their last rows may
        # still be in this step's groups (a request finished by length is
        # freed before they are read), so they leave after it (end_step).
        self._leaving: list[str] = []

    def add(self, request: "Request") -> None:
        """In ``Scheduler.add_request``: watch ``request`` if it has actions."""
        spec = request.hidden_states_spec
        if spec is None or not spec.probe_actions:
            return
        starts = np.cumsum([0, *spec.probe_widths]).tolist()
        columns = [starts[spec.probes.index(a.probe)] + a.column for a in spec.probe_actions]
        self.watched[request.request_id] = _Watched(
            list(spec.probe_actions), columns, spec.start, [0] * len(columns)
        )
        for condition in _conditions_of(self.watched[request.request_id]):
            self._conditions[condition] = self._conditions.get(condition, 0) + 1

    def forget(self, request_id: str) -> None:
        """In ``_free_request``: the request left the scheduler; it is
        forgotten once this step's scores are read (:meth:`end_step`)."""
        if request_id in self.watched:
            self._leaving.append(request_id)

    def end_step(self) -> None:
        """After this step's decision: forget the requests that left."""
        for request_id in self._leaving:
            gone = self.watched.pop(request_id, None)
            if gone is None:
                continue
            for condition in _conditions_of(gone):
                left = self._conditions[condition] - 1
                if left:
                    self._conditions[condition] = left
                else:
                    del self._conditions[condition]
        self._leaving.clear()

    def _quiet(self, scores: np.ndarray) -> bool:
        """Whether no watched action's condition holds at any row of
        ``scores`` (float32 ``[rows, sum of k]``, one group's). Every watched
        request's conditions are among those tried, so a quiet group has no
        firing and ends every run of its requests; a column past this
        group's width is another group's layout."""
        width = scores.shape[1]
        for column, threshold, above in self._conditions:
            if column >= width:
                continue
            values = scores[:, column]
            if (values > threshold).any() if above else (values < threshold).any():
                return False
        return True

    def decide(
        self,
        scheduler: "Scheduler",
        engine_core_outputs: dict[int, "EngineCoreOutputs"],
        groups: list[CapturedRows],
    ) -> None:
        """Act on this step's scores (``groups``, in position order per
        request) before the step's outputs leave: stop requests, and put
        each request's firings on its client's outputs. A quiet group (no
        condition holds at any of its rows, the common step) costs one
        comparison per distinct condition, and nothing per request."""
        fired: dict[str, list[ProbeFiring]] = {}
        stops: dict[str, ProbeFiring] = {}
        for group in groups:
            if group.probe_scores is None:
                continue
            all_scores = group.probe_scores.numpy()
            if self._quiet(all_scores):
                continue
            offset = 0
            for req_id, count, first in zip(group.req_ids, group.counts, group.firsts):
                watched = self.watched.get(req_id)
                if watched is not None and count:
                    if first != watched.position:  # quiet rows since: no run goes on
                        watched.runs = [0] * len(watched.runs)
                        watched.position = first
                    scores = all_scores[offset : offset + count]
                    firings = _evaluate(watched, scores)
                    if firings:
                        fired.setdefault(req_id, []).extend(firings)
                        stop = next((f for f in firings if f.then == "stop"), None)
                        if stop is not None and req_id not in stops:
                            stops[req_id] = stop
                offset += count
        if not fired:
            return
        for req_id in fired:
            watched = self.watched.get(req_id)
            if watched is not None and watched.new_steers:
                _steer_from(scheduler, req_id, watched.new_steers)
                watched.new_steers.clear()
        outputs_of = {
            eco.request_id: (eco, outs)
            for outs in engine_core_outputs.values()
            for eco in outs.outputs
        }
        for req_id, firings in fired.items():
            entry = outputs_of.get(req_id)
            if entry is None:
                continue  # aborted meanwhile: no output to carry them
            eco, outs = entry
            stop = stops.get(req_id)
            if stop is not None:
                # Nothing after the stop is reported.
                firings = [f for f in firings if f.position <= stop.position]
                _stop(scheduler, eco, stop, self.trimmed)
            for firing in firings:
                # A stop, and an action's first flag on a request, at INFO;
                # the flags after it (one per position) at DEBUG.
                first = firing.then == "stop" or watched_first_flag(self.watched, req_id, firing)
                (logger.info if first else logger.debug)(
                    "probe action %s (%s) fired on request %s at position %d (score %.6g)",
                    firing.label,
                    firing.then,
                    req_id,
                    firing.position,
                    firing.score,
                )
            group = CapturedRows(
                req_ids=[req_id], counts=[0], op_results=OpResults(firings=firings)
            )
            if outs.captured is None:
                outs.captured = []
            outs.captured.append(group)


def watched_first_flag(watched: dict[str, _Watched], req_id: str, firing: ProbeFiring) -> bool:
    """Whether ``firing`` is its action's first flag on ``req_id`` (noted)."""
    entry = watched.get(req_id)
    if entry is None or firing.label in entry.flagged:
        return False
    entry.flagged.add(firing.label)
    return True


def _conditions_of(watched: _Watched) -> set[tuple[int, float, bool]]:
    """``watched``'s actions as (column, threshold, above)."""
    return {(c, a.threshold, a.above) for a, c in zip(watched.actions, watched.columns)}


def _evaluate(watched: _Watched, scores: np.ndarray) -> list[ProbeFiring]:
    """The firings of ``watched``'s actions over ``scores`` (float32
    ``[rows, sum of k]``, positions from ``watched.position`` on), in
    position order; advances ``watched``. A stop ends the evaluation."""
    firings: list[ProbeFiring] = []
    first = watched.position
    watched.position += scores.shape[0]
    held = [
        (scores[:, c] > a.threshold) if a.above else (scores[:, c] < a.threshold)
        for a, c in zip(watched.actions, watched.columns)
    ]
    for row in range(scores.shape[0]):
        for i, action in enumerate(watched.actions):
            watched.runs[i] = watched.runs[i] + 1 if held[i][row] else 0
            if i in watched.steered:
                continue  # on already: reported once
            if watched.runs[i] >= action.consecutive:
                if action.then == STEER:
                    watched.steered.add(i)
                    watched.new_steers.append((i, first + row))
                firings.append(
                    ProbeFiring(
                        label=action.label,
                        position=first + row,
                        score=float(scores[row, watched.columns[i]]),
                        then=action.then,
                        monitor=action.monitor,
                    )
                )
        if any(f.then == "stop" and f.position == first + row for f in firings):
            break
    return firings


def _steer_from(scheduler: "Scheduler", req_id: str, steers: list[tuple[int, int]]) -> None:
    """Steer actions fired (``(action index, position)``): their gated
    entries in the request's ``steering`` become plain entries from the
    generated position after the firing one. The worker reads them when the
    request comes back as new (recomputed after preemption) or is extracted;
    until then it keeps its own device gate, which fired in the same step."""
    request = scheduler.requests.get(req_id)
    params = None if request is None else request.sampling_params
    if params is None or not params.steering:
        return
    params.steering = steered_from(params.steering, dict(steers))


def _stop(
    scheduler: "Scheduler", eco: "EngineCoreOutput", firing: ProbeFiring, trimmed: set[str]
) -> None:
    """Finish the request of ``eco`` at ``firing``: its output keeps the
    tokens at positions up to the firing one (those sampled after it, in
    this step, are dropped from ``eco``) and ends with "stop",
    ``stop_reason`` the action's label. A request that finished in this step
    already keeps its own finish. A request whose output lost tokens joins
    ``trimmed`` before it finishes (its extract is then the front-end's)."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus

    request = scheduler.requests.get(eco.request_id)
    if request is None or request.is_finished() or eco.finish_reason is not None:
        return
    keep = max(firing.position + 1 - request.num_prompt_tokens, 0)
    drop = request.num_output_tokens - keep
    new = list(eco.new_token_ids)
    if drop > len(new):
        # Tokens of earlier steps are out already (cannot happen: a position
        # is scored in the step that samples the token after it).
        logger.error(
            "probe action %s on %s: %d tokens after position %d were sent before "
            "its score; stopping after them",
            firing.label,
            eco.request_id,
            drop - len(new),
            firing.position,
        )
        drop = len(new)
    if drop:
        trimmed.add(eco.request_id)
        eco.new_token_ids = new[: len(new) - drop]
        if drop == len(new):
            eco.new_logprobs = None  # else only with draft tokens, refused
    request.stop_reason = firing.label
    eco.finish_reason = FinishReason.STOP
    eco.stop_reason = firing.label
    scheduler.finish_requests(eco.request_id, RequestStatus.FINISHED_STOPPED)
