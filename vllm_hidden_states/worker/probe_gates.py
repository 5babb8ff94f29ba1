# SPDX-License-Identifier: Apache-2.0
"""Steer actions decided in the worker, on the device, in the step that
scored their probe.

A request's ``probe_actions`` entry with ``"then": {"steer": [...]}`` reaches
the worker as gated entries of its ``steering`` (``Intervention.gate``, a
:class:`~vllm_hidden_states.contract.SteerGate`): their stretches hold table slots like
any other, uploaded with a zero vector, the vector itself kept in
``armed_adds``. After the forward, once the step's probe scores are on the
device, :meth:`RequestGates.update` carries each gate's run of consecutive
rows where the condition held and its ``fired`` flag (device tensors), and
:meth:`RequestGates.apply` writes ``adds[slot] = fired ? armed : 0`` into the
table. The next forward, stream-ordered after, adds the vector: no host sync,
so the decision is the same step's whatever the engine process learns later
(async scheduling). The engine process decides the same from the same
float32 scores and reports the firing (``engine/probe_actions.py``).
"""

import torch

from vllm_hidden_states.contract import SteerGate


class RequestGates:
    """The gated stretches of one request: each one's gate and device state
    (kept while the request lives, whatever its table slots)."""

    def __init__(self, stretches: list[int], gates: list[SteerGate], device: torch.device):
        """``stretches``: the gated stretches' indices in the request's
        stretches; ``gates``: their gates, same order."""
        self.stretches = stretches
        self.actions = [g.action for g in gates]  # each gate's action index
        self.columns = torch.tensor([g.column for g in gates], dtype=torch.int64, device=device)
        self.thresholds = torch.tensor(
            [g.threshold for g in gates], dtype=torch.float32, device=device
        )
        self.above = torch.tensor([g.above for g in gates], dtype=torch.bool, device=device)
        self.need = torch.tensor([g.consecutive for g in gates], dtype=torch.int64, device=device)
        self.runs = torch.zeros(len(gates), dtype=torch.int64, device=device)
        self.fired = torch.zeros(len(gates), dtype=torch.bool, device=device)
        # The sequence position where each gate fired, -1 before: read on
        # the host only when a preempted request resumes (resume_steering).
        self.fired_at = torch.full((len(gates),), -1, dtype=torch.int64, device=device)
        self.slots: torch.Tensor | None = None  # the stretches' table slots, once lent

    def update(self, scores: torch.Tensor, first: int) -> None:
        """Read this step's scores of the request (float32 ``[rows, sum of
        k]`` on the device, in position order from sequence position
        ``first``): runs, fired flags and firing positions carry on over
        them. Device ops only."""
        rows = scores.shape[0]
        if rows == 0:
            return
        values = scores.index_select(1, self.columns)  # [rows, gates]
        held = torch.where(self.above, values > self.thresholds, values < self.thresholds)
        at = torch.arange(rows, device=scores.device).unsqueeze(1)
        # The last row (so far) where the condition broke, -1 where none did.
        broke = torch.cummax(torch.where(held, -1, at), dim=0).values
        run = torch.where(broke >= 0, at - broke, self.runs + at + 1)
        hit = run >= self.need  # [rows, gates]
        fires = hit.any(dim=0)
        at_first_hit = hit.to(torch.int64).argmax(dim=0) + first
        self.fired_at = torch.where(fires & ~self.fired, at_first_hit, self.fired_at)
        self.fired = self.fired | fires
        self.runs = run[-1]

    def fired_positions(self) -> dict[int, int]:
        """``{action index: firing position}`` of the gates that fired. Reads
        the device: only when a preempted request comes back."""
        return {a: p for a, p in zip(self.actions, self.fired_at.tolist()) if p >= 0}

    def carry_runs(self, earlier: "RequestGates") -> None:
        """Take ``earlier``'s runs for the actions both gate (a resumed
        request's gates, rebuilt without those that fired)."""
        where = [earlier.actions.index(a) for a in self.actions]
        self.runs = earlier.runs.index_select(
            0, torch.tensor(where, dtype=torch.int64, device=self.runs.device)
        )

    def apply(self, adds: torch.Tensor, armed_adds: torch.Tensor) -> None:
        """The gated slots' rows of ``adds``: their vector where fired, zero
        before."""
        if self.slots is None:
            return
        rows = armed_adds.index_select(0, self.slots)
        adds.index_copy_(0, self.slots, torch.where(self.fired.unsqueeze(1), rows, 0.0))
