# SPDX-License-Identifier: Apache-2.0
"""Where vLLM scales out: tensor parallel works (layers, the row capture
points, the points sharded by heads or neurons, gathered across the ranks,
steering, per-head patching), data and pipeline parallel are accepted (served
end to end in test_scale_out.py, test_scale_out_pp.py); what is not supported
yet is refused at start-up with a message, before any engine process starts."""

import numpy as np
import pytest
import torch

from vllm import SamplingParams

from .conftest import COMMON_ENGINE_ARGS, assert_close, env_set, token_ids_of
from .test_activation_patching import (
    DONOR,
    PROMPT,
    assert_like_hf,
    head_dim_of,
    head_reference,
    head_rows,
    params,
    patch,
    reference_item,
)

# The capture points that are the same on every tensor-parallel rank.
ROW_POINTS = "attn_out,resid_mid,mlp_out,resid_post"
ROW_KINDS = ROW_POINTS.split(",")
# The points each rank holds a share of (its heads, its MLP neurons),
# gathered across the ranks after the forward. The tiny Qwen3's one KV head
# is replicated on both ranks: k and v are refused (below).
SHARDED_KINDS = ["attn_z", "q", "mlp_post"]


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
            # read after their all-reduce; the heads' outputs, queries and
            # MLP neurons: each rank's share, gathered (patterns are refused
            # below).
            hidden_states_points=",".join([ROW_POINTS, *SHARDED_KINDS]),
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


@pytest.mark.parametrize("kind", SHARDED_KINDS)
def test_tensor_parallel_2_returns_sharded_points_in_head_order(llm_tp2, hf_qwen3, kind):
    """attn_z / q ([positions, heads, head_dim]) and mlp_post ([positions,
    intermediate_size]) at every layer, each rank's heads or neurons
    gathered in order, equal HF hooks on one unsharded model."""
    assert_every_layer_of_kind_is_hf(llm_tp2, hf_qwen3, kind, 6, "TP=2")


def assert_every_layer_of_kind_is_hf(llm, hf, kind: str, max_tokens: int, what: str) -> None:
    """``kind`` at every layer, every position of prompt and output, equal
    HF hooks (shapes and values)."""
    points = [f"{kind}.{i}" for i in range(hf.num_layers)]
    params_ = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        return_hidden_states=True,
        hidden_states_points=points,
        hidden_states_positions="all",
    )
    (out,) = llm.generate([PROMPT], params_, use_tqdm=False)
    states = out.outputs[0].hidden_states
    assert list(states) == points
    ref = hf.points(token_ids_of(out))
    for address, tensor in states.items():
        assert tensor.shape == ref[address].shape, address
        assert_close(tensor, ref[address], f"{what} {address}")


def _donor_points(llm, hf) -> dict:
    return hf.points(llm.get_tokenizer()(DONOR)["input_ids"])


def test_tensor_parallel_2_patches_a_head_of_the_second_rank_like_hf_hooks(llm_tp2, hf_qwen3):
    """Head 1 of attn_z.2 (rank 1's) over positions 2..5 from a donor: rank
    1 writes it, rank 0 keeps head 0; every layer equals HF pre-hooks on
    o_proj replacing those columns."""
    donor = _donor_points(llm_tp2, hf_qwen3)
    item = {"point": "attn_z.2", "op": "patch", "heads": [1],
            "rows": head_rows(donor["attn_z.2"][2:6], [1]).numpy(),
            "positions": {"start": 2, "end": 6}}  # fmt: skip
    (out,) = llm_tp2.generate([PROMPT], params([item]), use_tqdm=False)
    assert_like_hf(out, hf_qwen3, [head_reference(item, hf_qwen3)], "TP=2 patch head 1")


def test_tensor_parallel_2_ablates_a_head_of_the_first_rank_like_hf_hooks(llm_tp2, hf_qwen3):
    """ablate_heads of head 0 at attn_z.1 (rank 0's) at every position."""
    item = {"point": "attn_z.1", "op": "ablate_heads", "heads": [0]}
    (out,) = llm_tp2.generate([PROMPT], params([item]), use_tqdm=False)
    assert_like_hf(out, hf_qwen3, [head_reference(item, hf_qwen3)], "TP=2 ablate head 0")


def test_tensor_parallel_2_patches_every_head_across_both_ranks_like_hf_hooks(llm_tp2, hf_qwen3):
    """A plain patch of attn_z.3 (every head, rows [n, heads, head_dim]):
    each rank writes its half of the columns."""
    donor = _donor_points(llm_tp2, hf_qwen3)
    item = patch("attn_z.3", donor["attn_z.3"][3:5].float(), 3)
    (out,) = llm_tp2.generate([PROMPT], params([item]), use_tqdm=False)
    assert_like_hf(out, hf_qwen3, [reference_item(item)], "TP=2 patch every head")


