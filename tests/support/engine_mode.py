# SPDX-License-Identifier: Apache-2.0
"""What an engine resolved: its model runner, scheduling and CUDA graph mode
(the GPU tier's report and the CUDA benchmark record them beside results)."""


def engine_mode(llm) -> dict:
    """``{"runner": "V1"|"V2", "async_scheduling", "cudagraph_mode",
    "enforce_eager"}`` of an ``LLM``. The runner is read from
    ``vllm_config.use_v2_model_runner``, which consults
    ``VLLM_USE_V2_MODEL_RUNNER`` when asked: call it with the environment the
    engine was started in."""
    config = llm.llm_engine.vllm_config
    graphs = config.compilation_config.cudagraph_mode
    return {
        "runner": "V2" if config.use_v2_model_runner else "V1",
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "cudagraph_mode": getattr(graphs, "name", str(graphs)),
        "enforce_eager": bool(config.model_config.enforce_eager),
    }
