# SPDX-License-Identifier: Apache-2.0
"""Wire types between the processes: what a request asks, the extract, the
captured rows, and the scheduler's capture plan.

The msgspec structs (:class:`HiddenStatesSpec`, :class:`HiddenStatesExtractRequest`,
:class:`CapturedRows`) are defined in :mod:`vllm_hidden_states.contract` and
named here; :func:`cat_rows`, :func:`slice_rows` and :func:`split_group` are
the one path that joins, cuts and groups rows. The capture plan
(:class:`CapturePlan`) travels on ``SchedulerOutput`` to the workers.
docs/architecture.md, "Wire types".
"""

import time
from collections.abc import Callable, Iterator
from itertools import repeat
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import torch

from vllm_hidden_states.contract import (
    CapturedRows,
    HiddenStatesExtractRequest,
    HiddenStatesSpec,
    Intervention,
)

if TYPE_CHECKING:
    from vllm.v1.engine import EngineCoreOutputs

__all__ = [
    "EXTRACT_ID_SUFFIX",
    "POSITION_AXIS",
    "CapturedRows",
    "cat_rows",
    "group_rows",
    "hand_out_captured",
    "has_rows",
    "num_positions",
    "slice_rows",
    "split_group",
    "without",
    "HiddenStatesExtractRequest",
    "HiddenStatesSpec",
    "distinct_layers",
    "ends_before_final_token",
    "extract_for",
    "extract_id_for",
    "original_id_of",
]

# Suffix of the engine-internal id of a HIDDEN_STATES_EXTRACT request. The
# scheduler treats a duplicate request id as a streaming continuation, so the
# extract must never reuse the id of the request it extracts for.
EXTRACT_ID_SUFFIX = "-hs"


def extract_id_for(request_id: str) -> str:
    """The engine-internal id of the extract that serves ``request_id``."""
    return request_id + EXTRACT_ID_SUFFIX


def original_id_of(extract_id: str) -> str:
    """The id of the request an extract serves (inverse of :func:`extract_id_for`)."""
    return extract_id.removesuffix(EXTRACT_ID_SUFFIX)


def ends_before_final_token(spec: HiddenStatesSpec, num_tokens: int) -> bool:
    """Whether an inline capture needs nothing of the final token of a
    sequence of ``num_tokens`` (position ``num_tokens - 1``, which only an
    extract computes): its window ends before it, or the request gets no
    rows (server monitors only). Its inline rows then complete it without an
    extract."""
    return spec.inline and (
        (spec.end is not None and spec.end < num_tokens) or spec.returns == "none"
    )


def extract_for(
    spec: HiddenStatesSpec,
    request_id: str,
    token_ids: list[int],
    *,
    lora_request: Any = None,
    cache_salt: str | None = None,
    priority: int = 0,
    steering: list[Intervention] | None = None,
    client_index: int = 0,
) -> HiddenStatesExtractRequest:
    """The extract that completes the capture of ``request_id`` (a finished
    "last"/"all" request) over ``token_ids`` (its prompt + output).

    "last", and inline "all" (only the final token is missing): the final
    position. "all" without inline capture: every position recomputed, cut
    to the window. Attention patterns need every key, so their extract
    recomputes every position ("all") and returns the query window asked
    ("last": the final position). LoRA, cache salt, priority and steering
    are the request's own (the extract replays its steered forward).
    """
    num_tokens = len(token_ids)
    positions, start, end = ("last" if spec.inline else spec.positions), 0, None
    if spec.pattern_ids:
        positions = "all"
        if spec.positions == "last":
            start = num_tokens - 1
        else:
            start, end = min(spec.start, num_tokens), spec.end
    return HiddenStatesExtractRequest(
        request_id=extract_id_for(request_id),
        token_ids=token_ids,
        layers=distinct_layers(spec),
        positions=positions,
        arrival_time=time.time(),
        lora_request=lora_request,
        cache_salt=cache_salt,
        priority=priority,
        client_index=client_index,
        sae_top_k=spec.sae_top_k,
        patterns=list(spec.pattern_ids),
        start=start,
        end=end,
        neurons=list(spec.neuron_ids),
        probes=list(spec.probes),
        steering=steering,
    )


def result_keys(spec: HiddenStatesSpec) -> list[int | str]:
    """The keys of a request's ``hidden_states``: its layers as given, then
    its point addresses as given (``spec.abs_layers`` holds their capture ids,
    in the same order)."""
    return [*spec.layers, *spec.points]


