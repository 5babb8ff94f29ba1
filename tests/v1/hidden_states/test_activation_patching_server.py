# SPDX-License-Identifier: Apache-2.0
"""Activation patching over HTTP with the official ``openai`` client: rows
as typed base64 arrays, rows by reference to an earlier request's capture in
the activation store (clean then corrupted run: two calls, no tensor through
the client), a whole sweep in one call (POST /v1/patch_sweep, and the
``LLM`` helper ``vllm_hidden_states.sweep.patch_sweep``), and the 400s.

One real ``vllm serve`` on loopback for the file: tiny Qwen3,
``--enable-steering --steering-points all --hidden-states-points
attn_out,mlp_out,attn_z --activation-store DIR
--activation-store-hidden-states --max-patch-rows 64
--patch-sweep-max-cells 100``. States and sweep grids are compared with HF
transformers whose forward hooks make the same replacement; sweep cells also
with the same patch sent as its own /v1/completions request.
"""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from vllm_hidden_states.patch_rows import encode_rows
from vllm_hidden_states.sweep import SweepError, patch_sweep

from .conftest import HFReference, assert_close
from .server_utils import ServerProcess, running_server, sse_events
from .test_server import decode_rows

MODEL = "tiny-qwen3"
# The same number of tokens; they differ from position 7 on.
CLEAN = "The model splits the prompt into two tokens and the sky has two"
CORRUPTED = "The model splits the prompt into six tokens and the sky has six"
POINT = "resid_pre.2"
LAYERS = [0, 1, 2, 3, 4]
ANSWER, WRONG = " two", " six"
# The sweeps' points, and the most cells one sweep may run here.
POINTS = ["resid_pre.0", "resid_pre.2", "attn_out.1", "mlp_out.3"]
MAX_CELLS = 100


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("patch-store")
    with running_server(
        qwen3_dir,
        [
            "--enable-steering",
            "--steering-points",
            "all",
            "--hidden-states-points",
            "attn_out,mlp_out,attn_z",
            "--max-patch-rows",
            "64",
            "--patch-sweep-max-cells",
            str(MAX_CELLS),
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
    with httpx.Client(base_url=server.base_url, timeout=600.0) as client:
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
                 "stored": {"request_id": clean.id}}]  # fmt: skip
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
                 "stored": {"request_id": clean.id}}]  # fmt: skip
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
          "stored": {"request_id": "cmpl-nobody"}}],
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


# -- a sweep in one call: POST /v1/patch_sweep and the LLM helper ----------------


@pytest.fixture(scope="module")
def tokenizer(qwen3_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_dir)


@pytest.fixture(scope="module")
def ids(tokenizer):
    """The prompts' and answers' token ids (as /v1/completions tokenizes)."""
    encode = tokenizer.encode
    return {
        "clean": encode(CLEAN),
        "corrupted": encode(CORRUPTED),
        "answer": encode(ANSWER, add_special_tokens=False)[0],
        "wrong": encode(WRONG, add_special_tokens=False)[0],
    }


def body(**over):
    out = {"model": MODEL, "clean": CLEAN, "corrupted": CORRUPTED, "points": POINTS,
           "metric": {"logit_diff": [ANSWER, WRONG]}}  # fmt: skip
    out.update(over)
    return {k: v for k, v in out.items() if v is not None}


@pytest.fixture(scope="module")
def answer(http):
    """The module's sweep: POINTS x every position, logit difference."""
    r = http.post("/v1/patch_sweep", json=body())
    assert r.status_code == 200, r.text
    return r.json()


@torch.inference_mode()
def hf_grid(hf: HFReference, ids: dict, points: list[str], positions: list[int]):
    """The same sweep with HF forward hooks: ``grid[i, j]`` the logit
    difference of the corrupted prompt with ``points[i]`` at ``positions[j]``
    replaced by the clean prompt's; the clean and corrupted differences."""
    donor = hf.points(ids["clean"])

    def diff(token_ids, items=()) -> float:
        with hf.steering(list(items)):
            logits = hf.model(torch.tensor([token_ids])).logits[0, -1].double()
        lp = torch.log_softmax(logits, -1)
        return float(lp[ids["answer"]] - lp[ids["wrong"]])

    grid = np.zeros((len(points), len(positions)))
    for i, point in enumerate(points):
        for j, p in enumerate(positions):
            rows = donor[point][p : p + 1].float()
            item = {"point": point, "op": "patch", "rows": rows, "start": p, "end": p + 1}
            grid[i, j] = diff(ids["corrupted"], [item])
    return grid, diff(ids["clean"]), diff(ids["corrupted"])


