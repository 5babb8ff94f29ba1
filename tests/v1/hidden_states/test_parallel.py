# SPDX-License-Identifier: Apache-2.0
"""Where vLLM scales out: tensor parallel works (layers, the row capture
points, steering), data and pipeline parallel are accepted (served end to end
in test_scale_out.py, test_scale_out_pp.py); what is not supported yet is
refused at start-up with a message, before any engine process starts."""

import pytest

from vllm import SamplingParams

from .conftest import COMMON_ENGINE_ARGS, assert_close, env_set, token_ids_of

# The capture points that are the same on every tensor-parallel rank.
ROW_POINTS = "attn_out,resid_mid,mlp_out,resid_post"
ROW_KINDS = ROW_POINTS.split(",")


@pytest.fixture(scope="module")
def llm_tp2(qwen3_dir):
    import vllm.envs as envs
    from vllm import LLM

    # Two CPU workers on one NUMA node need explicit core binding. An
    # in-process engine started earlier in this session froze vLLM's env reads
    # (envs cache); drop that cache so the binding is seen.
    envs.disable_envs_cache()
    with env_set("VLLM_CPU_OMP_THREADS_BIND", "0|1"):
        engine = LLM(
            model=str(qwen3_dir),
            enable_hidden_states=True,
            # The row points: each rank's attention and MLP outputs are
            # read after their all-reduce (patterns and neurons are sharded,
            # refused below).
            hidden_states_points=ROW_POINTS,
            enable_steering=True,
            steering_points="all",
            enforce_eager=True,
            tensor_parallel_size=2,
            max_model_len=512,
            **COMMON_ENGINE_ARGS,
        )
    yield engine
    engine.llm_engine.engine_core.shutdown()


def test_tensor_parallel_2_returns_exact_states(llm_tp2, hf_qwen3):
    params = SamplingParams(
        max_tokens=6, temperature=0.0, return_hidden_states=True, hidden_states_layers=[-1, 1, -2]
    )
    (out,) = llm_tp2.generate(["Once upon a time there was"], params, use_tqdm=False)
    ref = hf_qwen3.states(token_ids_of(out))
    for layer, tensor in out.outputs[0].hidden_states.items():
        assert_close(tensor, ref[layer][-1:], f"TP=2 layer {layer}")


@pytest.mark.parametrize("positions", ["last", "all"])
def test_tensor_parallel_2_every_row_point_is_exact(llm_tp2, hf_qwen3, positions):
    """attn_out / mlp_out after their all-reduce, resid_mid and resid_post, at
    every layer, equal HF forward hooks on one unsharded model."""
    points = [f"{kind}.{i}" for kind in ROW_KINDS for i in range(hf_qwen3.num_layers)]
    params = SamplingParams(
        max_tokens=6,
        temperature=0.0,
        return_hidden_states=True,
        hidden_states_points=points,
        hidden_states_positions=positions,
    )
    (out,) = llm_tp2.generate(["Once upon a time there was"], params, use_tqdm=False)
    states = out.outputs[0].hidden_states
    assert list(states) == points
    ref = hf_qwen3.points(token_ids_of(out))
    for address, tensor in states.items():
        expected = ref[address] if positions == "all" else ref[address][-1:]
        assert_close(tensor, expected, f"TP=2 {positions} {address}")


def test_tensor_parallel_2_steers_exactly(llm_tp2, hf_qwen3):
    """Each rank writes the same intervention into its (replicated) residual
    stream, after attention's and the MLP's all-reduce."""
    import torch

    n = hf_qwen3.num_layers
    v = [
        torch.randn(hf_qwen3.hidden_size, generator=torch.Generator().manual_seed(s))
        for s in (1, 2)
    ]
    steering = [
        {"point": "resid_pre.1", "vector": v[0], "strength": 4.0},
        {"point": "mlp_out.2", "op": "ablate", "vector": v[1]},
    ]
    params = SamplingParams(
        max_tokens=6,
        temperature=0.0,
        return_hidden_states=True,
        hidden_states_layers=list(range(n + 1)),
        hidden_states_positions="all",
        steering=[{**i, "vector": i["vector"].tolist()} for i in steering],
    )
    (out,) = llm_tp2.generate(["Once upon a time there was"], params, use_tqdm=False)
    items = [{"op": "add", "strength": 1.0, **i, "start": 0, "end": None} for i in steering]
    ref = hf_qwen3.steered_states(token_ids_of(out), items)
    for layer, tensor in out.outputs[0].hidden_states.items():
        assert_close(tensor, ref[layer], f"TP=2 steered layer {layer}")


def _config(qwen3_dir, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    args = dict(
        model=str(qwen3_dir),
        enable_hidden_states=True,
        enforce_eager=True,
        max_model_len=512,
        dtype="float32",
    )
    args.update(kwargs)
    return EngineArgs(**args).create_engine_config()


def test_pipeline_parallel_is_accepted_at_start(qwen3_dir):
    """Each stage captures its own layers and sends its rows on (served and
    checked end to end in test_scale_out_pp.py)."""
    config = _config(qwen3_dir, pipeline_parallel_size=2)
    assert config.parallel_config.pipeline_parallel_size == 2


def test_pipeline_parallel_with_speculative_decoding_is_refused_at_start(qwen3_dir):
    with pytest.raises(
        ValueError,
        match=r"pipeline parallelism \(pipeline_parallel_size=2\) "
        r"with speculative decoding is not supported yet",
    ):
        _config(
            qwen3_dir,
            pipeline_parallel_size=2,
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 3,
            },
        )


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
@pytest.mark.parametrize("points", ["attn_pattern", "mlp_post.1", "attn_z.1", "all"])
def test_sharded_points_are_refused_at_start_with_tp_or_pp(qwen3_dir, parallel, points):
    """Each rank holds only its heads / neurons / layers: attention patterns,
    MLP neurons and heads' outputs are refused, naming the kinds that work
    instead."""
    with pytest.raises(
        ValueError, match=r"attention patterns, MLP neurons and heads' outputs"
    ) as e:
        _config(qwen3_dir, hidden_states_points=points, **{parallel: 2})
    assert ROW_POINTS in str(e.value)


def test_row_points_are_accepted_at_start_with_pp(qwen3_dir):
    config = _config(qwen3_dir, hidden_states_points=ROW_POINTS, pipeline_parallel_size=2)
    assert config.parallel_config.pipeline_parallel_size == 2


def test_data_parallel_is_accepted_at_start(qwen3_dir):
    """Each extract goes to the engine that served its request (served and
    checked end to end in test_scale_out.py)."""
    config = _config(qwen3_dir, data_parallel_size=2)
    assert config.parallel_config.data_parallel_size == 2
    assert "hidden_states" in config.additional_config


def test_engine_without_the_flag_is_unchanged(qwen3_dir):
    config = _config(qwen3_dir, enable_hidden_states=False)
    assert "hidden_states" not in (config.additional_config or {})