def test_tensor_parallel_2_reads_back_a_patched_head_bit_for_bit(llm_tp2, hf_qwen3):
    """attn_z.2 captured after a patch of head 1 over positions 2..5: head
    1's columns are the given rows exactly there (written on rank 1,
    gathered); head 0's are the model's own (HF's)."""
    d = head_dim_of(hf_qwen3)
    rows = np.random.default_rng(5).standard_normal((4, 1, d)).astype(np.float32)
    item = {"point": "attn_z.2", "op": "patch", "heads": [1], "rows": rows,
            "positions": {"start": 2, "end": 6}}  # fmt: skip
    (out,) = llm_tp2.generate(
        [PROMPT], params([item], hidden_states_points=["attn_z.2"]), use_tqdm=False
    )
    got = out.outputs[0].hidden_states["attn_z.2"]  # [positions, heads, head_dim]
    assert torch.equal(got[2:6, 1], torch.from_numpy(rows[:, 0]))
    own = hf_qwen3.points(token_ids_of(out))["attn_z.2"]
    assert_close(got[:, 0], own[:, 0], "TP=2 head 0 of attn_z.2 beside the patch")


@pytest.fixture(scope="module")
def small_llama_dir():
    """Llama, 5 layers, 4 query heads sharing 2 KV heads (GQA): with two
    ranks each holds 2 query heads and a KV head of its own."""
    from vllm_hidden_states.tools.tiny_models import build_tiny_model

    from .conftest import MODELS

    return build_tiny_model(
        MODELS / "small-llama", arch="llama", num_layers=5, hidden_size=256, vocab_size=512
    )


@pytest.fixture(scope="module")
def llm_tp2_gqa(small_llama_dir):
    import vllm.envs as envs
    from vllm import LLM

    envs.disable_envs_cache()
    with env_set("VLLM_CPU_OMP_THREADS_BIND", "0|1"):
        engine = LLM(
            model=str(small_llama_dir),
            enable_hidden_states=True,
            hidden_states_points=",".join(GQA_KINDS),
            enforce_eager=True,
            tensor_parallel_size=2,
            max_model_len=512,
            **COMMON_ENGINE_ARGS,
        )
    yield engine
    engine.llm_engine.engine_core.shutdown()


# Queries, keys, values and heads' outputs of a GQA model: each rank holds
# whole KV heads, so keys and values gather like the query heads.
GQA_KINDS = ["q", "k", "v", "attn_z"]


@pytest.mark.parametrize("kind", GQA_KINDS)
def test_tensor_parallel_2_returns_grouped_query_heads_in_head_order(
    llm_tp2_gqa, small_llama_dir, kind
):
    """Under GQA (4 query heads, 2 KV heads, one per rank): q and attn_z
    ``[positions, 4, head_dim]``, k and v ``[positions, 2, head_dim]`` at
    every layer equal HF's attention arguments / o_proj input."""
    from .conftest import HFReference

    hf = HFReference(small_llama_dir)
    assert_every_layer_of_kind_is_hf(llm_tp2_gqa, hf, kind, 4, "TP=2 GQA")


def test_keys_and_values_of_distinct_kv_heads_are_accepted_at_start_with_tp(small_llama_dir):
    config = _config(small_llama_dir, hidden_states_points="k.1,v.1", tensor_parallel_size=2)
    assert config.model_config.get_total_num_kv_heads() == 2


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


@pytest.mark.parametrize("points", ["attn_pattern", "mlp_post.1", "attn_z.1", "q.1", "all"])
def test_sharded_points_are_refused_at_start_with_pp(qwen3_dir, points):
    """The stages hand on rows of hidden_size only: attention patterns, MLP
    neurons, heads' outputs, queries, keys and values are refused, naming
    the kinds that work instead."""
    with pytest.raises(
        ValueError, match=r"attn_pattern, mlp_post, attn_z, q, k, v .* pipeline parallelism"
    ) as e:
        _config(qwen3_dir, hidden_states_points=points, pipeline_parallel_size=2)
    assert ROW_POINTS in str(e.value)


@pytest.mark.parametrize("points", ["attn_pattern", "all"])
def test_attention_patterns_are_refused_at_start_with_tp(qwen3_dir, points):
    """Each rank holds only its heads' queries and keys (patterns are not
    gathered)."""
    with pytest.raises(
        ValueError, match=r"attention patterns \(attn_pattern .* tensor parallelism"
    ) as e:
        _config(qwen3_dir, hidden_states_points=points, tensor_parallel_size=2)
    assert ROW_POINTS in str(e.value)


@pytest.mark.parametrize("points", ["k.1", "v", "all"])
def test_keys_and_values_of_replicated_kv_heads_are_refused_at_start_with_tp(qwen3_dir, points):
    """The tiny Qwen3 has one KV head: with two ranks vLLM replicates it, so
    the ranks' keys and values are copies, not slices in head order."""
    assert _config(qwen3_dir).model_config.get_total_num_kv_heads() == 1
    with pytest.raises(
        ValueError, match=r"keys and values .* num_key_value_heads=1 is not a multiple"
    ):
        _config(qwen3_dir, hidden_states_points=points, tensor_parallel_size=2)


def test_sharded_points_are_accepted_at_start_with_tp(qwen3_dir):
    points = "attn_z.1,q.1,mlp_post"
    config = _config(qwen3_dir, hidden_states_points=points, tensor_parallel_size=2)
    assert config.parallel_config.tensor_parallel_size == 2


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
