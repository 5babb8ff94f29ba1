# SPDX-License-Identifier: Apache-2.0
"""Worker side: capture hidden states inside the compiled, graph-captured model.

Capture uses the models' aux-hidden-state outputs (the EAGLE3 path):
``model.set_aux_hidden_state_layers(layers)`` makes the model return
``(final_hidden, [aux_k for k in layers])`` from its forward, where ``aux_k`` is
``hidden + residual`` after ``k`` decoder layers. Those are ordinary outputs of
the torch.compile'd graph and of CUDA-graph replay, so nothing here needs eager
mode or forward hooks (which Dynamo would freeze at trace time and CUDA-graph
replay would skip). The capturable set is fixed at load time, before the first
forward (compilation and graph capture happen in the profile/warm-up run).

Per step, only when the SchedulerOutput carries a capture plan
(``scheduler_output.capture_plan``, written by
:class:`vllm_hidden_states.engine.planner.CapturePlanner`), rows are gathered
right after the forward:
graph outputs are static buffers that the next forward overwrites, so the rows
must be copied out in the same step, on the main stream, before anything else
runs. ``index_select`` makes that copy; the result then goes to the host and
rides on ``ModelRunnerOutput.captured_hidden_states``. Steps without a plan pay
one attribute check.

Covers Model Runner V1 (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``),
which CPU always runs and CUDA falls back to; V2 is refused at start-up
(see :func:`vllm_hidden_states.config.validate_engine_config`).
"""

from typing import TYPE_CHECKING, Any

import torch

from vllm.logger import init_logger
from vllm_hidden_states.config import HiddenStatesConfig

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm_hidden_states.engine.planner import CaptureStep

logger = init_logger(__name__)


class HiddenStatesCapture:
    """Per-runner capture state.

    ``_partial`` accumulates the chunks of ``positions="all"`` extracts whose
    prefill spans several steps (chunked prefill); ``_ready`` holds finished
    results until ``sample_tokens`` puts them on the ModelRunnerOutput.
    Results are ``[num_layers, num_positions, hidden_size]`` CPU tensors in the
    model dtype.
    """

    def __init__(self, config: HiddenStatesConfig) -> None:
        self.config = config
        self.final_layer = config.num_layers
        # absolute layer -> index in the model's aux output list (sorted order)
        self.aux_index = {k: i for i, k in enumerate(config.aux_layers)}
        self._partial: dict[str, list[torch.Tensor]] = {}
        self._ready: dict[str, torch.Tensor] = {}

    # -- load time -----------------------------------------------------------

    def setup_model(self, runner: Any) -> None:
        """Enable aux outputs for the capturable layers (replaces the EAGLE3
        setup, which only runs for EAGLE3 drafters; those are refused at start)."""
        from vllm.model_executor.models.interfaces import supports_eagle3

        model = runner.get_model()
        if not self.config.aux_layers:
            return  # only the final layer: the model's own output
        if not supports_eagle3(model):
            raise RuntimeError(
                f"{type(model).__name__} does not expose aux hidden states, so "
                "vllm-hidden-states cannot capture intermediate layers for it; "
                "use hidden_states_layers=[-1] or a model with the EAGLE3 "
                "interface (Llama, Qwen2, Qwen3, Mistral, Gemma, ...)"
            )
        runner.use_aux_hidden_state_outputs = True
        model.set_aux_hidden_state_layers(self.config.aux_layers)
        logger.info(
            "Hidden states: capturing layers %s (aux %s + final post-norm)",
            list(self.config.layers),
            list(self.config.aux_layers),
        )

    # -- per step ------------------------------------------------------------

    def after_forward(self, runner: Any, scheduler_output: "SchedulerOutput") -> None:
        """Gather this step's rows for every request in the capture plan."""
        steps: dict[str, "CaptureStep"] = scheduler_output.capture_plan
        state = runner.execute_model_state
        if state is None:
            return
        hidden = state.hidden_states
        aux = state.aux_hidden_states
        index_of = runner.input_batch.req_id_to_index
        query_start = runner.query_start_loc.np
        num_scheduled = scheduler_output.num_scheduled_tokens
        for req_id, step in steps.items():
            n = num_scheduled[req_id]
            row0 = int(query_start[index_of[req_id]])
            end = step.start + n
            if step.positions == "last":
                if end < step.num_tokens:
                    continue  # an earlier chunk; the last position comes later
                rows = torch.tensor([row0 + n - 1], device=hidden.device)
            else:
                if step.start == 0:
                    self._partial.pop(req_id, None)  # fresh start (or preempted)
                rows = torch.arange(row0, row0 + n, device=hidden.device)
            layers = [
                (hidden if k == self.final_layer else aux[self.aux_index[k]])
                .index_select(0, rows)
                for k in step.layers
            ]
            # [num_layers, rows, hidden] on the host. A copy, never a view of the
            # static output buffers the next forward overwrites.
            chunk = torch.stack(layers).to("cpu")
            if step.positions == "all":
                chunks = self._partial.setdefault(req_id, [])
                chunks.append(chunk)
                if end < step.num_tokens:
                    continue
                del self._partial[req_id]
                chunk = torch.cat(chunks, dim=1) if len(chunks) > 1 else chunk
            self._ready[req_id] = chunk

    def forget(self, req_ids: set[str]) -> None:
        """Drop partial results of finished or aborted requests."""
        for req_id in req_ids:
            self._partial.pop(req_id, None)
            self._ready.pop(req_id, None)

    def take_ready(self) -> dict[str, torch.Tensor] | None:
        if not self._ready:
            return None
        ready, self._ready = self._ready, {}
        return ready


