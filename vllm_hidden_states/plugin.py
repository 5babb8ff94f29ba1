# SPDX-License-Identifier: Apache-2.0
"""The ``vllm.general_plugins`` entry point.

vLLM runs it once in every process it starts (CLI, API server, EngineCore,
workers) before engines, schedulers and model runners are built. It refuses to
start on a vLLM version with no patch set here
(:mod:`vllm_hidden_states.versions`) or not patched (the model runner reaches
the capture code through the patch set's call-outs). It is idempotent.
"""

from vllm_hidden_states import versions


def _share_vllm_logging() -> None:
    """Log through vLLM's logger: vLLM configures handlers and level for the
    ``vllm`` logger only (when it sets logging up, possibly after this runs),
    so ``vllm_hidden_states.*`` records (``init_logger``) would otherwise fall
    to Python's last-resort handler, unformatted and without INFO. Making the
    package logger a child of ``vllm`` routes them through whatever vLLM
    configures, with its level."""
    import logging

    ours = logging.getLogger("vllm_hidden_states")
    ours.parent = logging.getLogger("vllm")


def register() -> None:
    from vllm.v1.engine import EngineCoreRequestType

    try:
        versions.running()
    except versions.UnsupportedVersion as e:
        raise RuntimeError(f"{e} Or uninstall vllm-hidden-states.") from None
    if not hasattr(EngineCoreRequestType, "HIDDEN_STATES_EXTRACT"):
        raise RuntimeError(
            "vllm-hidden-states is installed but vLLM is not patched; run "
            "`vllm-hidden-states patch apply` (or uninstall vllm-hidden-states)"
        )
    _share_vllm_logging()
