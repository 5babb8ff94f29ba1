# SPDX-License-Identifier: Apache-2.0
"""The ``vllm.general_plugins`` entry point.

vLLM runs it once in every process it starts (CLI, API server, EngineCore,
workers) before engines, schedulers and model runners are built. It refuses to
start on a vLLM that is not 0.32.0 or not patched, and installs the model-runner
capture hooks. It is idempotent.
"""

from vllm_hidden_states.tools.patching import VLLM_VERSION


def register() -> None:
    import vllm
    from vllm.v1.engine import EngineCoreRequestType

    version = vllm.__version__.split("+")[0]
    if version != VLLM_VERSION:
        raise RuntimeError(
            f"vllm-hidden-states supports vLLM {VLLM_VERSION} exactly; found "
            f"{vllm.__version__}. Install vllm=={VLLM_VERSION}, or uninstall "
            "vllm-hidden-states."
        )
    if not hasattr(EngineCoreRequestType, "HIDDEN_STATES_EXTRACT"):
        raise RuntimeError(
            "vllm-hidden-states is installed but vLLM is not patched; run "
            "`vllm-hidden-states patch apply` (or uninstall vllm-hidden-states)"
        )
    from vllm_hidden_states.worker.capture import install_mrv1_hooks

    install_mrv1_hooks()

    from vllm_hidden_states.server import install_server_hooks

    install_server_hooks()
