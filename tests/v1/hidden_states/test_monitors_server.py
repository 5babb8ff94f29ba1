# SPDX-License-Identifier: Apache-2.0
"""Server-wide probe monitors (``vllm serve --probes DIR --monitors FILE``),
with the official ``openai`` client.

The server's monitors (a YAML file):

* ``tripwire-stop``: a layer-0 probe whose score is 1 on one token's
  embedding and near 0 on every other token's (its weight is that embedding
  over its squared norm), ``above: 0.5``, ``then: stop``. A request made to
  generate that token (``logit_bias``) must stop right after it;
* ``every-token``: a probe at the final layer with a threshold no score
  reaches from below, ``then: flag``: it fires at every generated position a
  forward computes, which the client never sees and ``/metrics`` counts.
"""

import re
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from vllm_hidden_states.probes import save_probe

from .server_utils import ServerProcess, running_server, wait_until
from .test_server import assert_choice_matches_hf

MODEL = "tiny-qwen3"
PROMPT = "Once upon a time there was a small robot who loved to count"
MONITORS = """\
monitors:
  - {name: tripwire-stop, probe: tripwire, above: 0.5, then: stop}
  - {name: every-token, probe: final, above: -1.0e+30, then: flag}
"""


@pytest.fixture(scope="module")
def tripwire_token(hf_qwen3) -> int:
    return int(hf_qwen3.model.config.get_text_config().vocab_size) // 3


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("monitors")


@pytest.fixture(scope="module")
def server(qwen3_dir, hf_qwen3, tripwire_token, root):
    embedding = hf_qwen3.model.get_input_embeddings().weight.detach().double().numpy()
    row = embedding[tripwire_token]
    scores = embedding @ (row / row.dot(row))
    others = np.delete(scores, tripwire_token)
    assert np.abs(others).max() < 0.4  # only the tripwire token crosses 0.5
    probes = root / "probes"
    save_probe(probes / "tripwire.safetensors", row / row.dot(row), [0.0], "0")
    rng = np.random.default_rng(0)
    save_probe(probes / "final.safetensors", rng.standard_normal(hf_qwen3.hidden_size), [0.0], "-1")
    (root / "monitors.yaml").write_text(MONITORS)
    with running_server(
        qwen3_dir,
        [
            "--probes",
            str(probes),
            "--monitors",
            str(root / "monitors.yaml"),
            "--max-model-len",
            "512",
            "--activation-store",
            str(root / "store"),
        ],
        root / "server.log",
        name=MODEL,
    ) as process:
        yield process


@pytest.fixture(scope="module")
def store_dir(server: ServerProcess, root: Path) -> Path:
    return root / "store"


@pytest.fixture(scope="module")
def oai(server: ServerProcess):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", timeout=300.0)


def firings_counted(server: ServerProcess, monitor: str, then: str) -> float:
    text = httpx.get(server.url("/metrics"), timeout=60.0).text
    pattern = (
        r'^vllm:hidden_states_monitor_firings_total\{[^}]*monitor="'
        + re.escape(monitor)
        + r'"[^}]*then="'
        + then
        + r'"[^}]*\} ([0-9.e+]+)$'
    )
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


def complete(oai, **extra):
    return oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True, **extra},
    )


def test_a_monitor_stops_a_request_that_asked_nothing_right_after_the_token(oai, tripwire_token):
    res = complete(oai, logit_bias={str(tripwire_token): 100})
    choice = res.choices[0]
    assert choice.model_extra["token_ids"] == [tripwire_token]  # none after it
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == "tripwire-stop"
    for field in ("probe_actions", "probe_scores", "hidden_states"):
        assert choice.model_extra.get(field) is None, field


def test_flags_stay_with_the_server_and_are_counted_in_metrics(oai, server, tripwire_token):
    before = firings_counted(server, "every-token", "flag")
    res = complete(oai)
    tokens = res.choices[0].model_extra["token_ids"]
    # The tripwire fires only on its token: a run without it goes to length.
    assert tripwire_token not in tokens[:-1]
    assert (res.choices[0].finish_reason == "length") == (tripwire_token not in tokens)
    assert res.choices[0].model_extra.get("probe_actions") is None
    # Every generated position a forward computed (all but the final token).
    assert firings_counted(server, "every-token", "flag") - before == len(tokens) - 1


def test_a_requests_own_actions_add_to_the_monitors_and_list_only_its_firings(oai, tripwire_token):
    res = complete(
        oai,
        logit_bias={str(tripwire_token): 100},
        probe_actions=[{"probe": "final", "above": -1.0e30, "then": "flag"}],
    )
    choice = res.choices[0]
    prompt_len = len(choice.model_extra["prompt_token_ids"])
    assert choice.model_extra["token_ids"] == [tripwire_token]
    assert choice.model_extra["stop_reason"] == "tripwire-stop"
    # Its own flag fired at the one generated position a forward computed.
    assert [f["position"] for f in choice.model_extra["probe_actions"]] == [prompt_len]
    assert list(choice.model_extra["probe_scores"]) == ["final"]


def test_a_last_request_under_monitors_gets_its_final_row_exact(oai, hf_qwen3):
    layers = [-1, 2]
    res = complete(oai, return_hidden_states=True, hidden_states_layers=layers)
    extra = res.choices[0].model_extra
    assert extra["hidden_states"]["positions"] == "last"
    ids = list(extra["prompt_token_ids"]) + list(extra["token_ids"])
    assert_choice_matches_hf(hf_qwen3, extra["hidden_states"], ids, layers)


def test_routes_the_monitors_cannot_reach_are_refused_on_a_monitored_server(server):
    with httpx.Client(base_url=server.base_url, timeout=120.0) as http:
        r = http.post(
            "/v1/responses", json={"model": MODEL, "input": PROMPT, "max_output_tokens": 4}
        )
        assert r.status_code == 400, r.text
        assert "probe monitors" in r.json()["error"]["message"]
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "use_beam_search": True, "n": 2}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "use_beam_search"


def test_every_firing_lands_in_the_activation_store(oai, store_dir, tripwire_token):
    from vllm_hidden_states.store.activation_store import connect

    res = complete(oai, logit_bias={str(tripwire_token): 100})
    prompt_len = len(res.choices[0].model_extra["prompt_token_ids"])

    def stored():
        if not any((store_dir / "probe_firings").glob("date=*/*.parquet")):
            return []
        con = connect(store_dir)
        return con.execute(
            "SELECT action, outcome, token_position FROM probe_firings "
            "WHERE action = 'tripwire-stop' ORDER BY created_at"
        ).fetchall()

    rows = wait_until(stored, timeout=120.0, what="the store's firing rows")
    assert ("tripwire-stop", "stop", prompt_len) in rows