@torch.inference_mode()
def hf_head_grid(hf: HFReference, ids: dict, point: str, positions: list[int]) -> np.ndarray:
    """``[heads, positions]``: the logit difference of the corrupted prompt
    with head h of ``point`` (attn_z, ``[positions, heads, head_dim]``) at a
    position replaced by the clean prompt's, the other heads kept."""
    donor = hf.points(ids["clean"])[point]
    out = np.zeros((hf.num_heads, len(positions)))
    for h in range(hf.num_heads):
        for j, p in enumerate(positions):
            rows = donor[p : p + 1, h : h + 1].float()  # [1, 1, head_dim]
            item = {"point": point, "op": "patch_heads", "heads": [h], "head_dim": rows.shape[-1],
                    "rows": rows, "start": p, "end": p + 1}  # fmt: skip
            with hf.steering([item]):
                logits = hf.model(torch.tensor([ids["corrupted"]])).logits[0, -1].double()
            lp = torch.log_softmax(logits, -1)
            out[h, j] = float(lp[ids["answer"]] - lp[ids["wrong"]])
    return out


def test_the_grid_and_baselines_equal_hf_hooks_doing_the_same_patches(answer, hf_qwen3, ids):
    n = len(ids["clean"])
    grid, clean, corrupted = hf_grid(hf_qwen3, ids, POINTS, list(range(n)))
    got = np.asarray(answer["grid"])
    assert answer["object"] == "patch_sweep" and answer["model"] == MODEL
    assert answer["points"] == POINTS and answer["positions"] == list(range(n))
    assert answer["num_tokens"] == n and got.shape == (len(POINTS), n)
    assert answer["metric"] == {"logit_diff": [ids["answer"], ids["wrong"]]}
    assert abs(answer["clean"] - clean) < 1e-3 and abs(answer["corrupted"] - corrupted) < 1e-3
    assert np.abs(got - grid).max() < 1e-3, np.abs(got - grid).max()
    assert np.ptp(grid) > 1e-2, "the sweep moved nothing"
    assert "head_grid" not in answer


def completion_logprob(oai, prompt_ids: list[int], token: int, steering) -> float:
    """``log p(token | prompt_ids)`` by a /v1/completions request of its own:
    the prompt's logprobs of ``prompt_ids + [token]`` (causal: the appended
    token changes nothing before it), ``steering`` applied."""
    out = oai.completions.create(
        model=MODEL,
        prompt=[*prompt_ids, token],
        max_tokens=1,
        temperature=0.0,
        extra_body={"prompt_logprobs": 0, "steering": steering},
    )
    return float(out.choices[0].model_extra["prompt_logprobs"][-1][str(token)]["logprob"])


def test_each_cell_equals_the_same_patch_sent_as_its_own_completion(http, oai, ids):
    """Token-id prompts, a logprob metric: three cells, each against the
    same ``patch`` of the clean run's row (read by a completion of its own)
    on /v1/completions."""
    cells = [("resid_pre.2", 7), ("attn_out.1", 16), ("mlp_out.3", 16)]
    points = sorted({p for p, _ in cells})
    r = http.post(
        "/v1/patch_sweep",
        json=body(clean=ids["clean"], corrupted=ids["corrupted"], points=points,
                  positions=[7, 16], metric={"logprob": ids["answer"]}),
    )  # fmt: skip
    assert r.status_code == 200, r.text
    answer = r.json()
    clean = oai.completions.create(
        model=MODEL,
        prompt=ids["clean"],
        max_tokens=1,
        temperature=0.0,
        extra_body={"return_hidden_states": True, "hidden_states_points": points,
                    "hidden_states_positions": "prompt"},
    )  # fmt: skip
    obj = clean.choices[0].model_extra["hidden_states"]
    # Rows: the layers asked (the default one), then the points.
    rows = dict(zip(obj["points"], decode_rows(obj)[-len(points) :], strict=True))
    alones = []
    for point, p in cells:
        steering = [{"op": "patch", "point": point, "rows": encode_rows(rows[point][p : p + 1]),
                     "positions": {"start": p, "end": p + 1}}]  # fmt: skip
        alone = completion_logprob(oai, ids["corrupted"], ids["answer"], steering)
        got = answer["grid"][points.index(point)][answer["positions"].index(p)]
        assert abs(got - alone) < 1e-5, (point, p, got, alone)
        alones.append(alone)
    unpatched = completion_logprob(oai, ids["corrupted"], ids["answer"], None)
    assert abs(answer["corrupted"] - unpatched) < 1e-5
    assert max(abs(x - unpatched) for x in alones) > 1e-3, "no cell moved the metric"


