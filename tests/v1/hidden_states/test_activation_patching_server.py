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

import asyncio

import httpx
import numpy as np
import openai
import pytest
import torch

from vllm_hidden_states.patch_rows import encode_rows

from .conftest import HFReference, assert_close
from .server_utils import ServerProcess, running_server
from .test_server import decode_rows

MODEL = "tiny-qwen3"
# The same number of tokens; they differ from position 7 on.
CLEAN = "The model splits the prompt into two tokens and the sky has two"
CORRUPTED = "The model splits the prompt into six tokens and the sky has six"
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
    plain = hf.states(ids)[LAYERS[-1]]
    assert not torch.allclose(expected[LAYERS[-1]], plain, atol=1e-3), f"{what}: nothing patched"


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


def load_example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[3] / "examples" / "activation_patching.py"
    spec = importlib.util.spec_from_file_location("activation_patching_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@torch.inference_mode()
def hf_sweep(hf: HFReference, model_dir, example) -> tuple[np.ndarray, float, float]:
    """The example's sweep with HF forward hooks: ``diff[k, p]`` of the
    corrupted prompt with resid_pre.k at p replaced by the clean prompt's,
    and the clean and corrupted differences."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    clean = tok(example.CLEAN, add_special_tokens=False)["input_ids"]
    corrupt = tok(example.CORRUPTED, add_special_tokens=False)["input_ids"]
    a = tok(example.CLEAN_ANSWER, add_special_tokens=False)["input_ids"][0]
    b = tok(example.CORRUPTED_ANSWER, add_special_tokens=False)["input_ids"][0]
    donor = hf.points(clean)

    def diff(ids, items=()) -> float:
        with hf.steering(list(items)):
            logits = hf.model(torch.tensor([ids])).logits[0, -1].double()
        lp = torch.log_softmax(logits, -1)
        return float(lp[a] - lp[b])

    grid = np.zeros((hf.num_layers, len(corrupt)))
    for k in range(hf.num_layers):
        for p in range(len(corrupt)):
            rows = donor[f"resid_pre.{k}"][p : p + 1].float()
            grid[k, p] = diff(corrupt, [{"point": f"resid_pre.{k}", "op": "patch", "rows": rows,
                                         "start": p, "end": p + 1}])  # fmt: skip
    return grid, diff(clean), diff(corrupt)


def test_the_patching_example_gives_hf_hooks_numbers_and_its_plot(
    server, hf_qwen3, qwen3_dir, tmp_path
):
    """examples/activation_patching.py against this server (clean capture in
    the store, one patch by reference per layer and position) equals the
    same sweep with HF forward hooks; it writes its PNG."""
    example = load_example()
    result = asyncio.run(example.sweep(server.url("/v1")))
    grid, clean, corrupted = hf_sweep(hf_qwen3, qwen3_dir, example)
    assert result.layers == list(range(hf_qwen3.num_layers))
    assert abs(result.clean - clean) < 1e-3 and abs(result.corrupted - corrupted) < 1e-3
    assert np.abs(result.diff - grid).max() < 1e-3, np.abs(result.diff - grid).max()
    assert np.ptp(grid) > 1e-2, "the sweep moved nothing"
    png = example.plot(result, tmp_path / "patching.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_hidden_states_route_patches_by_store_reference(http, oai, hf_qwen3, qwen3_dir):
    """POST /v1/hidden_states (every prompt token's states, an encoder's
    read) with the clean run's rows patched in by reference."""
    from transformers import AutoTokenizer

    clean = complete(oai, CLEAN)
    clean_rows = states_of(clean.choices[0])[LAYERS.index(2)]
    ids = AutoTokenizer.from_pretrained(qwen3_dir).encode(CORRUPTED)
    steering = [{"op": "patch", "point": POINT, "positions": {"start": 8, "end": 10},
                 "capture": {"request_id": clean.id}}]  # fmt: skip
    r = http.post(
        "/v1/hidden_states",
        json={"model": MODEL, "input": CORRUPTED, "layer": 3, "steering": steering},
    )
    assert r.status_code == 200, r.text
    states = torch.tensor(r.json()["hidden_states"], dtype=torch.float32)
    item = {"point": POINT, "op": "patch", "rows": clean_rows[8:10], "start": 8, "end": 10}
    assert_close(states, hf_qwen3.steered_states(ids, [item])[3], "route, patched layer 3")
    assert not torch.allclose(states, hf_qwen3.states(ids)[3], atol=1e-3)


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
