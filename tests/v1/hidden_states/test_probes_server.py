# SPDX-License-Identifier: Apache-2.0
"""Probe scores on the OpenAI server: one ``vllm serve --probes DIR``, the
official ``openai`` client (``extra_body``) and raw HTTP.

The probes are the engine test's (:mod:`.test_probes`: one per point kind);
every score is compared with numpy on HF transformers' states at the probe's
point, on the token ids the server reports (``return_token_ids``).
"""

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from .server_utils import ServerProcess, running_server, wait_until

MODEL = "tiny-qwen3"
PROMPT = "Once upon a time there was a small robot who loved to count"


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("probe-store")


@pytest.fixture(scope="module")
def server(qwen3_dir, probes_dir, store_dir, tmp_path_factory):
    with running_server(
        qwen3_dir,
        [
            "--probes",
            str(probes_dir),
            "--max-model-len",
            "512",
            "--activation-store",
            str(store_dir),
        ],
        tmp_path_factory.mktemp("probes-server") / "server.log",
        name=MODEL,
    ) as process:
        yield process


@pytest.fixture(scope="module")
def http(server: ServerProcess):
    with httpx.Client(base_url=server.base_url, timeout=300.0) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server: ServerProcess):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", timeout=300.0)


def decoded(entry: dict) -> torch.Tensor:
    """One probe's ``probe_scores`` entry as a float32 ``[n, k]`` tensor."""
    if entry["encoding_format"] == "base64":
        array = np.frombuffer(base64.b64decode(entry["data"]), "<f4")
    else:
        array = np.asarray(entry["data"], dtype=np.float32)
    assert entry["dtype"] == "float32"
    return torch.from_numpy(array.reshape(entry["shape"]).copy())


def scores_of(obj: dict) -> dict[str, torch.Tensor]:
    return {name: decoded(entry) for name, entry in obj.items()}


def test_get_probes_lists_every_probe_with_its_point_and_width(http, reference, hf_qwen3):
    body = http.get("/v1/probes").json()
    assert body["object"] == "list"
    listed = {item["name"]: item for item in body["data"]}
    assert list(listed) == sorted(reference.probes)
    for name, probe in reference.probes.items():
        item = listed[name]
        assert (item["point"], item["output"], item["k"]) == (probe.point, probe.output, probe.k)
        assert item["hidden_size"] == hf_qwen3.hidden_size


def test_completions_carry_each_choices_scores_at_every_position(oai, reference):
    names = ["post1", "final", "pre2"]
    res = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        n=2,
        temperature=1.0,
        seed=5,
        extra_body={"probes": names, "hidden_states_positions": "all", "return_token_ids": True},
    )
    assert len(res.choices) == 2
    for choice in res.choices:
        extra = choice.model_extra
        assert "hidden_states" not in extra or extra["hidden_states"] is None  # no vectors
        obj = extra["probe_scores"]
        assert list(obj) == names and obj["final"]["start"] == 0
        ids = list(extra["prompt_token_ids"]) + list(extra["token_ids"])
        reference.check(scores_of(obj), ids, slice(0, None), f"choice {choice.index}")


def test_chat_in_base64_scores_the_last_position(oai, reference):
    res = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=5,
        temperature=0.0,
        extra_body={
            "probes": ["attn1", "mlp_last"],
            "hidden_states_format": "base64",
            "return_token_ids": True,
        },
    )
    from vllm_hidden_states.client import probe_scores

    choice = res.choices[0]
    obj = choice.model_extra["probe_scores"]
    assert obj["attn1"]["positions"] == "last" and obj["attn1"]["shape"] == [1, 2]
    ids = list(res.model_extra["prompt_token_ids"]) + list(choice.model_extra["token_ids"])
    # The client's decoder, on the openai client's own object.
    scores = {name: torch.from_numpy(a) for name, a in probe_scores(choice).items()}
    reference.check(scores, ids, slice(-1, None), "chat base64 last")


def test_streamed_chat_carries_the_scores_of_each_generated_token(oai, reference):
    extra = {
        "probes": ["final", "mid2"],
        "hidden_states_positions": "generated",
        "hidden_states_stream": True,
        "return_token_ids": True,
    }
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=6,
        temperature=0.0,
        stream=True,
        extra_body=extra,
    )
    parts, tokens, prompt = [], [], None
    for chunk in stream:
        prompt = prompt or chunk.model_extra.get("prompt_token_ids")
        for choice in chunk.choices:
            new_tokens = getattr(choice, "token_ids", None) or []
            tokens += new_tokens
            obj = (choice.model_extra or {}).get("probe_scores")
            if obj:
                parts.append(scores_of(obj))
                # A chunk carries the rows its own tokens' steps computed,
                # the last one the final position's too. How many tokens a
                # chunk holds is the server's pace (vLLM merges the deltas a
                # slow reader has not taken yet), so only this bound holds.
                assert parts[-1]["final"].shape[0] <= len(new_tokens) + 1
    assert parts, "no chunk carried probe_scores"
    joined = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
    ids = list(prompt) + tokens
    reference.check(joined, ids, slice(len(prompt), None), "streamed generated")


@pytest.mark.parametrize(
    "probes, says",
    [
        (["final", "nope"], "probe 'nope' is not loaded on this engine; available probes"),
        (["final", "final"], "more than once"),
        ("final", "non-empty list of probe names"),
    ],
)
def test_a_bad_probes_field_is_a_400_naming_the_probe_and_what_is_allowed(http, probes, says):
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "probes": probes},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in error["message"] and error["param"] == "probes"
    ok = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "probes": ["final"]},
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["probe_scores"]["final"]["shape"] == [
        1,
        1,
    ]