def test_a_stream_sends_a_row_event_per_point_then_the_answer(http, answer):
    with http.stream("POST", "/v1/patch_sweep", json=body(stream=True)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    rows, final = events[:-1], events[-1]
    total = len(POINTS) * answer["num_tokens"]
    assert [e["object"] for e in rows] == ["patch_sweep.row"] * len(POINTS)
    assert sorted(e["point"] for e in rows) == sorted(POINTS)
    assert [e["cells_done"] for e in rows] == sorted(e["cells_done"] for e in rows)
    assert rows[-1]["cells_done"] == total and {e["cells_total"] for e in rows} == {total}
    assert final["object"] == "patch_sweep" and final["points"] == POINTS
    grid = np.asarray(final["grid"])
    assert np.abs(grid - np.asarray(answer["grid"])).max() < 1e-5
    for e in rows:
        assert np.abs(np.asarray(e["values"]) - grid[POINTS.index(e["point"])]).max() == 0


def refusal(http, request: dict, param: str, *needles: str) -> dict:
    r = http.post("/v1/patch_sweep", json=request)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400, error
    assert error["param"] == param, error
    for needle in needles:
        assert needle in error["message"], error["message"]
    return error


@pytest.mark.parametrize(
    "over, param, needles",
    [
        (dict(corrupted="The model splits"), "corrupted", ["same token length"]),
        (dict(points=["resid_pre.9"]), "points", ["out of range"]),
        (dict(points=["attn_pattern.1"]), "points", ["cannot be patched"]),
        (dict(points=["resid_mid.1"]), "points", ["not capturable", "--hidden-states-points"]),
        (dict(points=[]), "points", ["non-empty"]),
        (dict(positions=[0, 40]), "positions", ["[40] out of range", "0..16"]),
        (dict(metric={"logit_diff": [" two six", WRONG]}), "metric", ["exactly one token"]),
        (dict(metric={"logprob": 10**7}), "metric", ["outside this model's vocabulary"]),
        (dict(metric={"accuracy": 3}), "metric", ["logit_diff", "logprob"]),
        (dict(heads=[0]), "heads", ["attn_z"]),
        (dict(layers=[1]), "layers", ["unknown field", "points"]),
    ],
    ids=["unequal-lengths", "unknown-point", "not-patchable", "not-capturable", "empty-grid",
         "position-out-of-range", "multi-token-string", "token-out-of-vocab", "unknown-metric",
         "heads-without-head-points", "unknown-field"],
)  # fmt: skip
def test_a_bad_sweep_is_a_400_naming_the_field(http, over, param, needles):
    refusal(http, body(**over), param, *needles)


def test_a_sweep_over_the_cell_limit_is_a_400_naming_the_flag(http):
    points = ["resid_pre.0", "resid_pre.1", "resid_pre.2", "resid_pre.3", "attn_out.0", "mlp_out.0"]
    refusal(http, body(points=points), "points", "102 cells", f"{MAX_CELLS}",
            "--patch-sweep-max-cells")  # fmt: skip


def test_a_head_point_sweeps_its_heads_each_cell_as_hf_patching_that_head(http, hf_qwen3, ids):
    """A plain point beside a head point (attn_z.1, every head): the head
    grid ``[head points, heads, positions]`` equals HF hooks writing that
    one head of o_proj's input; the plain row stays in ``grid``."""
    positions = [7, 16]
    r = http.post(
        "/v1/patch_sweep",
        json=body(points=["resid_pre.1", "attn_z.1"], positions=positions, heads="all"),
    )
    assert r.status_code == 200, r.text
    answer = r.json()
    heads = hf_qwen3.num_heads
    assert answer["points"] == ["resid_pre.1"] and answer["head_points"] == ["attn_z.1"]
    assert answer["heads"] == list(range(heads))
    got = np.asarray(answer["head_grid"])
    assert got.shape == (1, heads, len(positions))
    expected = hf_head_grid(hf_qwen3, ids, "attn_z.1", positions)
    assert np.abs(got[0] - expected).max() < 1e-3, np.abs(got[0] - expected).max()
    assert np.ptp(expected) > 1e-3, "no head moved the metric"
    grid, _, _ = hf_grid(hf_qwen3, ids, ["resid_pre.1"], positions)
    assert np.abs(np.asarray(answer["grid"]) - grid).max() < 1e-3


def test_the_server_keeps_sweeping_after_refusals(http):
    r = http.post("/v1/patch_sweep", json=body(points=["resid_pre.1"], positions=[7]))
    assert r.status_code == 200, r.text
    assert np.asarray(r.json()["grid"]).shape == (1, 1)


def test_the_llm_helper_equals_hf_hooks_and_refuses_alike(llm, hf_qwen3, ids):
    """The helper on the in-process ``llm`` engine (every point steerable,
    resid_pre capturable): numpy grid and baselines as HF's, and the same
    checks as the route's (a SweepError naming the field)."""
    points, positions = ["resid_pre.1", "resid_pre.3"], [0, 7, 16]
    result = patch_sweep(llm, clean=CLEAN, corrupted=CORRUPTED, points=points,
                         positions=positions, metric={"logit_diff": [ANSWER, WRONG]})  # fmt: skip
    grid, clean, corrupted = hf_grid(hf_qwen3, ids, points, positions)
    assert isinstance(result.grid, np.ndarray) and result.grid.shape == (2, 3)
    assert result.points == points and result.positions == positions
    assert np.abs(result.grid - grid).max() < 1e-3, np.abs(result.grid - grid).max()
    assert abs(result.clean - clean) < 1e-3 and abs(result.corrupted - corrupted) < 1e-3
    with pytest.raises(SweepError, match="over the limit of 5 per sweep") as e:
        patch_sweep(llm, clean=CLEAN, corrupted=CORRUPTED, points=points,
                    metric={"logprob": ANSWER}, max_cells=5)  # fmt: skip
    assert e.value.param == "points"


def test_the_head_patching_example_sweeps_heads_in_one_call_like_hf(
    server, hf_qwen3, tokenizer, tmp_path
):
    """examples/head_patching.py against this server (alone, it starts
    ``make serve``'s with the same flags): its heads x positions grid at
    attn_z.2 equals HF hooks writing each head, and it plots it."""
    examples = Path(__file__).parents[3] / "examples"
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(examples / "head_patching.py"), "--base-url", server.base_url,
         "--out", str(out), "--layers", "2"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    answer = json.loads((out / "head_patching.json").read_text())
    assert (out / "head_patching.png").stat().st_size > 0
    sys.path.insert(0, str(examples))
    try:
        import head_patching
    finally:
        sys.path.remove(str(examples))
    encode = tokenizer.encode
    ids = {
        "clean": encode(head_patching.CLEAN),
        "corrupted": encode(head_patching.CORRUPTED),
        "answer": encode(head_patching.A, add_special_tokens=False)[0],
        "wrong": encode(head_patching.B, add_special_tokens=False)[0],
    }
    assert answer["head_points"] == ["attn_z.2"]
    assert answer["positions"] == list(range(len(ids["clean"])))
    expected = hf_head_grid(hf_qwen3, ids, "attn_z.2", answer["positions"])
    got = np.asarray(answer["head_grid"])[0]
    assert np.abs(got - expected).max() < 1e-3, np.abs(got - expected).max()
