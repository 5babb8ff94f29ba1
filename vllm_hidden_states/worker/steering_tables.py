# SPDX-License-Identifier: Apache-2.0
"""Steering: the runner's per-step steering state and its tables.

:class:`Steering` installs the steering op's hooks (``steering_op.py``) at
model load, writes each running steered request's vectors once into table
rows that a :class:`~vllm_hidden_states.worker.slot_pool.SlotPool` lends,
and arms the rows and slots of a step before its forward.
docs/architecture.md, "Steering".
"""

from typing import Any

import numpy as np
import torch
from torch import nn

from vllm.logger import init_logger
from vllm_hidden_states.contract import Intervention, as_interventions
from vllm_hidden_states.points import point_of_id
from vllm_hidden_states.probe_actions import steered_from
from vllm_hidden_states.steering_config import MAX_SAE_EDITS, SteeringConfig
from vllm_hidden_states.worker.capture_op import count_readable_on_host
from vllm_hidden_states.worker.probe_gates import RequestGates
from vllm_hidden_states.worker.slot_pool import SlotPool
from vllm_hidden_states.worker.steering_hooks import install_hooks, splices
from vllm_hidden_states.worker.steering_op import SteerTap, register_op, steer_tap
from vllm_hidden_states.worker.steering_requests import (
    PATCH,
    SPLICE,
    STEER,
    NamedVectors,
    RequestSteering,
)
from vllm_hidden_states.worker.step_batch import StepBatch, expand_stretches
from vllm_hidden_states.worker.taps import find_decoder_layers
from vllm_hidden_states.worker.tp_shards import rank_columns, z_full_width, z_is_share

logger = init_logger(__name__)