def test_scores_land_in_the_activation_store_one_row_per_token_and_probe(http, store_dir):
    from vllm_hidden_states.store.activation_store import connect

    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 0.0,
        "probes": ["post1", "final"],
        "hidden_states_positions": "all",
        "return_token_ids": True,
    }
    res = http.post("/v1/completions", json=body).json()
    choice = res["choices"][0]
    n = len(choice["prompt_token_ids"]) + len(choice["token_ids"])
    query = "SELECT probe, token_position, scores FROM probe_scores WHERE request_id = $id"

    def rows():
        if not any((store_dir / "probe_scores").glob("date=*/*.parquet")):
            return []
        return connect(store_dir).execute(query + " ORDER BY 1, 2", {"id": res["id"]}).fetchall()

    wait_until(lambda: len(rows()) >= 2 * n, "the request's probe scores in the store")
    stored = rows()
    assert len(stored) == 2 * n
    for name in ("final", "post1"):
        got = np.array([r[2] for r in stored if r[0] == name], dtype=np.float32)
        assert [r[1] for r in stored if r[0] == name] == list(range(n))
        np.testing.assert_array_equal(got, decoded(choice["probe_scores"][name]).numpy())


# -- probe actions over HTTP ---------------------------------------------------


def _free_completion(oai, probe: str):
    """A greedy completion with ``probe`` scored on every generated token."""
    res = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=20,
        temperature=0.0,
        extra_body={
            "probes": [probe],
            "hidden_states_positions": "generated",
            "return_token_ids": True,
            "ignore_eos": True,
        },
    )
    extra = res.choices[0].model_extra
    return list(extra["prompt_token_ids"]), list(extra["token_ids"])


def _crossing(reference, prompt_ids, token_ids, probe: str):
    """A threshold between two generated positions' reference scores, and
    the first generated position above it."""
    from vllm_hidden_states.probes import score_numpy

    ids = prompt_ids + token_ids
    p = reference.probes[probe]
    scores = score_numpy(reference.rows(ids, p.point), p)[:, 0]
    generated = np.sort(scores[len(prompt_ids) : -1])[::-1]
    threshold = float((generated[2] + generated[3]) / 2)
    first = next(q for q in range(len(prompt_ids), len(ids) - 1) if scores[q] > threshold)
    return threshold, first


def test_a_probe_action_stops_a_completion_at_the_first_crossing(oai, reference):
    prompt_ids, token_ids = _free_completion(oai, "final")
    threshold, first = _crossing(reference, prompt_ids, token_ids, "final")
    res = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=20,
        temperature=0.0,
        extra_body={
            "probe_actions": [{"probe": "final", "above": threshold, "then": "stop"}],
            "return_token_ids": True,
            "ignore_eos": True,
        },
    )
    choice = res.choices[0]
    assert choice.model_extra["token_ids"] == token_ids[: first + 1 - len(prompt_ids)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == "final"
    (fired,) = choice.model_extra["probe_actions"]
    assert (fired["probe"], fired["position"], fired["then"]) == ("final", first, "stop")
    # The action's probe is scored and returned over the positions it watched.
    assert choice.model_extra["probe_scores"]["final"]["positions"] == "generated"


def test_a_streamed_chat_ends_with_the_stop_and_its_firing_on_the_final_chunk(oai, reference):
    messages = [{"role": "user", "content": PROMPT}]
    common = dict(model=MODEL, messages=messages, max_tokens=20, temperature=0.0)
    free = oai.chat.completions.create(
        **common,
        extra_body={
            "probes": ["final"],
            "hidden_states_positions": "generated",
            "return_token_ids": True,
            "ignore_eos": True,
        },
    )
    prompt_ids = list(free.model_extra["prompt_token_ids"])
    token_ids = list(free.choices[0].model_extra["token_ids"])
    threshold, first = _crossing(reference, prompt_ids, token_ids, "final")
    stream = oai.chat.completions.create(
        **common,
        stream=True,
        extra_body={
            "probe_actions": [{"probe": "final", "above": threshold}],
            "return_token_ids": True,
            "ignore_eos": True,
        },
    )
    tokens, finals = [], []
    for chunk in stream:
        for choice in chunk.choices:
            tokens += getattr(choice, "token_ids", None) or []
            if choice.finish_reason is not None:
                finals.append(choice)
    assert tokens == token_ids[: first + 1 - len(prompt_ids)]
    (final,) = finals
    assert final.finish_reason == "stop"
    assert [f["position"] for f in final.model_extra["probe_actions"]] == [first]
    assert final.model_extra["probe_scores"]["final"]["shape"][0] == len(tokens)


@pytest.mark.parametrize(
    "actions, says",
    [
        ([{"probe": "nope", "above": 0.5}], "probe 'nope' is not loaded"),
        ([{"probe": "final", "above": "high"}], "'above' must be a number"),
        (
            [{"probe": "final", "above": 0.5, "then": {"steer": []}}],
            "'then.steer' must be a non-empty list",
        ),
        ("final", "non-empty list of actions"),
    ],
)
def test_a_bad_probe_action_is_a_400_naming_the_field(http, actions, says):
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "probe_actions": actions},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in error["message"] and error["param"] == "probe_actions"
