# SPDX-License-Identifier: Apache-2.0
"""Steering: the runner's per-step steering state and its tables.

:class:`Steering` installs the steering op's hooks (``steering_op.py``) at
model load, writes each running steered request's vectors once into the slot
tables (:class:`SlotTable`), and arms the rows and slots of a step before its
forward. docs/architecture.md, "Steering".
"""

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from vllm.logger import init_logger
from vllm_hidden_states.points import point_of_id
from vllm_hidden_states.steering_config import SteeringConfig, vector_files
from vllm_hidden_states.worker import c_ops
from vllm_hidden_states.worker.capture_op import (
    count_readable_on_host,
    off_cpu_route,
)
from vllm_hidden_states.worker.steering_op import (
    SteerTap,
    compose,
    register_op,
    steer_hook,
    steer_tap,
)
from vllm_hidden_states.worker.step_batch import StepBatch
from vllm_hidden_states.worker.taps import (
    find_decoder_layers,
)

logger = init_logger(__name__)


@dataclass
class Stretch:
    """Positions ``start .. end - 1`` (``end`` None: on) of one request at
    one steerable point, steered by table slot ``slot``."""

    index: int  # the point's position in counts
    start: int
    end: int | None
    slot: int


class RequestSteering:
    """One request's interventions, split into stretches of positions with
    the same interventions per point, each one composed (add, dir) pair."""

    def __init__(
        self, wire: list[dict[str, Any]], vectors: "NamedVectors", index_of: dict[int, int]
    ):
        by_point: dict[int, list[dict[str, Any]]] = {}
        for item in wire:
            by_point.setdefault(int(item["id"]), []).append(item)
        self.stretches: list[Stretch] = []
        self.pairs: list[tuple[np.ndarray, np.ndarray]] = []
        # Per stretch: (encoder column, bias, threshold, value, decoder row)
        # of its clamp, or None (a clamp is alone at its point).
        self.clamps: list[tuple[np.ndarray, float, float, float, np.ndarray] | None] = []
        # Per stretch: whether it projects (ablates or clamps), not only adds.
        self.projects: list[bool] = []
        for capture_id, items in by_point.items():
            bounds = sorted(
                {int(x["start"]) for x in items}
                | {int(x["end"]) for x in items if x["end"] is not None}
            )
            for lo, hi in zip(bounds, [*bounds[1:], None]):
                active = [
                    x
                    for x in items
                    if x["start"] <= lo
                    and (x["end"] is None or (hi is not None and hi <= x["end"]))
                ]
                if not active:
                    continue
                self.stretches.append(Stretch(index_of[capture_id], lo, hi, 0))
                if active[0]["op"] == "clamp_sae_feature":
                    column, bias, threshold, row = vectors.sae_columns(active[0]["sae_feature"])
                    zero = np.zeros_like(row)
                    self.pairs.append((zero, zero))
                    self.projects.append(True)
                    self.clamps.append((column, bias, threshold, float(active[0]["value"]), row))
                    continue
                self.clamps.append(None)
                self.projects.append(any(x["op"] == "ablate" for x in active))
                self.pairs.append(
                    compose([(x["op"], vectors.get(x), float(x["strength"])) for x in active])
                )
        self.slots: list[int] | None = None  # table slots while resident


class NamedVectors:
    """Where vectors come from, on the host: inline, ``--steering-vectors``
    (loaded once per worker), or the engine's SAE (``sae_feature``)."""

    def __init__(self, directory: str | None, sae: Any = None):
        self._files = vector_files(directory) if directory else {}
        self._loaded: dict[str, np.ndarray] = {}
        self.sae = sae  # vllm_hidden_states.sae.SAE, None without --sae

    def sae_columns(self, feature: int) -> tuple[np.ndarray, float, float, np.ndarray]:
        """Feature ``feature`` of the SAE as ``(encoder column e, bias c,
        threshold, decoder row)``, float32: its activation is ``act(x . e +
        c)`` with ``c = b_enc[f] - b_dec . e`` when the SAE subtracts
        ``b_dec`` from its input."""
        sae = self.sae
        assert sae is not None, "sae_feature is refused in the front-end without an SAE"
        e = sae.W_enc[:, feature].double().cpu().numpy()
        c = float(sae.b_enc[feature])
        if sae.apply_b_dec_to_input:
            c -= float(sae.b_dec.double().cpu().numpy() @ e)
        threshold = float(sae.threshold[feature]) if sae.threshold is not None else 0.0
        row = sae.W_dec[feature].float().cpu().numpy()
        return e.astype(np.float32), c, threshold, row

    def get(self, item: dict[str, Any]) -> np.ndarray:
        if item.get("vector") is not None:
            return np.asarray(item["vector"], dtype=np.float32)
        if item.get("sae_feature") is not None:
            return self.sae_columns(int(item["sae_feature"]))[3]
        name = item["name"]
        if name not in self._loaded:
            from safetensors import safe_open

            path, key = self._files[name]
            with safe_open(path, framework="numpy") as f:
                self._loaded[name] = np.asarray(f.get_tensor(key), dtype=np.float32)
        return self._loaded[name]