def distinct_layers(spec: HiddenStatesSpec) -> list[int]:
    """The capture ids a capture produces, in result order (ascending)."""
    return sorted(set(spec.abs_layers))


# The positions axis of each CapturedRows field (of each tensor of a list
# field's, :data:`LIST_FIELDS`).
POSITION_AXIS: dict[str, int] = {
    "hidden": 1,
    "sae_ids": 0,
    "sae_values": 0,
    "patterns": 2,
    "neurons": 0,
    "probe_scores": 0,
}
# The fields that name a group's owners; every other field is data.
_GROUP_FIELDS = ("req_ids", "counts", "firsts", "op_results")
_FIELDS = [f for f in msgspec.structs.fields(CapturedRows) if f.name not in _GROUP_FIELDS]
assert {f.name for f in _FIELDS} == set(POSITION_AXIS), "a CapturedRows field lacks its axis"
# The data fields lead the struct (split_group builds each request's value
# from them by position).
assert msgspec.structs.fields(CapturedRows)[: len(_FIELDS)] == tuple(_FIELDS)


# Fields holding a list of tensors (one per point, widths differing), each
# cut and joined along its positions axis; the others hold one tensor.
LIST_FIELDS: frozenset[str] = frozenset({"neurons"})


def num_positions(rows: CapturedRows) -> int:
    """How many positions ``rows`` covers (every present field agrees)."""
    for f in _FIELDS:
        value = getattr(rows, f.name)
        if f.name in LIST_FIELDS and value:
            value = value[0]
        if value is not None and not isinstance(value, list):
            return value.shape[POSITION_AXIS[f.name]]
    return 0


def _cut(value: Any, cut: Callable[[torch.Tensor], Any]) -> Any:
    """``cut`` of a field's tensor, or of each tensor of a list field's."""
    return [cut(t) for t in value] if isinstance(value, list) else cut(value)


def _slicer(axis: int, start: int, stop: int | None) -> Callable[[torch.Tensor], torch.Tensor]:
    index = (slice(None),) * axis + (slice(start, stop),)
    return lambda t: t[index]


def _splitter(axis: int, counts: list[int]) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    return lambda t: t.split(counts, dim=axis)


def cat_rows(parts: list[CapturedRows], grouped: bool = False) -> CapturedRows:
    """``parts`` (consecutive runs of positions, the same fields present in
    each) joined into one run; ``grouped``: the parts are groups, and so is
    the result (their requests in order)."""
    if len(parts) == 1:
        return parts[0]
    fields: dict = {}
    for f in _FIELDS:
        if getattr(parts[0], f.name) is None:
            continue  # absent from every part
        values = [getattr(p, f.name) for p in parts]
        axis = POSITION_AXIS[f.name]
        if isinstance(values[0], list):  # each point's tensors joined
            fields[f.name] = [torch.cat(point, dim=axis) for point in zip(*values)]
        elif values[0] is not None:
            fields[f.name] = torch.cat(values, dim=axis)
    if grouped:
        fields["req_ids"] = [r for p in parts for r in p.req_ids]
        fields["counts"] = [c for p in parts for c in p.counts]
        fields["firsts"] = [f for p in parts for f in p.firsts]
    return CapturedRows(**fields)


def slice_rows(rows: CapturedRows, start: int, stop: int | None = None) -> CapturedRows:
    """Positions ``start:stop`` of ``rows`` (views, no copy)."""
    fields: dict[str, Any] = {}
    for f in _FIELDS:
        value = getattr(rows, f.name)
        if value is not None:
            fields[f.name] = _cut(value, _slicer(POSITION_AXIS[f.name], start, stop))
    return CapturedRows(**fields)


def group_rows(rows: CapturedRows, req_id: str, first: int) -> CapturedRows:
    """One request's ``rows`` (from position ``first`` on) as a group of
    one (in place)."""
    rows.req_ids, rows.counts, rows.firsts = [req_id], [num_positions(rows)], [first]
    return rows


