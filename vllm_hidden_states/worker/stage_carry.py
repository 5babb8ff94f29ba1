# SPDX-License-Identifier: Apache-2.0
"""Capture rows carried between pipeline stages, on the IntermediateTensors
each stage sends the next (one more entry, :data:`CARRY_KEY`)."""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from vllm.sequence import IntermediateTensors

if TYPE_CHECKING:
    from vllm_hidden_states.worker.capture_points import CapturePoints

# The IntermediateTensors entry that carries earlier pipeline stages' rows.
CARRY_KEY = "hidden_states_capture"


class StageCarry:
    """One stage's share of the carried rows.

    Attributes:
        carried_layers: capture ids earlier stages capture, whose rows arrive
            with the received tensors, ascending.
        sent_layers: those this stage sends on (earlier stages', then its
            own; none on the last stage).
        index: ``{capture id: its row in rows}`` of ``carried_layers``.
        rows: this step's rows from earlier stages, ``[len(carried_layers),
            rows, hidden]``, or None.
    """

    def __init__(self, carried_layers: Sequence[int] = (), sent_layers: Sequence[int] = ()) -> None:
        self.carried_layers = list(carried_layers)
        self.sent_layers = list(sent_layers)
        self.index = {k: i for i, k in enumerate(self.carried_layers)}
        self.rows: torch.Tensor | None = None

    def take(self, intermediate_tensors: IntermediateTensors | None) -> None:
        """Before a stage's forward: take earlier stages' rows off the
        received tensors (only a step with a plan has them; reading
        ``tensors`` waits for the receive, which the forward would do
        anyway)."""
        self.rows = None
        if intermediate_tensors is not None:
            # Always off: vLLM would look for the key in its own buffers.
            carried = intermediate_tensors.tensors.pop(CARRY_KEY, None)
            self.rows = carried if self.carried_layers else None

    def check(self, inner_count: int) -> None:
        """RuntimeError when this step's ``inner_count`` buffered rows did
        not arrive from the previous stage."""
        want = (len(self.carried_layers), inner_count)
        got = None if self.rows is None else tuple(self.rows.shape[:2])
        if self.carried_layers and inner_count and got != want:
            raise RuntimeError(
                f"vllm-hidden-states: expected rows of layers {self.carried_layers} "
                f"x {inner_count} from the previous pipeline stage, got "
                f"{'none' if got is None else got}"
            )

    def carry_on(self, points: "CapturePoints | None", inner_count: int) -> torch.Tensor | None:
        """A non-last stage: ``[len(sent_layers), rows, hidden]``, earlier
        stages' rows then this stage's, to send to the next stage (a new
        tensor: the buffers are rewritten by the next forward while the send
        may still be in flight). None when no row passes the buffers."""
        if not inner_count or not self.sent_layers:
            return None
        own = [] if points is None else [points.read(k) for k in points.layers]
        if not self.carried_layers:
            return torch.stack(own)  # the first stage
        assert self.rows is not None  # check() saw them arrive
        if not own:
            return self.rows.clone()  # a middle stage without capture points
        return torch.cat([self.rows, torch.stack(own)])

    @staticmethod
    def send(model_output: Any, carry: torch.Tensor) -> IntermediateTensors:
        """The stage's output tensors with ``carry`` added."""
        return IntermediateTensors({**model_output.tensors, CARRY_KEY: carry})
