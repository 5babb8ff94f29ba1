# SPDX-License-Identifier: Apache-2.0
"""What the runner's capture builds once, at model load: the capture points
(and, under pipeline parallelism, which stage's rows pass where), the SAE and
the probes it encodes and scores, and the steering tables."""

from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed import get_pp_group
from vllm.logger import init_logger
from vllm_hidden_states.hidden_states_config import HiddenStatesConfig
from vllm_hidden_states.layers import point_layout
from vllm_hidden_states.points import layer_of_id
from vllm_hidden_states.worker.capture_points import CapturePoints

if TYPE_CHECKING:
    from vllm_hidden_states.probes import ProbeSet
    from vllm_hidden_states.worker.steering_tables import Steering

logger = init_logger(__name__)


def place_points(
    config: HiddenStatesConfig, runner: Any, is_last_stage: bool
) -> tuple[CapturePoints, list[int], list[int]] | None:
    """Capture points for each capturable id but ``L`` (before decoder layer
    ``k < L``, and the points past ``L`` where the layout reads them), with
    the layers earlier pipeline stages capture (their rows arrive with the
    received tensors) and those this stage sends on (earlier stages' and its
    own; none on the last stage), ascending. None when only the final layer
    is capturable: the model's own output."""
    model = runner.get_model()
    inner = list(config.inner_layers)
    if not inner:
        return None
    model_config = runner.vllm_config.model_config
    try:
        points = CapturePoints(
            model,
            inner,
            num_layers=config.num_layers,
            hidden_size=model_config.get_hidden_size(),
            max_rows=config.max_rows,
            dtype=model_config.dtype,
            device=runner.device,
            layout=point_layout(config.architecture),
        )
    except LookupError as e:
        raise RuntimeError(
            f"vllm-hidden-states cannot place capture points in "
            f"{type(model).__name__} ({e}); it can still serve layer -1 "
            "(the final post-norm state): start with --hidden-states-layers -1"
        ) from None
    start = points.start_layer
    carried = [k for k in inner if layer_of_id(k, config.num_layers) < start]
    sent = [] if is_last_stage else carried + points.layers
    if get_pp_group().world_size > 1:
        logger.info(
            "vllm-hidden-states: pipeline stage with layers [%d, %d): "
            "captures %s, receives %s, sends %s",
            start,
            points.end_layer,
            points.layers,
            carried,
            sent,
        )
    return points, carried, sent


def load_capture_sae(config: HiddenStatesConfig, device: torch.device, is_last_stage: bool) -> Any:
    """The SAE whose features requests ask for, on the stage that encodes
    them (the last); None without ``--sae`` or elsewhere."""
    if config.sae is None or not is_last_stage:
        return None
    from vllm_hidden_states.sae import load_sae

    sae = load_sae(config.sae["path"], layer=config.sae_layer, device=device)
    logger.info(
        "vllm-hidden-states: SAE %s (d_sae=%d) on %s, %s",
        config.sae["name"],
        sae.d_sae,
        config.sae.get("point") or f"layer {config.sae_layer}",
        device,
    )
    return sae


def load_probes(
    config: HiddenStatesConfig, device: torch.device, is_last_stage: bool
) -> "ProbeSet | None":
    """The probes' weights on the device of the stage that scores them (the
    last); None without ``--probes`` or elsewhere."""
    if not config.probes or not is_last_stage:
        return None
    from vllm_hidden_states.probes import ProbeSet

    probes = ProbeSet(list(config.probes.values()), device)
    logger.info(
        "vllm-hidden-states: %d probes on %s: %s",
        len(probes),
        device,
        ", ".join(f"{n} ({p['point']}, k={p['k']})" for n, p in config.probes.items()),
    )
    return probes


def make_steering(config: HiddenStatesConfig, runner: Any, sae: Any) -> "Steering | None":
    """Steering hooks at the steerable points (made after the capture hooks:
    they are prepended, so a point is steered before it is captured); None
    without ``--enable-steering``. ``sae``: the capture's, if this stage
    loaded one; else its own copy for clamps and feature steering."""
    from vllm_hidden_states.steering_config import SteeringConfig

    steering = SteeringConfig.from_vllm_config(runner.vllm_config)
    if steering is None:
        return None
    from vllm_hidden_states.worker.steering_tables import Steering

    if sae is None and config.sae is not None:
        from vllm_hidden_states.sae import load_sae

        sae = load_sae(config.sae["path"], layer=config.sae_layer, device=runner.device)
    vllm_config = runner.vllm_config
    return Steering(
        steering,
        runner.get_model(),
        hidden_size=vllm_config.model_config.get_hidden_size(),
        max_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
        device=runner.device,
        layout=point_layout(config.architecture),
        sae=sae,
    )
