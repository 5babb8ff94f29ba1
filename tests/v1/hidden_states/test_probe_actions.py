# SPDX-License-Identifier: Apache-2.0
"""Probe actions (``probe_actions``), decided in the engine, through ``LLM``.

One engine for the module (EngineCore in its own process) with the probe
directory of ``test_probes.py``. Every expectation comes from numpy scores
on HF transformers' states of the token ids vLLM reports: the first position
whose reference score crosses the threshold is where a "stop" must end the
output, and the positions where the condition holds are what a "flag" must
list. Thresholds are put between two reference scores, far from both, so
that float32 rounding cannot move a crossing.
"""

import numpy as np
import pytest

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind
from vllm_hidden_states.probes import score_numpy

from .conftest import COMMON_ENGINE_ARGS, num_preemptions, token_ids_of
from .test_probes import PROMPT

PROBE = "post1"  # resid_post.1, sigmoid, 3 outputs
FINAL = "final"  # layer -1, one output
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def action_llm(qwen3_dir, probes_dir):
    from vllm import LLM

    engine = LLM(
        model=str(qwen3_dir),
        probes=str(probes_dir),
        enforce_eager=True,
        max_model_len=256,
        **COMMON_ENGINE_ARGS,
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()


def params(actions=None, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("ignore_eos", True)
    extra = {"probe_actions": actions} if actions is not None else None
    return SamplingParams(extra_args=extra, **kwargs)


def ref_scores(reference, token_ids, probe, column=0) -> np.ndarray:
    """float64 reference scores of ``probe``'s output ``column``, one per position."""
    p = reference.probes[probe]
    return score_numpy(reference.rows(token_ids, p.point), p)[:, column]


def threshold_between(scores: np.ndarray, rank: int) -> float:
    """A threshold midway between the ``rank``-th and next largest of
    ``scores`` (far from every score, relative to float32 rounding)."""
    ordered = np.sort(scores)[::-1]
    low, high = ordered[rank + 1], ordered[rank]
    assert high - low > 1e-4 * max(abs(high), 1e-3), "scores too close to split"
    return float((low + high) / 2)


@pytest.fixture(scope="module")
def free_run(action_llm):
    """The unmonitored greedy run every test compares with."""
    (out,) = action_llm.generate([PROMPT], params(), use_tqdm=False)
    return out


def first_crossing(scores: np.ndarray, threshold: float, start: int, above=True, run=1):
    held = scores > threshold if above else scores < threshold
    count = 0
    for p in range(start, len(scores)):
        count = count + 1 if held[p] else 0
        if count >= run:
            return p
    return None


@pytest.mark.four_modes
def test_stop_ends_the_output_at_the_first_position_whose_score_crosses(
    action_llm, reference, free_run
):
    ids = token_ids_of(free_run)
    n_prompt = len(free_run.prompt_token_ids)
    scores = ref_scores(reference, ids, PROBE, 1)
    generated = scores[n_prompt:-1]  # positions scored as they are computed
    threshold = threshold_between(generated, 3)
    want = first_crossing(scores[:-1], threshold, n_prompt)
    assert want is not None and want < len(ids) - 2  # the stop cuts the output short
    actions = [{"probe": PROBE, "output": 1, "above": threshold, "then": "stop"}]
    (out,) = action_llm.generate([PROMPT], params(actions), use_tqdm=False)
    completion = out.outputs[0]
    # The tokens up to the firing position, none after it.
    assert list(completion.token_ids) == ids[n_prompt : want + 1]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == PROBE
    (firing,) = completion.op_results.firings
    assert (firing.label, firing.position, firing.then) == (PROBE, want, "stop")
    assert firing.score == pytest.approx(scores[want], rel=1e-4, abs=1e-6)
    reference.check(
        {PROBE: completion.probe_scores[PROBE]}, token_ids_of(out), slice(n_prompt, None), "stop"
    )


@pytest.mark.four_modes
def test_stop_never_fires_when_no_score_crosses(action_llm, reference, free_run):
    ids = token_ids_of(free_run)
    top = float(ref_scores(reference, ids, FINAL).max())
    actions = [{"probe": FINAL, "above": top + 1.0, "then": "stop"}]
    (out,) = action_llm.generate([PROMPT], params(actions), use_tqdm=False)
    completion = out.outputs[0]
    assert list(completion.token_ids) == list(free_run.outputs[0].token_ids)
    assert completion.finish_reason == "length"
    assert completion.op_results is None


def test_a_stop_in_the_prompt_stops_before_the_first_token(action_llm, reference, free_run):
    ids = token_ids_of(free_run)
    n_prompt = len(free_run.prompt_token_ids)
    scores = ref_scores(reference, ids, FINAL)
    threshold = threshold_between(scores[:n_prompt], 0)
    want = first_crossing(scores, threshold, 0)
    assert want < n_prompt
    actions = [{"probe": FINAL, "above": threshold}]  # "then" defaults to "stop"
    (out,) = action_llm.generate(
        [PROMPT], params(actions, hidden_states_positions="all"), use_tqdm=False
    )
    completion = out.outputs[0]
    assert list(completion.token_ids) == []
    assert completion.finish_reason == "stop"
    assert [f.position for f in completion.op_results.firings] == [want]


def test_below_and_for_need_that_many_positions_in_a_row(action_llm, reference, free_run):
    ids = token_ids_of(free_run)
    n_prompt = len(free_run.prompt_token_ids)
    scores = ref_scores(reference, ids, FINAL)
    threshold = float(np.median(scores[n_prompt:-1]))
    want = first_crossing(scores[:-1], threshold, n_prompt, above=False, run=2)
    assert want is not None
    actions = [{"probe": FINAL, "below": threshold, "for": 2, "then": "stop"}]
    (out,) = action_llm.generate([PROMPT], params(actions), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == want + 1 - n_prompt
    assert [f.position for f in out.outputs[0].op_results.firings] == [want]


@pytest.mark.four_modes
def test_flag_lists_every_position_where_the_condition_held(action_llm, reference, free_run):
    ids = token_ids_of(free_run)
    n_prompt = len(free_run.prompt_token_ids)
    scores = ref_scores(reference, ids, PROBE, 1)
    threshold = threshold_between(scores[n_prompt:-1], 5)
    actions = [{"probe": PROBE, "output": 1, "above": threshold, "then": "flag"}]
    (out,) = action_llm.generate([PROMPT], params(actions), use_tqdm=False)
    completion = out.outputs[0]
    assert list(completion.token_ids) == list(free_run.outputs[0].token_ids)  # goes on
    want = [p for p in range(n_prompt, len(ids) - 1) if scores[p] > threshold]
    assert [f.position for f in completion.op_results.firings] == want
    assert {f.then for f in completion.op_results.firings} == {"flag"}


@pytest.mark.four_modes
def test_monitored_differently_monitored_and_plain_requests_share_a_batch(
    action_llm, reference, free_run
):
    ids = token_ids_of(free_run)
    n_prompt = len(free_run.prompt_token_ids)
    scores = ref_scores(reference, ids, FINAL)
    threshold = threshold_between(scores[n_prompt:-1], 2)
    stop_at = first_crossing(scores[:-1], threshold, n_prompt)
    stop = [{"probe": FINAL, "above": threshold, "then": "stop"}]
    flag = [{"probe": FINAL, "above": threshold, "then": "flag"}]
    asks = [params(stop), params(flag), params(), params(stop)]
    outs = action_llm.generate([PROMPT] * 4, asks, use_tqdm=False)
    free = list(free_run.outputs[0].token_ids)
    assert list(outs[0].outputs[0].token_ids) == ids[n_prompt : stop_at + 1]
    assert list(outs[3].outputs[0].token_ids) == ids[n_prompt : stop_at + 1]
    assert list(outs[1].outputs[0].token_ids) == free
    flagged = [p for p in range(n_prompt, len(ids) - 1) if scores[p] > threshold]
    assert [f.position for f in outs[1].outputs[0].op_results.firings] == flagged
    assert list(outs[2].outputs[0].token_ids) == free
    assert outs[2].outputs[0].op_results is None and outs[2].outputs[0].probe_scores is None


def test_each_of_n_children_acts_on_its_own_scores(action_llm, reference):
    sampled = params(
        None, probes=[FINAL], hidden_states_positions="generated", n=2, temperature=1.0, seed=7
    )
    (free,) = action_llm.generate([PROMPT], sampled, use_tqdm=False)
    n_prompt = len(free.prompt_token_ids)
    per_child = [
        ref_scores(reference, list(free.prompt_token_ids) + list(c.token_ids), FINAL)
        for c in free.outputs
    ]
    threshold = float(np.median(np.concatenate([s[n_prompt:-1] for s in per_child])))
    actions = [{"probe": FINAL, "above": threshold, "then": "stop"}]
    (out,) = action_llm.generate(
        [PROMPT], params(actions, n=2, temperature=1.0, seed=7), use_tqdm=False
    )
    for child, scores, whole in zip(out.outputs, per_child, free.outputs):
        want = first_crossing(scores[:-1], threshold, n_prompt)
        end = len(whole.token_ids) if want is None else want + 1 - n_prompt
        assert list(child.token_ids) == list(whole.token_ids)[:end], child.index


def test_streamed_deltas_carry_each_firing_once(action_llm, reference, free_run):
    ids = token_ids_of(free_run)
    n_prompt = len(free_run.prompt_token_ids)
    scores = ref_scores(reference, ids, FINAL)
    threshold = threshold_between(scores[n_prompt:-1], 4)
    actions = [{"probe": FINAL, "above": threshold, "then": "flag"}]
    engine = action_llm.llm_engine
    engine.add_request(
        "actions-delta", PROMPT, params(actions, output_kind=RequestOutputKind.DELTA)
    )
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].op_results is not None:
                seen += [f.position for f in out.outputs[0].op_results.firings]
    assert seen == [p for p in range(n_prompt, len(ids) - 1) if scores[p] > threshold]


@pytest.mark.parametrize(
    "bad, says, parameter",
    [
        ([{"probe": "nope", "above": 0.5}], r"probe 'nope' is not loaded", "probe_actions"),
        ([{"probe": FINAL, "above": float("inf")}], "must be finite", "probe_actions"),
        (
            [{"probe": FINAL, "above": 1, "below": 0}],
            "exactly one of 'above' and 'below'",
            "probe_actions",
        ),
        ([{"probe": PROBE, "above": 0.5}], r"has 3 outputs; 'output' must be", "probe_actions"),
        (
            [{"probe": FINAL, "above": 0.5, "for": 0}],
            "'for' must be an integer >= 1",
            "probe_actions",
        ),
        (
            [{"probe": FINAL, "above": 0.5, "then": "explode"}],
            r'must be "stop", "flag" or \{"steer"',
            "probe_actions",
        ),
        (
            [{"probe": FINAL, "above": 0.5, "then": {"steer": []}}],
            "'then.steer' must be a non-empty list",
            "probe_actions",
        ),
        ([], "non-empty list of actions", "probe_actions"),
    ],
)
def test_a_bad_action_fails_alone_naming_what_is_allowed(action_llm, bad, says, parameter):
    with pytest.raises(VLLMValidationError, match=says) as info:
        action_llm.generate([PROMPT], params(bad, max_tokens=2), use_tqdm=False)
    assert info.value.parameter == parameter
    (out,) = action_llm.generate([PROMPT], params(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2  # still serving


def test_actions_over_the_prompt_only_are_refused(action_llm):
    with pytest.raises(VLLMValidationError, match="'prompt' does not reach any generated") as info:
        action_llm.generate(
            [PROMPT],
            params([{"probe": FINAL, "above": 0.5}], hidden_states_positions="prompt"),
            use_tqdm=False,
        )
    assert info.value.parameter == "hidden_states_positions"


# -- "then": {"steer": [...]}: steering turned on by a probe, in the worker ------

STEER_STRENGTH = 6.0
# Four requests this long outgrow :func:`steer_llm`'s five 64-token KV blocks.
PREEMPT_TOKENS = 60
# (probe, output, steered point): the probe's point before the steered one
# (resid_post.1 < resid_pre.3), and after it (the final layer > resid_pre.1).
ORDERS = [(PROBE, 1, "resid_pre.3"), (FINAL, 0, "resid_pre.1")]


@pytest.fixture(scope="module")
def steer_llm(qwen3_dir, probes_dir, steering_vectors_dir):
    """Probes and steering at every steerable point (the named vector
    :data:`~.conftest.STEERING_VECTOR`), on five 64-token KV blocks and four
    sequences at most: short requests never wait for blocks, four of
    :data:`PREEMPT_TOKENS` tokens are preempted and recomputed."""
    from vllm import LLM

    engine = LLM(
        model=str(qwen3_dir),
        probes=str(probes_dir),
        enable_steering=True,
        steering_points="all",
        steering_vectors=str(steering_vectors_dir),
        enforce_eager=True,
        max_model_len=256,
        num_gpu_blocks_override=5,
        block_size=64,
        disable_log_stats=False,
        **dict(COMMON_ENGINE_ARGS, max_num_seqs=4),
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def steer_free_run(steer_llm):
    (out,) = steer_llm.generate([PROMPT], params(), use_tqdm=False)
    return out


@pytest.fixture(scope="module")
def honesty(steering_vectors_dir):
    from safetensors.torch import load_file

    from .conftest import STEERING_VECTOR

    return load_file(str(steering_vectors_dir / f"{STEERING_VECTOR}.safetensors"))["v"]


def steer_then(point: str) -> dict:
    from .conftest import STEERING_VECTOR

    return {"steer": [{"point": point, "name": STEERING_VECTOR, "strength": STEER_STRENGTH}]}


def hf_steered_greedy(hf, prompt_ids, point, vector, start, max_tokens):
    """HF's greedy tokens with ``vector`` added at ``point`` at positions
    ``start`` on (a full forward per token: positions are absolute)."""
    import torch

    item = {
        "point": point,
        "op": "add",
        "vector": vector,
        "strength": STEER_STRENGTH,
        "start": start,
        "end": None,
    }
    ids = list(prompt_ids)
    with torch.inference_mode(), hf.steering([item]):
        for _ in range(max_tokens):
            logits = hf.model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids, item


def steer_case(reference, free_run, probe, column, rank=3):
    """The threshold of a steer action on ``probe`` and the first generated
    position where it fires on the unsteered run (HF scores)."""
    ids = token_ids_of(free_run)
    n_prompt = len(free_run.prompt_token_ids)
    scores = ref_scores(reference, ids, probe, column)
    threshold = threshold_between(scores[n_prompt:-1], rank)
    fired = first_crossing(scores[:-1], threshold, n_prompt)
    assert fired is not None and fired < len(ids) - 3  # room to steer after it
    return threshold, fired


@pytest.mark.four_modes
@pytest.mark.parametrize("probe, column, point", ORDERS, ids=["probe-before", "probe-after"])
def test_steer_turns_the_vector_on_from_the_position_after_the_firing_one(
    steer_llm, reference, hf_qwen3, steer_free_run, honesty, probe, column, point
):
    n_prompt = len(steer_free_run.prompt_token_ids)
    threshold, fired = steer_case(reference, steer_free_run, probe, column)
    want, item = hf_steered_greedy(
        hf_qwen3, steer_free_run.prompt_token_ids, point, honesty, fired + 1, MAX_TOKENS
    )
    assert want != token_ids_of(steer_free_run)  # the steering shows in the tokens
    actions = [{"probe": probe, "output": column, "above": threshold, "then": steer_then(point)}]
    (out,) = steer_llm.generate([PROMPT], params(actions, probes=[FINAL, PROBE]), use_tqdm=False)
    completion = out.outputs[0]
    assert token_ids_of(out) == want
    assert completion.finish_reason == "length"
    (firing,) = completion.op_results.firings
    assert (firing.label, firing.position, firing.then) == (probe, fired, "steer")
    # The states the engine scored are HF's with the vector from fired + 1 on.
    states = hf_qwen3.steered_states(want, [item])
    points = hf_qwen3.steered_points(want, [item])
    for name in (FINAL, PROBE):
        p = reference.probes[name]
        rows = states[int(p.point)] if p.point.lstrip("-").isdigit() else points[p.point]
        expect = score_numpy(rows.double().numpy(), p)[n_prompt:]
        got = completion.probe_scores[name].numpy()
        scale = max(np.abs(expect).max(), 1e-3)
        np.testing.assert_allclose(got, expect, atol=1e-4 * scale, rtol=0, err_msg=name)


def test_steer_that_never_fires_leaves_the_output_unsteered(steer_llm, reference, steer_free_run):
    ids = token_ids_of(steer_free_run)
    top = float(ref_scores(reference, ids, FINAL).max())
    actions = [{"probe": FINAL, "above": top + 1.0, "then": steer_then("resid_pre.1")}]
    (out,) = steer_llm.generate([PROMPT], params(actions), use_tqdm=False)
    assert token_ids_of(out) == ids
    assert out.outputs[0].op_results is None


def test_steer_stop_and_plain_requests_share_a_batch_each_exact(
    steer_llm, reference, hf_qwen3, steer_free_run, honesty
):
    ids = token_ids_of(steer_free_run)
    n_prompt = len(steer_free_run.prompt_token_ids)
    threshold, fired = steer_case(reference, steer_free_run, FINAL, 0)
    want, _ = hf_steered_greedy(
        hf_qwen3, steer_free_run.prompt_token_ids, "resid_pre.1", honesty, fired + 1, MAX_TOKENS
    )
    scores = ref_scores(reference, ids, PROBE, 1)
    stop_threshold = threshold_between(scores[n_prompt:-1], 3)
    stop_at = first_crossing(scores[:-1], stop_threshold, n_prompt)
    steer = [{"probe": FINAL, "above": threshold, "then": steer_then("resid_pre.1")}]
    stop = [{"probe": PROBE, "output": 1, "above": stop_threshold, "then": "stop"}]
    asks = [params(steer), params(stop), params(), params(steer)]
    outs = steer_llm.generate([PROMPT] * 4, asks, use_tqdm=False)
    assert token_ids_of(outs[0]) == want and token_ids_of(outs[3]) == want
    assert [f.position for f in outs[0].outputs[0].op_results.firings] == [fired]
    assert list(outs[1].outputs[0].token_ids) == ids[n_prompt : stop_at + 1]
    assert token_ids_of(outs[2]) == ids


def test_steer_on_an_engine_without_steering_is_refused_naming_the_flag(action_llm):
    actions = [{"probe": FINAL, "above": 0.5, "then": steer_then("resid_pre.1")}]
    with pytest.raises(VLLMValidationError, match=r"probe_actions\[0\]: .*needs steering") as e:
        action_llm.generate([PROMPT], params(actions, max_tokens=2), use_tqdm=False)
    assert e.value.parameter == "probe_actions"


@pytest.mark.parametrize(
    "then, says",
    [
        (
            {"steer": [{"point": "resid_pre.9", "vector": [1.0]}]},
            r"probe_actions\[0\]: then.steer\[0\].point: .resid_pre.9.: layer 9 is out of range",
        ),
        (
            {"steer": [{"point": "resid_pre.1", "name": "honesty", "positions": "all"}]},
            "'positions' is not allowed in a steer action",
        ),
        (
            {"steer": [{"point": "resid_pre.1", "op": "ablate", "name": "honesty"}]},
            r"cannot be turned on by a probe action; allowed: \['add'\]",
        ),
    ],
    ids=["unknown-point", "positions", "ablate"],
)
def test_a_bad_steer_action_fails_alone_naming_what_is_allowed(steer_llm, then, says):
    actions = [{"probe": FINAL, "above": 0.5, "then": then}]
    with pytest.raises(VLLMValidationError, match=says) as e:
        steer_llm.generate([PROMPT], params(actions, max_tokens=2), use_tqdm=False)
    assert e.value.parameter == "probe_actions"
    (out,) = steer_llm.generate([PROMPT], params(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_a_point_steered_by_the_request_and_its_steer_action_is_refused(steer_llm):
    actions = [{"probe": FINAL, "above": 0.5, "then": steer_then("resid_pre.1")}]
    ask = params(actions, max_tokens=2)
    ask.steering = [{"point": "resid_pre.1", "name": "honesty"}]
    with pytest.raises(VLLMValidationError, match="steers that point too") as e:
        steer_llm.generate([PROMPT], ask, use_tqdm=False)
    assert e.value.parameter == "probe_actions"


def test_a_steer_firing_in_the_prompt_steers_from_the_first_generated_position(
    steer_llm, reference, hf_qwen3, steer_free_run, honesty
):
    ids = token_ids_of(steer_free_run)
    n_prompt = len(steer_free_run.prompt_token_ids)
    scores = ref_scores(reference, ids, FINAL)
    threshold = threshold_between(scores[:n_prompt], 0)
    fired = first_crossing(scores, threshold, 0)
    assert fired < n_prompt - 1  # prompt positions after it stay unsteered
    want, _ = hf_steered_greedy(
        hf_qwen3, steer_free_run.prompt_token_ids, "resid_pre.1", honesty, n_prompt, MAX_TOKENS
    )
    actions = [{"probe": FINAL, "above": threshold, "then": steer_then("resid_pre.1")}]
    (out,) = steer_llm.generate(
        [PROMPT], params(actions, hidden_states_positions="all"), use_tqdm=False
    )
    assert token_ids_of(out) == want
    assert [f.position for f in out.outputs[0].op_results.firings] == [fired]


def test_a_stop_after_a_steer_returns_the_steered_states_and_tokens(
    steer_llm, reference, hf_qwen3, steer_free_run, honesty
):
    n_prompt = len(steer_free_run.prompt_token_ids)
    threshold, fired = steer_case(reference, steer_free_run, FINAL, 0)
    want, item = hf_steered_greedy(
        hf_qwen3, steer_free_run.prompt_token_ids, "resid_pre.1", honesty, fired + 1, MAX_TOKENS
    )
    # The stop reads the steered stream (resid_post.1 is after resid_pre.1).
    stop_probe = reference.probes[PROBE]
    steered_rows = hf_qwen3.steered_points(want, [item])[stop_probe.point].double().numpy()
    stop_scores = score_numpy(steered_rows, stop_probe)[:, 1]
    # A threshold no position up to fired + 1 crosses and a later one does.
    early, late = stop_scores[n_prompt : fired + 2], stop_scores[fired + 2 : -1]
    above = late.max() - early.max() > early.min() - late.min()
    stop_threshold = float(
        (early.max() + late.max()) / 2 if above else (early.min() + late.min()) / 2
    )
    stop_at = first_crossing(stop_scores[:-1], stop_threshold, n_prompt, above=above)
    assert stop_at is not None and fired + 1 < stop_at < len(want) - 1
    side = "above" if above else "below"
    actions = [
        {"probe": FINAL, "above": threshold, "then": steer_then("resid_pre.1")},
        {"probe": PROBE, "output": 1, side: stop_threshold, "then": "stop"},
    ]
    (out,) = steer_llm.generate([PROMPT], params(actions, probes=[FINAL, PROBE]), use_tqdm=False)
    completion = out.outputs[0]
    assert token_ids_of(out) == want[: stop_at + 1]
    assert [(f.position, f.then) for f in completion.op_results.firings] == [
        (fired, "steer"),
        (stop_at, "stop"),
    ]
    states = hf_qwen3.steered_states(want[: stop_at + 1], [item])
    expect = score_numpy(states[-1].double().numpy(), reference.probes[FINAL])[n_prompt:]
    got = completion.probe_scores[FINAL].numpy()
    np.testing.assert_allclose(got, expect, atol=1e-4 * max(np.abs(expect).max(), 1e-3), rtol=0)


@pytest.mark.four_modes
def test_steer_firings_survive_preemption_and_recompute_once_each(
    steer_llm, reference, hf_qwen3, honesty
):
    """Four steered requests on five 64-token KV blocks: the scheduler
    preempts and recomputes them. Each is steered exactly from the position
    after its firing, in the recompute too (V1 runner: the worker rebuilds a
    resumed request's fired gates from their firing positions; V2: the
    request comes back new with the steering the engine rewrote), and the
    firing is reported once."""
    prompts = [f"{PROMPT} number {i}" for i in range(4)]
    long = params(max_tokens=PREEMPT_TOKENS)
    before = num_preemptions(steer_llm)
    free = steer_llm.generate(prompts, [long] * 4, use_tqdm=False)
    cases, asks = [], []
    for out in free:
        ids = token_ids_of(out)
        n_prompt = len(out.prompt_token_ids)
        scores = ref_scores(reference, ids, FINAL)
        # Fires at the highest of the first generated positions, long before
        # the requests outgrow their first block.
        window = scores[n_prompt : n_prompt + 12]
        threshold = threshold_between(window, 0)
        fired = first_crossing(scores[:-1], threshold, n_prompt)
        assert fired == n_prompt + int(window.argmax())
        want, item = hf_steered_greedy(
            hf_qwen3, out.prompt_token_ids, "resid_pre.1", honesty, fired + 1, PREEMPT_TOKENS
        )
        assert want != ids  # the steering shows in the tokens
        cases.append((fired, want, item, n_prompt))
        actions = [{"probe": FINAL, "above": threshold, "then": steer_then("resid_pre.1")}]
        asks.append(params(actions, max_tokens=PREEMPT_TOKENS))
    outs = steer_llm.generate(prompts, asks, use_tqdm=False)
    assert num_preemptions(steer_llm) > before  # the case under test happened
    for i, (out, (fired, want, item, n_prompt)) in enumerate(zip(outs, cases)):
        completion = out.outputs[0]
        assert token_ids_of(out) == want, i
        assert completion.finish_reason == "length", i
        assert [(f.position, f.then) for f in completion.op_results.firings] == [
            (fired, "steer")
        ], i
        # The scores are of HF's states steered from fired + 1, one per position.
        states = hf_qwen3.steered_states(want, [item])
        expect = score_numpy(states[-1].double().numpy(), reference.probes[FINAL])[n_prompt:]
        got = completion.probe_scores[FINAL].numpy()
        scale = max(np.abs(expect).max(), 1e-3)
        np.testing.assert_allclose(got, expect, atol=1e-4 * scale, rtol=0, err_msg=str(i))