def split_group(group: CapturedRows) -> Iterator[tuple[str, CapturedRows]]:
    """``(req_id, rows)`` of each request of ``group``, in order (views: one
    ``split`` per field, no copy)."""
    # Per data field, in the struct's order: each request's view (None for
    # every request where the field is absent).
    columns: list[Any] = []
    for f in _FIELDS:
        value = getattr(group, f.name)
        if value is None:
            columns.append(repeat(None))
            continue
        split = _cut(value, _splitter(POSITION_AXIS[f.name], group.counts))
        # A list field: one list of the points' views per request.
        columns.append([list(p) for p in zip(*split)] if isinstance(split, list) else split)
    for req_id, values in zip(group.req_ids, zip(*columns)):
        rows = CapturedRows(*values)
        if group.op_results is not None:  # a group of one request (see the field)
            rows.op_results = group.op_results
        yield req_id, rows


def with_op_results(first: CapturedRows, second: CapturedRows) -> CapturedRows:
    """One request's two values of one step as one: its rows, and a value of
    ``op_results`` only (the engine's decisions, a group of its own)."""
    ops_only = second.op_results is not None and not has_rows(second)
    data, ops = (first, second) if ops_only else (second, first)
    data.op_results = ops.op_results
    return data


def has_rows(rows: CapturedRows) -> bool:
    """Whether ``rows`` carries any data field (a value of ``op_results``
    only does not)."""
    return any(getattr(rows, f.name) is not None for f in _FIELDS)


# Where the front-end process records probe action firings (metrics, the
# activation store): frontend/firings.py registers it (on_firings). Every
# firing passes hand_out_captured, whether or not its request has a tracker
# (one whose only actions are server monitors has none).
_firings_sink: Callable[[str, list], None] | None = None


def on_firings(sink: Callable[[str, list], None]) -> None:
    """Record each step's firings with ``sink(request_id, firings)``."""
    global _firings_sink
    _firings_sink = sink


def hand_out_captured(outputs: "EngineCoreOutputs") -> None:
    """Right after the client decoded a step's outputs: each output whose
    request captured rows gets them as ``EngineCoreOutput.captured``, and
    the step's probe action firings are recorded (:func:`on_firings`).

    The scheduler grouped only rows whose request has an output in
    ``outputs`` (:meth:`~vllm_hidden_states.engine.planner.CapturePlanner.attach`).
    """
    groups, outputs.captured = outputs.captured, None
    if not groups:
        return
    by_id = {eco.request_id: eco for eco in outputs.outputs}
    for group in groups:
        if group.op_results is not None and _firings_sink is not None:
            _firings_sink(group.req_ids[0], group.op_results.firings)  # a group of one
        for req_id, rows in split_group(group):
            # Always there (see above); were one missing, its rows are
            # dropped here and its tracker fails the request visibly, rather
            # than this client's output thread dying on a KeyError.
            if (eco := by_id.get(req_id)) is not None:
                eco.captured = rows if eco.captured is None else with_op_results(eco.captured, rows)


def without(group: CapturedRows, req_ids: set[str]) -> CapturedRows | None:
    """``group`` less the rows of ``req_ids`` (a new group of views; None
    when nothing is left)."""
    kept = [
        group_rows(rows, req_id, first)
        for (req_id, rows), first in zip(split_group(group), group.firsts)
        if req_id not in req_ids
    ]
    return cat_rows(kept, grouped=True) if kept else None


# -- the scheduler's capture plan, carried to the workers on SchedulerOutput --


class CaptureKind(NamedTuple):
    """What a capture reads, whatever its positions in one step; requests
    that ask the same share one (a plan sends each kind once).

    Attributes:
        layers: absolute HF layer indices, in result order.
        positions: "last" or "all".
        sae_top_k: also encode the SAE layer's rows on the device and ship
            only their k strongest features (0: none). ``layers`` (the full
            states shipped) may then be empty.
        buffered: the rows pass the capture buffers (a layer below the final
            one is read); else they come from the model output alone.
        patterns: attention patterns (capture ids) to compute once the
            capture is done, for query positions ``query_start ..
            query_stop - 1`` (None: to the end) over every key; the capture's
            rows are then cut to those positions too.
        neurons: mlp_post capture ids.
        probes: linear probes (names) to score on the device; only their
            scores leave it (``layers`` may then be empty).
    """

    layers: tuple[int, ...]
    positions: str
    sae_top_k: int = 0
    buffered: bool = True
    patterns: tuple[int, ...] = ()
    query_start: int = 0
    query_stop: int | None = None
    neurons: tuple[int, ...] = ()
    probes: tuple[str, ...] = ()

    @property
    def rows_only(self) -> bool:
        """Only rows of ``layers`` (and probe scores, computed on every row
        alike): no SAE features, patterns or neurons (a step of such
        captures goes to the host as one group)."""
        return not (self.sae_top_k or self.patterns or self.neurons)


