# SPDX-License-Identifier: Apache-2.0
"""Linear probes (``--probes``) scored in the worker, through ``SamplingParams``.

One engine for the module (EngineCore in its own process, so scores cross
ZMQ as float32 tensor frames): a probe directory with one probe at each kind
of point (an HF layer, resid_pre, resid_post, attn_out, resid_mid, mlp_out,
the last layer's pre-norm resid_post), with and without input
normalisation, each output function; 24-row capture buffers and chunked
prefill at 64 tokens (long captures split over steps), and a KV cache of
five 64-token blocks so that four concurrent long requests are preempted.

Every score is compared with numpy's ``f(normalise(x) @ W.T + b)`` in
float64 on HF transformers' states at the probe's point, on the token ids
vLLM reports (:func:`vllm_hidden_states.probes.score_numpy`).
"""

import uuid

import numpy as np
import pytest

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind
from vllm_hidden_states.probes import save_probe, score_numpy

from .conftest import COMMON_ENGINE_ARGS, num_preemptions, token_ids_of
from .probe_reference import probe_points

PROMPT = "Once upon a time there was a small robot who loved to count"
LONG_PROMPT = " ".join([PROMPT] * 5)  # > 48 tokens: split over 24-row steps


@pytest.fixture(scope="module")
def probe_llm(qwen3_dir, probes_dir):
    from vllm import LLM

    engine = LLM(
        model=str(qwen3_dir),
        probes=str(probes_dir),
        enforce_eager=True,
        hidden_states_max_rows=24,
        max_model_len=256,
        num_gpu_blocks_override=5,
        block_size=64,
        disable_log_stats=False,
        **dict(COMMON_ENGINE_ARGS, max_num_seqs=4),
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()


def probe_params(probes, positions="last", **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 6)
    kwargs.setdefault("temperature", 0.0)
    return SamplingParams(probes=list(probes), hidden_states_positions=positions, **kwargs)


def span_of(positions: str, out) -> slice:
    n_prompt = len(out.prompt_token_ids)
    return {
        "last": slice(-1, None),
        "all": slice(0, None),
        "prompt": slice(0, n_prompt),
        "generated": slice(n_prompt, None),
    }[positions]


@pytest.mark.parametrize(
    "positions",
    [
        pytest.param("last", marks=pytest.mark.four_modes),
        pytest.param("all", marks=pytest.mark.four_modes),
        "prompt",
        "generated",
    ],
)
def test_scores_at_every_point_kind_match_numpy_on_hf_states(
    probe_llm, reference, hf_qwen3, positions
):
    """Every probe at once, short and long (chunked, split) prompts."""
    names = list(probe_points(hf_qwen3.num_layers))
    outs = probe_llm.generate([PROMPT, LONG_PROMPT], probe_params(names, positions), use_tqdm=False)
    assert len(outs[1].prompt_token_ids) > 2 * 24  # the capture ran over several steps
    for out in outs:
        completion = out.outputs[0]
        assert completion.hidden_states is None  # probes alone: no vectors travel
        assert list(completion.probe_scores) == names
        reference.check(
            completion.probe_scores, token_ids_of(out), span_of(positions, out), positions
        )


@pytest.mark.four_modes
def test_requests_with_different_probes_share_a_batch(probe_llm, reference):
    asks = [["final"], ["post1", "attn1"], ["mid2"], ["pre2", "final", "embed"]]
    params = [probe_params(a, "all", max_tokens=8) for a in asks]
    outs = probe_llm.generate([f"{PROMPT} {i}" for i in range(4)], params, use_tqdm=False)
    for ask, out in zip(asks, outs):
        scores = out.outputs[0].probe_scores
        assert list(scores) == ask
        reference.check(scores, token_ids_of(out), slice(0, None), f"batch {ask}")


@pytest.mark.four_modes
def test_each_of_n_children_gets_the_scores_of_its_own_sequence(probe_llm, reference):
    params = probe_params(["post1", "final"], "all", n=2, temperature=1.0, seed=3, max_tokens=8)
    (out,) = probe_llm.generate([PROMPT], params, use_tqdm=False)
    assert len(out.outputs) == 2
    assert out.outputs[0].token_ids != out.outputs[1].token_ids  # two sequences
    for child in out.outputs:
        ids = list(out.prompt_token_ids) + list(child.token_ids)
        reference.check(child.probe_scores, ids, slice(0, None), f"child {child.index}")


@pytest.mark.four_modes
def test_preempted_requests_score_each_position_once(probe_llm, reference):
    prompts = [f"{PROMPT} number {i}" for i in range(4)]
    before = num_preemptions(probe_llm)
    outs = probe_llm.generate(
        prompts,
        probe_params(["attn1", "final"], "all", max_tokens=60, ignore_eos=True),
        use_tqdm=False,
    )
    assert num_preemptions(probe_llm) > before  # the case under test happened
    for out in outs:
        reference.check(out.outputs[0].probe_scores, token_ids_of(out), slice(0, None), "preempted")


def test_probes_with_hidden_states_return_both(probe_llm, reference, hf_qwen3):
    params = probe_params(["post1"], "all", return_hidden_states=True, hidden_states_layers=[2, -1])
    (out,) = probe_llm.generate([PROMPT], params, use_tqdm=False)
    completion = out.outputs[0]
    ids = token_ids_of(out)
    assert list(completion.hidden_states) == [2, -1]
    assert completion.hidden_states[2].shape == (len(ids), hf_qwen3.hidden_size)
    reference.check(completion.probe_scores, ids, slice(0, None), "with states")


def test_a_window_scores_only_its_positions(probe_llm, reference):
    window = {"start": 3, "end": 9}
    (out,) = probe_llm.generate(
        [PROMPT], probe_params(["mid2"], window, max_tokens=8), use_tqdm=False
    )
    scores = out.outputs[0].probe_scores
    assert scores["mid2"].shape[0] == 6
    reference.check(scores, token_ids_of(out), slice(3, 9), "window")


def test_streamed_deltas_concatenate_to_every_position(probe_llm, reference):
    engine = probe_llm.llm_engine
    params = probe_params(["final", "post1"], "all", output_kind=RequestOutputKind.DELTA)
    request_id = f"probe-delta-{uuid.uuid4().hex[:8]}"
    engine.add_request(request_id, PROMPT, params)
    parts, tokens, prompt = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            prompt = out.prompt_token_ids
            tokens += out.outputs[0].token_ids
            if out.outputs[0].probe_scores is not None:
                parts.append(out.outputs[0].probe_scores)
    assert len(parts) > 2  # the prompt, then a row per token fed back
    import torch

    joined = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
    reference.check(joined, list(prompt) + tokens, slice(0, None), "deltas")


@pytest.mark.parametrize(
    "bad, says",
    [
        (["nope"], r"probe 'nope' is not loaded on this engine; available probes: \["),
        (["final", "final"], r"names \['final'\] more than once"),
        ([], "non-empty list of probe names"),
        ("final", "non-empty list of probe names"),
    ],
)
def test_a_bad_probes_field_fails_alone_naming_what_is_allowed(probe_llm, bad, says):
    with pytest.raises(VLLMValidationError, match=says) as info:
        probe_llm.generate([PROMPT], SamplingParams(max_tokens=2, probes=bad), use_tqdm=False)
    assert info.value.parameter == "probes"
    (out,) = probe_llm.generate([PROMPT], probe_params(["final"]), use_tqdm=False)  # still serving
    assert out.outputs[0].probe_scores["final"].shape == (1, 1)


def test_probes_that_do_not_fit_the_model_are_refused_at_start(qwen3_dir, tmp_path, hf_qwen3):
    from vllm.engine.arg_utils import EngineArgs

    n, hidden = hf_qwen3.num_layers, hf_qwen3.hidden_size

    def start(name, weight_width, point):
        directory = tmp_path / name
        save_probe(directory / f"{name}.safetensors", np.ones((2, weight_width)), [0, 0], point)
        EngineArgs(model=str(qwen3_dir), probes=str(directory)).create_engine_config()

    with pytest.raises(ValueError, match=rf"'wide'.*{hidden + 1} wide.*hidden size is {hidden}"):
        start("wide", hidden + 1, "-1")
    with pytest.raises(ValueError, match=rf"'far'.*resid_post.{n + 3}.*out of range"):
        start("far", hidden, f"resid_post.{n + 3}")
    with pytest.raises(ValueError, match="'pattern'.*not a residual-stream row"):
        start("pattern", hidden, "attn_pattern.1")


@pytest.mark.four_modes
def test_probe_action_flags_survive_preemption_once_each(probe_llm, reference):
    """Flags on "all" positions of long, chunked, preempted requests: every
    position whose reference score is above the threshold is flagged once,
    none twice (a recomputed position is not delivered again)."""
    prompts = [f"{LONG_PROMPT} number {i}" for i in range(4)]
    threshold = 0.0  # "final" has no output function: scores of both signs
    actions = [{"probe": "final", "above": threshold, "then": "flag"}]
    before = num_preemptions(probe_llm)
    outs = probe_llm.generate(
        prompts,
        SamplingParams(
            max_tokens=40,
            temperature=0.0,
            ignore_eos=True,
            hidden_states_positions="all",
            extra_args={"probe_actions": actions},
        ),
        use_tqdm=False,
    )
    assert num_preemptions(probe_llm) > before  # the case under test happened
    for out in outs:
        ids = token_ids_of(out)
        scores = score_numpy(reference.rows(ids, "-1"), reference.probes["final"])[:, 0]
        margin = np.abs(scores[:-1] - threshold).min()
        assert margin > 1e-4 * np.abs(scores).max()  # no score on the fence
        want = [p for p in range(len(ids) - 1) if scores[p] > threshold]
        got = [f.position for f in out.outputs[0].op_results.firings]
        assert got == want