class Steering:
    """The steerable points of one model, their buffers, and the steered
    requests of the runner."""

    def __init__(
        self,
        config: SteeringConfig,
        model: nn.Module,
        hidden_size: int,
        max_tokens: int,
        max_num_seqs: int,
        device: torch.device,
        layout: str | None,
        sae: Any = None,
    ):
        register_op()
        self.config = config
        n = config.num_layers
        _, decoder_layers = find_decoder_layers(model, n)
        from vllm_hidden_states.worker.taps import is_pp_placeholder

        taps: dict[int, SteerTap] = {}
        for k in config.ids:
            point = point_of_id(k, n)
            layer = decoder_layers[k if point is None else point[1]]
            if is_pp_placeholder(layer):
                continue  # another pipeline stage owns it
            taps[k] = steer_tap(layer, k, n, layout)
        # attn_z ids: their width (heads * head_dim, the output projection's
        # input), as the front-end reads it from the config and sends rows.
        # Under tensor parallelism this rank's projection reads only its
        # heads: ``columns`` are its columns of those rows (cut at upload).
        self.widths = {
            k: z_full_width(config, k, tap.module) for k, tap in taps.items() if tap.heads
        }
        self.columns = {
            k: rank_columns(width) if z_is_share(config, k, taps[k].module) else slice(0, width)
            for k, width in self.widths.items()
        }
        self.index_of = {k: i for i, k in enumerate(config.ids)}
        num_points = max(len(config.ids), 1)
        self.max_tokens = max_tokens
        self.rows = torch.zeros(num_points, max_tokens, dtype=torch.int64, device=device)
        self.slots = torch.zeros_like(self.rows)
        self.num_points = num_points
        self.counts = torch.zeros(2 * num_points, dtype=torch.int64, device=device)
        self.counts_host = torch.zeros(2 * num_points, dtype=torch.int64)
        # On CPU, each token's slot per point, for the compiled route (see
        # steer); 0 everywhere no request steers. Written and cleared through
        # a numpy view, entry by entry (the rows armed).
        self.token_slots: torch.Tensor | None = None
        self._token_slots_np: np.ndarray | None = None
        self._token_slots_written: list[tuple[int, np.ndarray]] = []
        if count_readable_on_host(device):
            self.token_slots = torch.zeros(num_points, max_tokens, dtype=torch.int64)
            self._token_slots_np = self.token_slots.numpy()
        num_slots = config.table_slots(max_num_seqs)
        self.adds = torch.zeros(num_slots, hidden_size, dtype=torch.float32, device=device)
        self.dirs = torch.zeros_like(self.adds)
        # Steer actions (probe_gates.py): the vectors of gated slots, which
        # ``adds`` holds only once their gate fired; each gated request's gates.
        self.armed_adds = torch.zeros_like(self.adds)
        self.gates: dict[str, RequestGates] = {}
        # clamp_sae_feature (an engine with an SAE): encoder columns, decoder
        # rows and (bias, threshold, value) per slot; zero where no clamp.
        self.enc = self.dec = self.par = None
        if sae is not None:
            self.enc = torch.zeros_like(self.adds)
            self.dec = torch.zeros_like(self.adds)
            self.par = torch.zeros(num_slots, 3, dtype=torch.float32, device=device)
        self.device = device
        self.table = SlotPool(
            num_slots, "steering table", "raise --max-steering or lower max_num_seqs"
        )
        self.vectors = NamedVectors(config.vectors_dir, sae)
        self.hidden_size = hidden_size
        # Rewrites (patch, sae_splice): their own entries per point, the
        # splice's at index num_points; counts int64 [num_points + 1].
        self.rewrites = config.max_patch_rows > 0 or splices(config, sae)
        self.splice_index = num_points
        self.rw_rows = torch.zeros(num_points + 1, max_tokens, dtype=torch.int64, device=device)
        self.rw_slots = torch.zeros_like(self.rw_rows)
        self.rw_counts = torch.zeros(num_points + 1, dtype=torch.int64, device=device)
        self.rw_counts_host = torch.zeros(num_points + 1, dtype=torch.int64)
        # The patch table: float32 [max_patch_rows + 1, width] (row 0 unused),
        # width the widest patchable point (attn_z may be wider than hidden).
        self.table_width = max([hidden_size, *(c.stop - c.start for c in self.columns.values())])
        self.patch_table = torch.zeros(
            config.max_patch_rows + 1 if config.max_patch_rows else 1,
            self.table_width,
            dtype=torch.float32,
            device=device,
        )
        self.patch_pool = SlotPool(self.patch_table.shape[0], "patch table (--max-patch-rows)")
        # On CPU, each token's patch table row per point, for the compiled
        # route (rewrite_op.patch); 0 where nobody patches. Written and
        # cleared through a numpy view, entry by entry.
        self.patch_token_slots: torch.Tensor | None = None
        self._patch_token_slots_np: np.ndarray | None = None
        self._patch_token_slots_written: list[tuple[int, np.ndarray]] = []
        if config.max_patch_rows and count_readable_on_host(device):
            self.patch_token_slots = torch.zeros(num_points + 1, max_tokens, dtype=torch.int64)
            self._patch_token_slots_np = self.patch_token_slots.numpy()
        # The splice's edit tables, a slot per resident splicing request.
        splice_slots = max_num_seqs + 1 if splices(config, sae) else 1
        self.edit_ids = torch.full(
            (splice_slots, MAX_SAE_EDITS),
            sae.d_sae if sae is not None else 0,
            dtype=torch.int64,
            device=device,
        )
        self.edit_mode = torch.zeros(
            splice_slots, MAX_SAE_EDITS, dtype=torch.float32, device=device
        )
        self.edit_vals = torch.ones_like(self.edit_mode)
        self.keep = torch.ones(splice_slots, dtype=torch.float32, device=device)
        self.splice_pool = SlotPool(splice_slots, "splice slots")
        self.sae = sae
        self.requests: dict[str, RequestSteering] = {}
        # The stretches of the requests holding slots (:meth:`_stretch_table`),
        # rebuilt when a request comes, goes or gets slots.
        self._stretches: tuple | None = None
        self.armed = False
        install_hooks(self, taps, sae)

    # -- per step --------------------------------------------------------------

    def begin_step(self, scheduler_output: Any) -> None:
        """New requests that steer (their ``SamplingParams.steering``, in
        wire form); resumed ones whose steer actions fired; finished ones
        leave."""
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            if params is not None and params.steering:
                # A preempted request comes back as new (V2 runner), its
                # steering as the engine rewrote it: its old slots go back.
                self._steer(new.req_id, as_interventions(params.steering))
        if self.gates:
            # V1 runner: a preempted request resumes with its cached state.
            resumed = getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", ())
            for req_id in resumed:
                if req_id in self.gates:
                    self._resume(req_id)
        if self.requests and scheduler_output.finished_req_ids:
            for req_id in scheduler_output.finished_req_ids:
                if self.requests.pop(req_id, None) is not None:
                    self.gates.pop(req_id, None)
                    self._give_back(req_id)
                    self._stretches = None

    def _steer(self, req_id: str, wire: list[Intervention]) -> None:
        """``req_id`` steers as ``wire`` says from now on: its table rows go
        back (written again on upload), its gates are made afresh. A request
        that had gates here was preempted and is back: where they fired is
        this worker's own record (the engine may not know yet, one step
        behind under async scheduling), so those gates' entries become plain
        ones from the position after (probe_actions.steered_from), and the
        others keep their runs."""
        earlier = self.gates.pop(req_id, None)
        if earlier is not None:
            fired = earlier.fired_positions()
            if fired:
                wire = steered_from(wire, fired)
        self._give_back(req_id)
        request = RequestSteering(
            wire,
            self.vectors,
            self.index_of,
            self.hidden_size,
            self.widths,
            self.table_width,
            self.columns,
        )
        self.requests[req_id] = request
        gated = [(k, gate) for k, gate in enumerate(request.gates) if gate is not None]
        if gated:
            gates = RequestGates([k for k, _ in gated], [gate for _, gate in gated], self.device)
            if earlier is not None:
                gates.carry_runs(earlier)
            self.gates[req_id] = gates
        self._stretches = None

    def _resume(self, req_id: str) -> None:
        """A preempted request resumes with its cached state (V1 runner):
        the positions it computed are computed again, which a fired gate
        would steer from the first generated one; it is rebuilt as one
        back as new is (:meth:`_steer`). Unfired gates stand (the positions
        they scored are not scored again)."""
        if self.gates[req_id].fired_positions():
            self._steer(req_id, self.requests[req_id].wire)

    def gate(self, req_id: str, scores: torch.Tensor, first: int) -> None:
        """After the forward: ``req_id``'s probe scores of this step (device
        ``[rows, sum of k]``, from sequence position ``first``) move its
        steer actions' gates, and its gated table rows follow them
        (probe_gates.py). Device ops only."""
        gates = self.gates.get(req_id)
        if gates is None:
            return
        gates.update(scores, first)
        if self.table.rows_of(req_id) is None:
            gates.slots = None  # evicted: the rows are written again on upload
        gates.apply(self.adds, self.armed_adds)

    def _give_back(self, req_id: str) -> None:
        """Every table row ``req_id`` holds goes back."""
        self.table.give_back(req_id)
        self.patch_pool.give_back(req_id)
        self.splice_pool.give_back(req_id)

    def arm(self, batch: StepBatch, num_scheduled: dict[str, int]) -> None:
        """Right before the forward: the rows of every steered request in the
        batch, at each of its points (no-op when none is in the batch).

        Vectorized over the stretches of the requests holding table slots
        (:meth:`_stretch_table`); Python per step is one dict lookup per
        stretch, whatever its length."""
        if not self.requests:
            return
        index_of = batch.index_of
        missing = [
            r
            for r, q in self.requests.items()
            if not self._resident(r, q) and r in num_scheduled and r in index_of
        ]
        if missing:  # entering the batch without table slots: upload first
            in_batch = {r for r in self.requests if r in num_scheduled and r in index_of}
            for req_id in missing:
                self._upload(req_id, self.requests[req_id], in_batch)
            self._stretches = None  # slots changed (lent, or taken back from others)
        if self._stretches is None:
            self._stretches = self._stretch_table()
        owners, point, start, end, slot, projects, dest = self._stretches
        if not owners:
            return
        idx = np.fromiter(
            (index_of.get(r, -1) if r in num_scheduled else -1 for r in owners),
            dtype=np.int64,
            count=len(owners),
        )
        live = idx >= 0
        if not live.any():
            return
        i = idx[live]
        query_start = batch.query_start
        p0 = batch.num_computed[i].astype(np.int64)
        row0 = query_start[i].astype(np.int64)
        p1 = p0 + (query_start[i + 1] - query_start[i])
        lo = np.maximum(start[live], p0)
        hi = np.minimum(end[live], p1)
        keep = lo < hi
        if not keep.any():
            return
        points = point[live][keep]
        firsts = (row0 + lo - p0)[keep]
        counts = (hi - lo)[keep]
        slots = slot[live][keep]
        projecting = projects[live][keep]
        dests = dest[live][keep]
        # Device rows past each count are zero (disarm), so only the armed
        # entries are copied: a few per steered request.
        self.counts_host.zero_()
        self.rw_counts_host.zero_()
        steered = rewritten = False
        for where in np.unique(dests).tolist():
            mine_dest = dests == where
            index_col = points if where != SPLICE else np.full_like(points, self.splice_index)
            for index in np.unique(index_col[mine_dest]).tolist():
                mine = mine_dest & (index_col == index)
                rows, slot_of_row = expand_stretches(firsts[mine], counts[mine], slots[mine])
                total = rows.shape[0]
                if where == STEER:
                    self.rows[index, :total].copy_(torch.from_numpy(rows), non_blocking=True)
                    self.slots[index, :total].copy_(
                        torch.from_numpy(slot_of_row), non_blocking=True
                    )
                    self.counts_host[index] = total
                    if self._token_slots_np is not None:
                        self._token_slots_np[index, rows] = slot_of_row
                        self._token_slots_written.append((index, rows))
                    self.counts_host[self.num_points + index] = bool(projecting[mine].any())
                    steered = True
                else:
                    self.rw_rows[index, :total].copy_(torch.from_numpy(rows), non_blocking=True)
                    self.rw_slots[index, :total].copy_(
                        torch.from_numpy(slot_of_row), non_blocking=True
                    )
                    self.rw_counts_host[index] = total
                    if where == PATCH and self._patch_token_slots_np is not None:
                        self._patch_token_slots_np[index, rows] = slot_of_row
                        self._patch_token_slots_written.append((index, rows))
                    rewritten = True
        if steered:
            self.counts.copy_(self.counts_host, non_blocking=True)
        if rewritten:
            self.rw_counts.copy_(self.rw_counts_host, non_blocking=True)
        self.armed = True

    def _resident(self, req_id: str, request: RequestSteering) -> bool:
        """Whether ``request`` holds every table row its stretches need."""
        return (
            self.table.rows_of(req_id) is not None
            and (self.patch_pool.rows_of(req_id) is not None or not request.patch_stretches)
            and (self.splice_pool.rows_of(req_id) is not None or request.splice is None)
        )

    def _stretch_table(self) -> tuple:
        """Every stretch of the requests holding table slots, as columns:
        owner request id, point index, start, end (open: int64 max), slot,
        projects (ablate or clamp), dest (STEER, PATCH or SPLICE)."""
        owners: list[str] = []
        columns: list[tuple[int, int, int, int, bool, int]] = []
        big = np.iinfo(np.int64).max
        for req_id, request in self.requests.items():
            if not self._resident(req_id, request):
                continue
            slots = self.table.rows_of(req_id)
            patch_slots = self.patch_pool.rows_of(req_id)
            splice_slots = self.splice_pool.rows_of(req_id)
            assert slots is not None
            for stretch, slot, projects in zip(request.stretches, slots, request.projects):
                owners.append(req_id)
                end = big if stretch.end is None else stretch.end
                columns.append((stretch.index, stretch.start, end, slot, projects, STEER))
            if patch_slots is not None:
                for stretch, slot in zip(request.patch_stretches, patch_slots):
                    owners.append(req_id)
                    # A patch's stretch is one position; an ablate_heads' its span.
                    end = big if stretch.end is None else stretch.end
                    columns.append((stretch.index, stretch.start, end, slot, False, PATCH))
            if request.splice is not None and splice_slots:
                stretch = request.splice[0]
                owners.append(req_id)
                end = big if stretch.end is None else stretch.end
                columns.append((stretch.index, stretch.start, end, splice_slots[0], False, SPLICE))
        table = np.array(columns, dtype=np.int64).reshape(-1, 6)
        return (
            owners,
            table[:, 0],
            table[:, 1],
            table[:, 2],
            table[:, 3],
            table[:, 4].astype(bool),
            table[:, 5],
        )

    def _upload(self, req_id: str, request: RequestSteering, batch: set[str]) -> None:
        """Write a request's composed vectors, patch rows and splice edits
        into table rows (once per entry into the batch)."""
        if self.table.rows_of(req_id) is None:
            slots = self.table.lend(req_id, len(request.pairs), batch)
            if slots:
                self._upload_pairs(request, slots)
                gates = self.gates.get(req_id)
                if gates is not None:
                    # The vectors wait in armed_adds; adds holds them once fired.
                    index = torch.tensor(
                        [slots[k] for k in gates.stretches], dtype=torch.int64, device=self.device
                    )
                    self.armed_adds.index_copy_(0, index, self.adds.index_select(0, index))
                    gates.slots = index
                    gates.apply(self.adds, self.armed_adds)
        if request.patch_stretches and self.patch_pool.rows_of(req_id) is None:
            rows = self.patch_pool.lend(req_id, len(request.patch_stretches), batch)
            index = torch.tensor(rows, dtype=torch.int64, device=self.device)
            values = torch.from_numpy(request.patch_rows).to(self.device)
            self.patch_table.index_copy_(0, index, values)
        if request.splice is not None and self.splice_pool.rows_of(req_id) is None:
            [slot] = self.splice_pool.lend(req_id, 1, batch)
            _, edits, keep_error = request.splice
            d_sae = self.sae.d_sae
            ids: np.ndarray = np.full(MAX_SAE_EDITS, d_sae, np.int64)
            mode: np.ndarray = np.zeros(MAX_SAE_EDITS, np.float32)
            vals: np.ndarray = np.ones(MAX_SAE_EDITS, np.float32)
            for j, (feature, how, value) in enumerate(edits):
                ids[j] = int(feature)
                mode[j] = 1.0 if int(how) == 0 else 0.0  # 0: set, 1: scale
                vals[j] = value
            self.edit_ids[slot].copy_(torch.from_numpy(ids))
            self.edit_mode[slot].copy_(torch.from_numpy(mode))
            self.edit_vals[slot].copy_(torch.from_numpy(vals))
            self.keep[slot] = 1.0 if keep_error else 0.0

    def _upload_pairs(self, request: RequestSteering, slots: list[int]) -> None:
        index = torch.tensor(slots, dtype=torch.int64)
        adds = torch.from_numpy(np.stack([a for a, _ in request.pairs]))
        dirs = torch.from_numpy(np.stack([d for _, d in request.pairs]))
        if self.device.type != "cpu":
            index, adds, dirs = (t.to(self.device) for t in (index, adds, dirs))
        self.adds.index_copy_(0, index, adds)
        self.dirs.index_copy_(0, index, dirs)
        if self.enc is not None and self.dec is not None and self.par is not None:
            zero = np.zeros(adds.shape[1], np.float32)
            clamps = [c or (zero, 0.0, 0.0, 0.0, zero) for c in request.clamps]
            enc = torch.from_numpy(np.stack([c[0] for c in clamps]))
            dec = torch.from_numpy(np.stack([c[4] for c in clamps]))
            par = torch.tensor([[c[1], c[2], c[3]] for c in clamps], dtype=torch.float32)
            index = index.to(self.device)
            self.enc.index_copy_(0, index, enc.to(self.device))
            self.dec.index_copy_(0, index, dec.to(self.device))
            self.par.index_copy_(0, index, par.to(self.device))

    def disarm(self) -> None:
        """No steering in later forwards (warm-up and dummy runs included).
        Off CPU the op reads every entry up to the token count, so the index
        goes back to zeros (row 0, slot 0: a zero delta)."""
        if self.armed:
            self.rows.zero_()
            self.slots.zero_()
            self.counts.zero_()
            if self.rewrites:
                self.rw_rows.zero_()
                self.rw_slots.zero_()
                self.rw_counts.zero_()
            if self._patch_token_slots_np is not None:
                for index, rows in self._patch_token_slots_written:
                    self._patch_token_slots_np[index, rows] = 0
                self._patch_token_slots_written.clear()
            if self._token_slots_np is not None:
                for index, rows in self._token_slots_written:
                    self._token_slots_np[index, rows] = 0
                self._token_slots_written.clear()
            self.armed = False

    def forget(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            if req_id in self.requests:
                self._give_back(req_id)
                del self.requests[req_id]
                self.gates.pop(req_id, None)
                self._stretches = None