class CapturePlan(NamedTuple):
    """What the model runner captures in one step, column by column: entry
    ``i`` of each list belongs to request ``req_ids[i]``.

    Columns, not an object per request: a decode step of many "all" captures
    is made and pickled to the workers in a few list operations, and the
    planner, which has every number at hand, works out each request's rows,
    so the worker's common step only looks up batch rows (per-request objects
    cost microseconds each, every step).

    Attributes:
        req_ids: the requests with a capture scheduled in this step.
        offsets: each one's first captured row, counted from its first
            scheduled token (batch row ``query_start_loc[its index]``).
        counts: rows it captures in this step (0: none; a "last" capture
            before the chunk that computes its last position, an "all"
            capture recomputing delivered positions or past its window).
        done: this step computes its last position (its rows are delivered
            with this step's output).
        one_group: every entry has one kind of rows only (no SAE features,
            patterns or neurons), captures at least one row and is done:
            the step's rows go to the host as one group.
        starts: sequence position of each one's first scheduled token.
        num_tokens: length of its sequence known at this step; rows are
            delivered in the step that computes position ``num_tokens - 1``.
        firsts: first position to capture ("all"; positions before it were
            delivered before a preemption, or lie before a window).
        stops: a window's end: positions from it on are not captured (-1:
            none). Rows are still delivered in the step that computes
            position ``num_tokens - 1`` (a window that ends inside a chunked
            prefill is delivered with the prefill's last chunk).
        kind_of: index into ``kinds`` of each one's :class:`CaptureKind`.
        kinds: the distinct kinds of this step.
    """

    req_ids: list[str]
    offsets: list[int]
    counts: list[int]
    done: list[bool]
    one_group: bool
    starts: list[int]
    num_tokens: list[int]
    firsts: list[int]
    stops: list[int]
    kind_of: list[int]
    kinds: list[CaptureKind]

    def step(self, i: int) -> "CaptureStep":
        """Entry ``i`` as one request's :class:`CaptureStep`."""
        kind = self.kinds[self.kind_of[i]]
        stop = self.stops[i]
        return CaptureStep(
            kind.layers,
            kind.positions,
            self.starts[i],
            self.num_tokens[i],
            self.firsts[i],
            kind.sae_top_k,
            kind.buffered,
            None if stop < 0 else stop,
            kind.patterns,
            kind.query_start,
            kind.query_stop,
            kind.neurons,
            kind.probes,
        )


class CaptureStep(NamedTuple):
    """What the model runner captures for one request in one step: a
    :class:`CapturePlan` entry with its kind's fields, as the worker's
    per-request path (chunked prefills, extracts, SAE features, patterns)
    reads it.

    Attributes:
        layers: absolute HF layer indices, in result order.
        positions: "last" or "all".
        start: sequence position of this step's first scheduled token.
        num_tokens: length of the sequence known at this step; rows are
            delivered in the step that computes position ``num_tokens - 1``.
        first: first position to capture ("all"; positions before it were
            delivered before a preemption).
        sae_top_k: also encode the SAE layer's rows on the device and ship
            only their k strongest features (0: none). ``layers`` (the full
            states shipped) may then be empty.
        buffered: the rows pass the capture buffers (a layer below the final
            one is read); else they come from the model output alone.
        stop: a window's end: positions from it on are not captured (None:
            none). Rows are still delivered in the step that computes
            position ``num_tokens - 1``: only a step with an output carries
            them (a window that ends inside a chunked prefill is delivered
            with the prefill's last chunk).
        patterns: attention patterns (capture ids) to compute once the
            capture is done, for query positions ``query_start ..
            query_stop - 1`` (None: to the end) over every key; the capture's
            rows are then cut to those positions too.
        neurons: mlp_post capture ids.
        probes: linear probes (names) scored on the device on the rows of
            their points; only ``[rows, sum of k]`` float32 leaves it.
    """

    layers: tuple[int, ...]
    positions: str
    start: int
    num_tokens: int
    first: int = 0
    sae_top_k: int = 0
    buffered: bool = True
    stop: int | None = None
    patterns: tuple[int, ...] = ()
    query_start: int = 0
    query_stop: int | None = None
    neurons: tuple[int, ...] = ()
    probes: tuple[str, ...] = ()
