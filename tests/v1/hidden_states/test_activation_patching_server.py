# SPDX-License-Identifier: Apache-2.0
"""Activation patching over HTTP with the official ``openai`` client: rows
as typed base64 arrays, rows by reference to an earlier request's capture in
the activation store (clean then corrupted run: two calls, no tensor through
the client), and the 400s.

One real ``vllm serve`` on loopback: tiny Qwen3, ``--enable-steering
--steering-points all --activation-store DIR --activation-store-hidden-states
--max-patch-rows 64``. States are compared with HF transformers whose forward
hooks make the same replacement.
"""

import httpx
import openai
import pytest
import torch

from vllm_hidden_states.patch_rows import encode_rows

from .conftest import HFReference, assert_close
from .server_utils import ServerProcess, running_server
from .test_server import decode_rows

MODEL = "tiny-qwen3"
CLEAN = "Once upon a time there was a small robot who loved to count"
CORRUPTED = "Once upon a time there was a small robot who hated to count"
POINT = "resid_pre.2"
LAYERS = [0, 1, 2, 3, 4]


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("patch-store")
    with running_server(
        qwen3_dir,
        [
            "--enable-steering",
            "--steering-points",
            "all",
            "--max-patch-rows",
            "64",
            "--activation-store",
            str(store),
            "--activation-store-hidden-states",
            "--max-model-len",
            "512",
        ],
        tmp_path_factory.mktemp("patch-server") / "server.log",
        name=MODEL,
    ) as process:
        yield process


@pytest.fixture(scope="module")
def oai(server: ServerProcess):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", timeout=300.0)


@pytest.fixture(scope="module")
def http(server: ServerProcess):
    with httpx.Client(base_url=server.base_url, timeout=300.0) as client:
        yield client


def complete(oai, prompt: str, **extra):
    body = dict(
        return_hidden_states=True,
        hidden_states_layers=LAYERS,
        hidden_states_positions="all",
        return_token_ids=True,
        **extra,
    )
    return oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0, extra_body=body
    )


def token_ids(choice) -> list[int]:
    extra = choice.model_extra
    return [*extra["prompt_token_ids"], *extra["token_ids"]]


def states_of(choice) -> torch.Tensor:
    """``[layers, positions, hidden]`` of a choice."""
    return decode_rows(choice.model_extra["hidden_states"])


def assert_patched_like_hf(choice, hf: HFReference, rows: torch.Tensor, start: int, what: str):
    ids = token_ids(choice)
    item = {"point": POINT, "op": "patch", "rows": rows, "start": start,
            "end": start + rows.shape[0]}  # fmt: skip
    expected = hf.steered_states(ids, [item])
    got = states_of(choice)
    for j, layer in enumerate(LAYERS):
        assert_close(got[j], expected[layer], f"{what} layer {layer}")


def test_typed_base64_rows_patch_like_hf_hooks(oai, hf_qwen3):
    rows = torch.randn(4, hf_qwen3.hidden_size, generator=torch.Generator().manual_seed(4))
    steering = [{"op": "patch", "point": POINT, "rows": encode_rows(rows.numpy()),
                 "positions": {"start": 3, "end": 7}}]  # fmt: skip
    out = complete(oai, CORRUPTED, steering=steering)
    assert_patched_like_hf(out.choices[0], hf_qwen3, rows, 3, "base64 rows")


def test_clean_then_corrupted_by_store_reference_is_two_calls(oai, hf_qwen3):
    """Capture the clean run's resid_pre.2 (stored by the server), then patch
    it into the corrupted run by the clean response's id: the same as
    patching the clean rows inline."""
    clean = complete(oai, CLEAN, hidden_states_points=[POINT])
    obj = clean.choices[0].model_extra["hidden_states"]
    assert obj["points"] == [POINT]
    clean_rows = states_of(clean.choices[0])[len(LAYERS)]  # rows: the layers, then the point
    window = {"start": 8, "end": 10}
    steering = [{"op": "patch", "point": POINT, "positions": window,
                 "capture": {"request_id": clean.id}}]  # fmt: skip
    out = complete(oai, CORRUPTED, steering=steering)
    assert_patched_like_hf(out.choices[0], hf_qwen3, clean_rows[8:10], 8, "store reference")


def steering_error(http, steering: list[dict], *needles: str) -> None:
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": CORRUPTED, "max_tokens": 2, "steering": steering},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "steering", error
    for needle in needles:
        assert needle in error["message"], error["message"]


def test_an_unknown_store_reference_is_a_400_naming_what_is_missing(http):
    steering_error(
        http,
        [{"op": "patch", "point": POINT, "positions": {"start": 0, "end": 2},
          "capture": {"request_id": "cmpl-nobody"}}],
        "cmpl-nobody", "missing",
    )  # fmt: skip


def test_a_wrong_row_count_is_a_400(http, hf_qwen3):
    rows = encode_rows(torch.zeros(3, hf_qwen3.hidden_size).numpy())
    steering_error(
        http,
        [{"op": "patch", "point": POINT, "rows": rows, "positions": {"start": 0, "end": 2}}],
        "has 3 rows",
    )


def test_bad_base64_is_a_400(http, hf_qwen3):
    rows = {"dtype": "float32", "shape": [1, hf_qwen3.hidden_size], "data": "@@"}
    steering_error(http, [{"op": "patch", "point": POINT, "rows": rows}], "not valid base64")


def test_a_point_that_is_not_steerable_is_a_400(http, hf_qwen3):
    rows = encode_rows(torch.zeros(1, hf_qwen3.hidden_size).numpy())
    steering_error(http, [{"op": "patch", "point": "attn_pattern.1", "rows": rows}], "steer")


def test_the_server_keeps_serving_after_refusals(oai):
    out = complete(oai, CLEAN)
    assert out.choices[0].finish_reason in ("length", "stop")
