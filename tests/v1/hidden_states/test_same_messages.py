# SPDX-License-Identifier: Apache-2.0
"""One resolver, one message: the same bad field is refused with the same
message and the same parameter by the Python API (``LLM`` with
``SamplingParams``: ``VLLMValidationError``) and over HTTP (the official
``openai`` client on /v1/completions: an OpenAI error JSON, status 400), for
every rule of the request fields.

The server runs the same engine settings as the session's ``llm`` (tiny
Qwen3, every layer capturable, steering at every point with the same named
vectors), so messages that list what is allowed list the same things.
"""

import openai
import pytest

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

from .conftest import COMMON_ENGINE_ARGS, LLM_MAX_ROWS, STEERING_VECTOR
from .server_utils import running_server

PROMPT = "The capital of France is"


# One bad request per rule: {rule: the fields}. Shapes come from the model
# config where a rule depends on them.
def bad_fields(num_layers: int) -> dict[str, dict]:
    ask = {"return_hidden_states": True}
    rules = [
        ("flag_not_a_boolean", {"return_hidden_states": "yes"}),
        ("layers_without_flag", {"hidden_states_layers": [0]}),
        ("points_without_flag", {"hidden_states_points": ["attn_out.0"]}),
        ("positions_unknown", {**ask, "hidden_states_positions": "first"}),
        ("window_malformed", {**ask, "hidden_states_positions": {"start": 5, "end": 2}}),
        ("window_past_reach", {**ask, "hidden_states_positions": {"start": 900}}),
        ("layers_not_a_list", {**ask, "hidden_states_layers": "1"}),
        ("layer_out_of_range", {**ask, "hidden_states_layers": [num_layers + 5]}),
        ("layer_named_twice", {**ask, "hidden_states_layers": [-1, num_layers]}),
        ("points_not_a_list", {**ask, "hidden_states_points": "attn_out.0"}),
        ("point_not_an_address", {**ask, "hidden_states_points": ["first layer"]}),
        ("point_unknown_kind", {**ask, "hidden_states_points": ["attn_foo.0"]}),
        ("point_out_of_range", {**ask, "hidden_states_points": [f"attn_out.{num_layers}"]}),
        ("point_not_capturable", {**ask, "hidden_states_points": ["attn_out.0"]}),
        ("sae_features_without_sae", {"sae_features": {"top_k": 2}}),
        ("steering_unknown_op", {"steering": [{"point": "resid_pre.1", "op": "scale"}]}),
        (
            "steering_vector_of_wrong_length",
            {"steering": [{"point": "resid_pre.1", "vector": [1.0, 2.0]}]},
        ),
        ("steering_unknown_name", {"steering": [{"point": "resid_pre.1", "name": "nope"}]}),
        (
            "steering_point_not_steerable",
            {"steering": [{"point": "attn_pattern.1", "name": STEERING_VECTOR}]},
        ),
    ]
    return dict(rules)


RULES = list(bad_fields(num_layers=2))


@pytest.fixture(scope="module")
def num_layers(qwen3_dir) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(qwen3_dir).num_hidden_layers


@pytest.fixture(scope="module")
def server(qwen3_dir, steering_vectors_dir, tmp_path_factory):
    with running_server(
        qwen3_dir,
        [
            "--enable-hidden-states",
            "--enable-steering",
            "--steering-points",
            "all",
            "--steering-vectors",
            str(steering_vectors_dir),
            "--hidden-states-max-rows",
            str(LLM_MAX_ROWS),
            "--max-model-len",
            "1024",
            "--max-num-batched-tokens",
            str(COMMON_ENGINE_ARGS["max_num_batched_tokens"]),
            "--max-num-seqs",
            str(COMMON_ENGINE_ARGS["max_num_seqs"]),
        ],
        tmp_path_factory.mktemp("same-messages") / "server.log",
    ) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)


def python_refusal(llm, fields: dict) -> tuple[str, str | None]:
    with pytest.raises(VLLMValidationError) as e:
        llm.generate([PROMPT], SamplingParams(max_tokens=4, **fields), use_tqdm=False)
    return e.value.args[0], e.value.parameter


def http_refusal(client, fields: dict) -> tuple[str, str | None]:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="model", prompt=PROMPT, max_tokens=4, extra_body=fields)
    assert e.value.status_code == 400
    error = e.value.body
    param = error.get("param")
    # vLLM renders a VLLMValidationError raised past the HTTP edge (the
    # front-end's prompt rules) as str(e), which appends the parameter.
    return error["message"].removesuffix(f" (parameter={param})"), param


@pytest.mark.parametrize("rule", RULES)
def test_a_bad_field_reads_the_same_in_python_and_over_http(llm, client, num_layers, rule):
    fields = bad_fields(num_layers)[rule]
    message, parameter = python_refusal(llm, fields)
    assert http_refusal(client, fields) == (message, parameter)


def test_the_server_keeps_serving_after_every_refusal(client):
    out = client.completions.create(
        model="model",
        prompt=PROMPT,
        max_tokens=2,
        extra_body={"return_hidden_states": True, "hidden_states_layers": [-1]},
    )
    assert out.choices[0].hidden_states is not None