class SlotTable:
    """Rows of the device vector tables (``adds``/``dirs``), lent to the
    steered requests of the batch; slot 0 stays zero. A request keeps its
    slots while it runs; when the table is full, requests not in the current
    batch give theirs back (and upload again when they return)."""

    def __init__(self, num_slots: int):
        self.free = list(range(num_slots - 1, 0, -1))
        self.holders: dict[str, RequestSteering] = {}

    def lend(self, req_id: str, request: RequestSteering, batch: set[str]) -> list[int] | None:
        """Slots for ``request`` (None: it needed none before and has them)."""
        need = len(request.pairs)
        if len(self.free) < need:
            for other_id in [r for r in self.holders if r not in batch]:
                self.give_back(other_id)
                if len(self.free) >= need:
                    break
        if len(self.free) < need:
            raise RuntimeError(
                f"vllm-hidden-states: steering table full ({need} slots asked); "
                "raise --max-steering or lower max_num_seqs"
            )
        slots = [self.free.pop() for _ in range(need)]
        request.slots = slots
        self.holders[req_id] = request
        return slots

    def give_back(self, req_id: str) -> None:
        request = self.holders.pop(req_id, None)
        if request is not None and request.slots is not None:
            self.free.extend(request.slots)
            request.slots = None


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
        # clamp_sae_feature (an engine with an SAE): encoder columns, decoder
        # rows and (bias, threshold, value) per slot; zero where no clamp.
        self.enc = self.dec = self.par = None
        if sae is not None:
            self.enc = torch.zeros_like(self.adds)
            self.dec = torch.zeros_like(self.adds)
            self.par = torch.zeros(num_slots, 3, dtype=torch.float32, device=device)
        self.device = device
        self.table = SlotTable(num_slots)
        self.vectors = NamedVectors(config.vectors_dir, sae)
        self.requests: dict[str, RequestSteering] = {}
        # The stretches of the requests holding slots (:meth:`_stretch_table`),
        # rebuilt when a request comes, goes or gets slots.
        self._stretches: tuple | None = None
        self.armed = False
        hooks: dict[tuple[int, str], list[tuple[SteerTap, int]]] = {}
        modules: dict[int, nn.Module] = {}
        for k, tap in taps.items():
            module = tap.module
            if not hasattr(module, "_hs_steer_rows"):
                module.register_buffer("_hs_steer_rows", self.rows, persistent=False)
                module.register_buffer("_hs_steer_slots", self.slots, persistent=False)
                module.register_buffer("_hs_steer_counts", self.counts, persistent=False)
                module.register_buffer("_hs_steer_adds", self.adds, persistent=False)
                module.register_buffer("_hs_steer_dirs", self.dirs, persistent=False)
                if self.token_slots is not None:
                    module.register_buffer(
                        "_hs_steer_token_slots", self.token_slots, persistent=False
                    )
                if self.enc is not None:
                    module.register_buffer("_hs_steer_enc", self.enc, persistent=False)
                    module.register_buffer("_hs_steer_dec", self.dec, persistent=False)
                    module.register_buffer("_hs_steer_par", self.par, persistent=False)
            hooks.setdefault((id(module), tap.when), []).append((tap, self.index_of[k]))
            modules[id(module)] = module
        for (module_id, when), entries in hooks.items():
            entries.sort(key=lambda e: e[0].order)
            host_counts = self.counts.numpy() if count_readable_on_host(device) else None
            hook = steer_hook(
                [(t.pair, i, t.scale) for t, i in entries], when == "post", host_counts
            )
            module = modules[module_id]
            # prepend: steer before any capture hook at the same module.
            if when == "pre":
                module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
            else:
                module.register_forward_hook(hook, with_kwargs=True, prepend=True)
        if count_readable_on_host(device):
            route = "eager: " + (
                "vllm_hidden_states._C (C++)"
                if c_ops.load()
                else f"the op's Python body ({c_ops.why_not()})"
            )
        else:
            route = "vllm_hidden_states._C CUDA" if off_cpu_route() == "c" else "Triton"
        logger.info(
            "vllm-hidden-states: %d steerable points (%s), %d vector slots of %d; writes: %s",
            len(taps),
            config.describe_points(),
            num_slots,
            hidden_size,
            route,
        )

    # -- per step --------------------------------------------------------------

    def begin_step(self, scheduler_output: Any) -> None:
        """New requests that steer (their ``SamplingParams.steering``, in
        wire form); finished ones leave."""
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            if params is not None and params.steering:
                # A preempted request comes back as new: its old slots go back.
                self.table.give_back(new.req_id)
                self.requests[new.req_id] = RequestSteering(
                    params.steering, self.vectors, self.index_of
                )
                self._stretches = None
        if self.requests and scheduler_output.finished_req_ids:
            for req_id in scheduler_output.finished_req_ids:
                if self.requests.pop(req_id, None) is not None:
                    self.table.give_back(req_id)
                    self._stretches = None

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
            if q.slots is None and r in num_scheduled and r in index_of
        ]
        if missing:  # entering the batch without table slots: upload first
            in_batch = {r for r in self.requests if r in num_scheduled and r in index_of}
            for req_id in missing:
                self._upload(req_id, self.requests[req_id], in_batch)
            self._stretches = None  # slots changed (lent, or taken back from others)
        if self._stretches is None:
            self._stretches = self._stretch_table()
        owners, point, start, end, slot, projects = self._stretches
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
        # Device rows past each count are zero (disarm), so only the armed
        # entries are copied: a few per steered request.
        self.counts_host.zero_()
        for index in np.unique(points).tolist():
            mine = points == index
            first, count, slot_of = firsts[mine], counts[mine], slots[mine]
            total = int(count.sum())
            if total == len(count):  # a row each (decode): no ranges to expand
                rows, slot_of_row = first, slot_of
            else:
                offsets = np.cumsum(count) - count
                rows = np.repeat(first - offsets, count) + np.arange(total)
                slot_of_row = np.repeat(slot_of, count)
            self.rows[index, :total].copy_(torch.from_numpy(rows), non_blocking=True)
            self.slots[index, :total].copy_(torch.from_numpy(slot_of_row), non_blocking=True)
            self.counts_host[index] = total
            if self._token_slots_np is not None:
                self._token_slots_np[index, rows] = slot_of_row
                self._token_slots_written.append((index, rows))
            self.counts_host[self.num_points + index] = bool(projecting[mine].any())
        self.counts.copy_(self.counts_host, non_blocking=True)
        self.armed = True

    def _stretch_table(self) -> tuple:
        """Every stretch of the requests holding table slots, as columns:
        owner request id, point index, start, end (open: int64 max), slot,
        projects (ablate or clamp)."""
        owners: list[str] = []
        columns: list[tuple[int, int, int, int, bool]] = []
        for req_id, request in self.requests.items():
            if request.slots is None:
                continue
            for stretch, slot, projects in zip(request.stretches, request.slots, request.projects):
                owners.append(req_id)
                end = np.iinfo(np.int64).max if stretch.end is None else stretch.end
                columns.append((stretch.index, stretch.start, end, slot, projects))
        table = np.array(columns, dtype=np.int64).reshape(-1, 5)
        return (
            owners,
            table[:, 0],
            table[:, 1],
            table[:, 2],
            table[:, 3],
            table[:, 4].astype(bool),
        )

    def _upload(self, req_id: str, request: RequestSteering, batch: set[str]) -> None:
        """Write a request's composed vectors into table slots (once per
        entry into the batch)."""
        slots = self.table.lend(req_id, request, batch)
        if not slots:
            return
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
            if self._token_slots_np is not None:
                for index, rows in self._token_slots_written:
                    self._token_slots_np[index, rows] = 0
                self._token_slots_written.clear()
            self.armed = False

    def forget(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            if self.requests.pop(req_id, None) is not None:
                self.table.give_back(req_id)
                self._stretches = None