def _capture_of(runner: Any) -> HiddenStatesCapture | None:
    return runner.__dict__.get("_hidden_states_capture")


def install_mrv1_hooks() -> None:
    """Wrap Model Runner V1 methods (idempotent; runs in every worker process)."""
    from vllm.v1.worker import gpu_model_runner as mrv1

    cls = mrv1.GPUModelRunner
    if getattr(cls, "_hidden_states_hooked", False):
        return
    orig_setup = cls._setup_eagle3_aux_hidden_state_outputs
    orig_execute = cls.execute_model
    orig_sample = cls.sample_tokens

    def _setup_eagle3_aux_hidden_state_outputs(self) -> None:
        config = HiddenStatesConfig.from_vllm_config(self.vllm_config)
        if config is None:
            return orig_setup(self)
        if self.use_aux_hidden_state_outputs:
            raise RuntimeError(
                "hidden states cannot share the model's aux outputs with an "
                "EAGLE3/DFlash/extract_hidden_states drafter"
            )
        capture = HiddenStatesCapture(config)
        capture.setup_model(self)
        self.__dict__["_hidden_states_capture"] = capture

    def execute_model(self, scheduler_output, *args, **kwargs):
        result = orig_execute(self, scheduler_output, *args, **kwargs)
        capture = _capture_of(self)
        if capture is not None:
            if scheduler_output.finished_req_ids and (
                capture._partial or capture._ready
            ):
                capture.forget(scheduler_output.finished_req_ids)
            if scheduler_output.capture_plan:
                with torch.inference_mode():
                    capture.after_forward(self, scheduler_output)
        return result

    def sample_tokens(self, *args, **kwargs):
        output = orig_sample(self, *args, **kwargs)
        capture = _capture_of(self)
        if capture is not None and capture._ready:
            target = getattr(output, "_model_runner_output", output)
            target.captured_hidden_states = capture.take_ready()
        return output

    cls._setup_eagle3_aux_hidden_state_outputs = _setup_eagle3_aux_hidden_state_outputs
    cls.execute_model = execute_model
    cls.sample_tokens = sample_tokens
    cls._hidden_states_hooked = True
