# SPDX-License-Identifier: Apache-2.0
"""One steered request on the worker, as its tables need it.

:class:`RequestSteering` splits a request's interventions (wire form) into
stretches of positions with the same interventions per point, each composed
into one (add, dir) pair, plus its patch rows and its splice;
:class:`NamedVectors` is where their vectors come from.
"""

from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_hidden_states.contract import Intervention, SteerGate
from vllm_hidden_states.patch_rows import rows_of_bytes
from vllm_hidden_states.steering_config import REWRITE_OPS, vector_files
from vllm_hidden_states.worker.steering_op import compose

# Where a stretch's entries are armed: the steering op's index, the patch
# op's (a patch table row per position), the splice op's (an edit-table slot).
STEER, PATCH, SPLICE = 0, 1, 2


@dataclass
class Stretch:
    """Positions ``start .. end - 1`` (``end`` None: on) of one request at
    one steerable point, steered by table slot ``slot``."""

    index: int  # the point's position in counts
    start: int
    end: int | None
    slot: int
    dest: int = STEER


class RequestSteering:
    """One request's interventions, split into stretches of positions with
    the same interventions per point, each one composed (add, dir) pair; its
    patch rows (a stretch of one position each) and its splice, if any."""

    def __init__(
        self,
        wire: list[Intervention],
        vectors: "NamedVectors",
        index_of: dict[int, int],
        hidden_size: int,
        widths: dict[int, int] | None = None,
        table_width: int | None = None,
        columns: dict[int, slice] | None = None,
    ):
        """``widths``: the width of each point not ``hidden_size`` wide (attn_z
        ids: every head's, as the rows come); ``table_width``: the patch
        table's (default ``hidden_size``), to which patch rows are padded;
        ``columns``: of such a point, the columns this tensor-parallel rank
        holds (its heads), to which its rows are cut (absent: all)."""
        self.wire = wire
        # A steer action's entries (``gate`` set) are a point's only ones
        # (front-end rule): grouped apart, their stretches gated.
        by_point: dict[tuple[int, int], list[Intervention]] = {}
        for item in wire:
            action = -1 if item.gate is None else item.gate.action
            by_point.setdefault((item.id, action), []).append(item)
        self.stretches: list[Stretch] = []
        # Per stretch: the gate of the steer action that turns it on, or None.
        self.gates: list[SteerGate | None] = []
        self.pairs: list[tuple[np.ndarray, np.ndarray]] = []
        # Per stretch: (encoder column, bias, threshold, value, decoder row)
        # of its clamp, or None (a clamp is alone at its point).
        self.clamps: list[tuple[np.ndarray, float, float, float, np.ndarray] | None] = []
        # Per stretch: whether it projects (ablates or clamps), not only adds.
        self.projects: list[bool] = []
        # Patches: one stretch per position (``patch_stretches``), its row in
        # ``patch_rows`` float32 [positions, table width] (same order); an
        # ablate_heads: one stretch over its span, one row.
        self.patch_stretches: list[Stretch] = []
        patch_rows: list[np.ndarray] = []
        # The splice: (stretch, edits [[feature, mode, value]], keep_error).
        self.splice: tuple[Stretch, list[list[float]], bool] | None = None
        for (capture_id, _), items in by_point.items():
            if items[0].op in REWRITE_OPS:  # alone at its point (front-end rule)
                width = (widths or {}).get(capture_id, hidden_size)
                keep = (columns or {}).get(capture_id, slice(None))
                for item in items:
                    self._rewrite(item, index_of[capture_id], vectors, width, patch_rows, keep)
                continue
            bounds = sorted({x.start for x in items} | {x.end for x in items if x.end is not None})
            for lo, hi in zip(bounds, [*bounds[1:], None]):
                active = [
                    x
                    for x in items
                    if x.start <= lo and (x.end is None or (hi is not None and hi <= x.end))
                ]
                if not active:
                    continue
                first = active[0]
                self.stretches.append(Stretch(index_of[capture_id], lo, hi, 0))
                self.gates.append(first.gate)
                if first.op == "clamp_sae_feature":
                    assert first.sae_feature is not None and first.value is not None
                    column, bias, threshold, row = vectors.sae_columns(first.sae_feature)
                    zero = np.zeros_like(row)
                    self.pairs.append((zero, zero))
                    self.projects.append(True)
                    self.clamps.append((column, bias, threshold, first.value, row))
                    continue
                self.clamps.append(None)
                self.projects.append(any(x.op == "ablate" for x in active))
                self.pairs.append(compose([(x.op, vectors.get(x), x.strength) for x in active]))
        wide = table_width or hidden_size
        self.patch_rows = np.zeros((sum(r.shape[0] for r in patch_rows), wide), np.float32)
        at = 0
        for rows in patch_rows:  # narrower rows padded (the op reads its point's width)
            self.patch_rows[at : at + rows.shape[0], : rows.shape[1]] = rows
            at += rows.shape[0]

    def _rewrite(
        self,
        item: Intervention,
        index: int,
        vectors: "NamedVectors",
        hidden_size: int,
        patch_rows: list[np.ndarray],
        columns: slice,
    ) -> None:
        """One rewrite's stretches; a patch's rows (``[n, hidden_size]``, NaN
        keeping a value) cut to ``columns`` into ``patch_rows``."""
        start = item.start
        if item.op == "sae_splice":
            stretch = Stretch(index, start, item.end, 0, SPLICE)
            self.splice = (stretch, list(item.edits or []), item.keep_error)
            return
        if item.rows is not None:
            rows = rows_of_bytes(item.rows, hidden_size)
        else:
            assert item.name is not None  # a patch has rows or a matrix name
            rows = vectors.matrix(item.name)
        rows = rows[:, columns]
        patch_rows.append(rows)
        if item.op == "ablate_heads":  # one row over the whole span
            self.patch_stretches.append(Stretch(index, start, item.end, 0, PATCH))
            return
        self.patch_stretches.extend(
            Stretch(index, start + p, start + p + 1, 0, PATCH) for p in range(rows.shape[0])
        )


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

    def matrix(self, name: str) -> np.ndarray:
        """A ``[n, hidden]`` matrix of ``--steering-vectors`` (patch rows)."""
        if name not in self._loaded:
            from safetensors import safe_open

            path, key = self._files[name]
            with safe_open(path, framework="numpy") as f:
                self._loaded[name] = np.asarray(f.get_tensor(key), dtype=np.float32)
        return self._loaded[name]

    def get(self, item: Intervention) -> np.ndarray:
        """The direction of an add, ablate or clamp, float32 ``[hidden_size]``."""
        if item.vector is not None:
            return np.asarray(item.vector, dtype=np.float32)
        if item.sae_feature is not None:
            return self.sae_columns(item.sae_feature)[3]
        name = item.name
        assert name is not None  # check_steering gives every direction a source
        if name not in self._loaded:
            from safetensors import safe_open

            path, key = self._files[name]
            with safe_open(path, framework="numpy") as f:
                self._loaded[name] = np.asarray(f.get_tensor(key), dtype=np.float32)
        return self._loaded[name]
