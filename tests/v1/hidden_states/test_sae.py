# SPDX-License-Identifier: Apache-2.0
"""SAE top-k features (``--sae``) end to end, and the activation store.

A random SAE in the SAELens on-disk format is written by the tests (d_in =
the tiny model's hidden size, 64 features). The engine encodes the SAE
layer's rows in the worker, right after capture; every returned (ids,
values) pair is compared with the float64 numpy reference encoder applied to
HF transformers' hidden states at that layer, on the token ids vLLM reports:
same ids (up to near-ties), values within 1e-3 relative.

* Python: one engine in this process (the servers below carry the features
  over ZMQ as int32/float32 tensors) with a ``standard`` SAE on an inner layer: "last", "prompt",
  "all" (streamed per output and not), features only or with full states,
  and the validation errors.
* HTTP: one ``vllm serve`` with a ``jumprelu`` SAE on the final layer and an
  activation store: completions and chat, streamed per token, rows landing in
  the store (read with DuckDB); a second server with a read-only store
  directory serves requests with a logged warning.
"""

import json
import os
import subprocess
import uuid

import httpx
import numpy as np
import pytest
import torch

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind
from vllm_hidden_states.sae import encode_topk_numpy, random_sae, save_sae

from .conftest import COMMON_ENGINE_ARGS, llm_in_process, shut_down_in_process, token_ids_of
from .server_utils import sse_events, test_server_process, wait_until

D_SAE = 64
TOP_K = 8
PROMPT = "Once upon a time there was a small robot who loved to count"
REL_TOL = 1e-3


def write_random_sae(path, d_in: int, hook: str, architecture: str = "standard", seed=0):
    """A random SAE in the SAELens layout; returns (dir, numpy weights, cfg)."""
    weights, cfg = random_sae(d_in, D_SAE, hook, architecture, seed)
    save_sae(path, weights, cfg)
    return path, {k: v.numpy() for k, v in weights.items()}, cfg


class Reference:
    """The numpy reference encoder over HF states at the SAE's layer, or at
    its capture point (``"attn_out.1"``: HF forward hooks, :meth:`HFReference.points`)."""

    def __init__(self, hf, layer: int | str, weights, cfg):
        self.hf, self.layer, self.weights, self.cfg = hf, layer, weights, cfg

    def dense(self, token_ids: list[int]) -> np.ndarray:
        """Every feature's activation ``[positions, d_sae]`` (float64)."""
        if isinstance(self.layer, str):
            x = self.hf.points(token_ids)[self.layer].double().numpy()
        else:
            x = self.hf.states(token_ids)[self.layer].double().numpy()
        ids, values = encode_topk_numpy(x, self.weights, self.cfg, D_SAE)
        dense = np.zeros((x.shape[0], D_SAE))
        rows = np.arange(x.shape[0])[:, None].repeat(D_SAE, 1)
        dense[rows[ids >= 0], ids[ids >= 0]] = values[ids >= 0]
        return dense

    def check(self, ids, values, token_ids: list[int], positions: slice, what: str):
        """``ids``/``values`` ``[n, k]`` are the top-k of ``positions``:
        values equal the sorted reference within 1e-3 relative, and each id's
        reference activation equals its value (so a swapped id is only ever a
        near-tie)."""
        ids = np.asarray(ids)
        values = np.asarray(values)
        assert ids.dtype == np.int32 and values.dtype == np.float32, what
        dense = self.dense(token_ids)[positions]
        k = ids.shape[1]
        assert ids.shape == values.shape == (dense.shape[0], k), (what, ids.shape, dense.shape)
        scale = np.abs(dense).max()
        ref_values = -np.sort(-dense, axis=1)[:, :k]
        np.testing.assert_allclose(values, ref_values, atol=REL_TOL * scale, rtol=0, err_msg=what)
        active = ids >= 0
        assert active.mean() > 0.5, f"{what}: too few active features to compare"
        assert np.all(values[~active] == 0), what
        got = np.take_along_axis(dense, np.where(active, ids, 0), axis=1)
        np.testing.assert_allclose(
            got[active], values[active], atol=REL_TOL * scale, rtol=0, err_msg=f"{what}: ids"
        )


# --------------------------------------------------------------------------
# An SAE at a capture point (its hook name says where): one engine each.


@pytest.fixture(scope="module", params=["attn_out", "mlp_out"])
def point_sae(request, tmp_path_factory, qwen3_dir, hf_qwen3):
    kind = request.param
    path, weights, cfg = write_random_sae(
        tmp_path_factory.mktemp("sae") / f"{kind}-1",
        hf_qwen3.hidden_size,
        f"blocks.1.hook_{kind}",
    )
    engine = llm_in_process(
        model=str(qwen3_dir),
        sae=str(path),
        enforce_eager=True,
        max_model_len=512,
        **COMMON_ENGINE_ARGS,
    )
    yield kind, engine, Reference(hf_qwen3, f"{kind}.1", weights, cfg)
    shut_down_in_process(engine)


@pytest.mark.parametrize("positions", ["last", "all"])
def test_an_sae_at_a_capture_point_matches_numpy_reference_on_hf_hooks(point_sae, positions):
    kind, engine, reference = point_sae
    (out,) = run(engine, sae_params(positions))
    feats = out.outputs[0].sae_features
    tokens = token_ids_of(out)
    assert feats["point"] == f"{kind}.1" and "layer" not in feats
    span = slice(len(tokens) - 1, None) if positions == "last" else slice(0, None)
    reference.check(feats["ids"], feats["values"], tokens, span, f"{kind} {positions}")


def test_an_sae_at_a_capture_point_makes_that_point_capturable(point_sae):
    kind, engine, _ = point_sae
    params = SamplingParams(
        max_tokens=2, return_hidden_states=True, hidden_states_points=[f"{kind}.1"]
    )
    (out,) = run(engine, params)
    assert list(out.outputs[0].hidden_states) == [f"{kind}.1"]
    with pytest.raises(VLLMValidationError, match="not capturable"):
        run(engine, SamplingParams(return_hidden_states=True, hidden_states_points=[f"{kind}.0"]))


# --------------------------------------------------------------------------
# Python API: one engine for the module.


@pytest.fixture(scope="module")
def sae_std(tmp_path_factory, hf_qwen3):
    """Standard SAE on layer 2 (``blocks.1.hook_resid_post``)."""
    path, weights, cfg = write_random_sae(
        tmp_path_factory.mktemp("sae") / "std-l2",
        hf_qwen3.hidden_size,
        "blocks.1.hook_resid_post",
    )
    return path, Reference(hf_qwen3, 2, weights, cfg)


@pytest.fixture(scope="module")
def sae_llm(qwen3_dir, sae_std):
    engine = llm_in_process(
        model=str(qwen3_dir),
        sae=str(sae_std[0]),
        enforce_eager=True,
        hidden_states_max_rows=24,
        max_model_len=512,
        **COMMON_ENGINE_ARGS,
    )
    yield engine
    shut_down_in_process(engine)


def run(llm, params, prompts=(PROMPT,)):
    return llm.generate(list(prompts), params, use_tqdm=False)


def sae_params(positions="last", **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 6)
    return SamplingParams(
        temperature=0.0, sae_features={"top_k": TOP_K}, hidden_states_positions=positions, **kwargs
    )


@pytest.mark.parametrize("positions", ["last", "prompt", "all"])
def test_features_match_numpy_reference_on_hf_states(sae_llm, sae_std, positions):
    (out,) = run(sae_llm, sae_params(positions))
    completion = out.outputs[0]
    feats = completion.sae_features
    tokens = token_ids_of(out)
    assert completion.hidden_states is None  # features only: no full states
    assert feats["layer"] == 2
    span = {
        "last": slice(len(tokens) - 1, None),
        "prompt": slice(0, len(out.prompt_token_ids)),
        "all": slice(0, None),
    }[positions]
    sae_std[1].check(feats["ids"], feats["values"], tokens, span, positions)


def test_features_with_full_states_and_long_prompt_split_over_steps(sae_llm, sae_std, hf_qwen3):
    # 24-row buffers: the prompt's capture runs over several steps.
    prompt = " ".join([PROMPT] * 6)
    (out,) = run(
        sae_llm, sae_params("all", hidden_states_layers=[2, -1], return_hidden_states=True)
    )
    (long_out,) = run(sae_llm, sae_params("all"), [prompt])
    tokens = token_ids_of(out)
    c = out.outputs[0]
    assert list(c.hidden_states) == [2, -1]
    assert c.hidden_states[2].shape == (len(tokens), hf_qwen3.hidden_size)
    sae_std[1].check(
        c.sae_features["ids"], c.sae_features["values"], tokens, slice(0, None), "with states"
    )
    long_tokens = token_ids_of(long_out)
    assert len(long_out.prompt_token_ids) > 24 * 2
    f = long_out.outputs[0].sae_features
    sae_std[1].check(f["ids"], f["values"], long_tokens, slice(0, None), "long")


def test_streamed_deltas_concatenate_to_the_final_answer(sae_llm, sae_std):
    """AsyncLLM-style DELTA outputs through LLMEngine: each output carries the
    positions computed since the previous one; together, every position."""
    engine = sae_llm.llm_engine
    params = sae_params("all", output_kind=RequestOutputKind.DELTA)
    request_id = f"sae-delta-{uuid.uuid4().hex[:8]}"
    engine.add_request(request_id, PROMPT, params)
    parts, tokens, prompt = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            prompt = out.prompt_token_ids
            tokens += out.outputs[0].token_ids
            if out.outputs[0].sae_features is not None:
                parts.append(out.outputs[0].sae_features)
    assert len(parts) > 1
    ids = torch.cat([p["ids"] for p in parts])
    values = torch.cat([p["values"] for p in parts])
    sae_std[1].check(ids, values, list(prompt) + tokens, slice(0, None), "deltas")


def test_bad_top_k_fails_alone_naming_what_is_allowed(sae_llm):
    for bad in ({"top_k": 0}, {"top_k": D_SAE + 1}, {"k": 3}, {"top_k": 2.5}):
        with pytest.raises(VLLMValidationError, match=rf"1\.\.{D_SAE}"):
            run(sae_llm, SamplingParams(max_tokens=2, sae_features=bad))
    (out,) = run(sae_llm, sae_params())  # still serving
    assert out.outputs[0].sae_features["ids"].shape == (1, TOP_K)


def test_engine_without_sae_refuses_sae_features(llm):
    with pytest.raises(VLLMValidationError, match="--sae"):
        llm.generate(
            [PROMPT], SamplingParams(max_tokens=2, sae_features={"top_k": 4}), use_tqdm=False
        )


def test_sae_that_does_not_fit_the_model_is_refused_at_start(qwen3_dir, tmp_path, hf_qwen3):
    from vllm.engine.arg_utils import EngineArgs

    wrong, _, _ = write_random_sae(
        tmp_path / "wrong", hf_qwen3.hidden_size + 1, "blocks.1.hook_resid_pre"
    )
    with pytest.raises(ValueError, match="d_in"):
        EngineArgs(model=str(qwen3_dir), sae=str(wrong)).create_engine_config()
    right, _, _ = write_random_sae(
        tmp_path / "right", hf_qwen3.hidden_size, "blocks.1.hook_resid_pre"
    )
    with pytest.raises(ValueError, match="out of range"):
        EngineArgs(model=str(qwen3_dir), sae=str(right), sae_layer=99).create_engine_config()
    with pytest.raises(ValueError, match="not capturable"):
        EngineArgs(
            model=str(qwen3_dir), sae=str(right), hidden_states_layers=[-1]
        ).create_engine_config()


# --------------------------------------------------------------------------
# HTTP: one server, a jumprelu SAE on the final layer, an activation store.

MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def sae_jump(tmp_path_factory, hf_qwen3):
    # The hook names block 0; --sae-layer -1 wins.
    path, weights, cfg = write_random_sae(
        tmp_path_factory.mktemp("sae") / "jump-final",
        hf_qwen3.hidden_size,
        "blocks.0.hook_resid_pre",
        architecture="jumprelu",
        seed=1,
    )
    return path, Reference(hf_qwen3, -1, weights, cfg)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("activation-store")


def sae_server(qwen3_dir, sae_dir, store, logs, wrap=None):
    process = test_server_process(
        qwen3_dir,
        [
            "--sae",
            str(sae_dir),
            "--sae-layer=-1",
            "--max-model-len",
            "512",
            "--activation-store",
            str(store),
        ],
        logs / "server.log",
        name=MODEL,
    )
    if wrap is not None:
        process.argv = [*wrap, *process.argv]
    return process


@pytest.fixture(scope="module")
def http(qwen3_dir, sae_jump, store_dir, tmp_path_factory):
    process = sae_server(
        qwen3_dir, sae_jump[0], store_dir, tmp_path_factory.mktemp("sae-server-logs")
    )
    process.start()
    try:
        process.wait_ready(timeout=600)
        with httpx.Client(base_url=process.base_url, timeout=120.0) as client:
            yield client
    finally:
        process.stop()


def body(positions="last", **kwargs):
    out = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0.0,
        return_token_ids=True,
        sae_features={"top_k": TOP_K},
        hidden_states_positions=positions,
    )
    out.update(kwargs)
    return out


def tokens_of(response: dict, choice: dict) -> list[int]:
    return list(choice["prompt_token_ids"]) + list(choice["token_ids"])


@pytest.mark.parametrize("positions", ["last", "prompt", "all"])
def test_http_features_match_reference(http, sae_jump, positions):
    r = http.post("/v1/completions", json=body(positions))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert "hidden_states" not in choice  # features only
    f = choice["sae_features"]
    tokens = tokens_of(r.json(), choice)
    n = {"last": 1, "prompt": len(choice["prompt_token_ids"]), "all": len(tokens)}[positions]
    assert f["shape"] == [n, TOP_K] and f["top_k"] == TOP_K
    assert f["layer"] == sae_jump[1].hf.num_layers  # -1, absolute
    span = slice(len(tokens) - n, None) if positions == "last" else slice(0, n)
    sae_jump[1].check(
        np.asarray(f["ids"], np.int32), np.asarray(f["values"], np.float32), tokens, span, positions
    )


def test_http_streamed_per_chunk_and_chat_with_states(http, sae_jump, hf_qwen3):
    payload = body("all", stream=True, hidden_states_stream=True)
    with http.stream("POST", "/v1/completions", json=payload) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r)
    parts, tokens, prompt = [], [], None
    for event in events:
        for choice in event.get("choices") or ():
            prompt = choice.get("prompt_token_ids") or prompt
            tokens += choice.get("token_ids") or []
            if choice.get("sae_features"):
                parts.append(choice["sae_features"])
    # How many chunks carry rows is the server's pace (vLLM merges the deltas
    # a slow reader has not taken yet): together they cover every position.
    assert parts, "no chunk carried sae_features"
    starts = [p["start"] for p in parts]
    assert starts == sorted(starts) and starts[0] == 0
    ids = np.concatenate([np.asarray(p["ids"], np.int32) for p in parts])
    values = np.concatenate([np.asarray(p["values"], np.float32) for p in parts])
    sae_jump[1].check(ids, values, list(prompt) + tokens, slice(0, None), "streamed")

    chat = dict(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=4,
        temperature=0.0,
        return_hidden_states=True,
        hidden_states_layers=[-1],
        sae_features={"top_k": 3},
    )
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["hidden_states"]["shape"] == [1, hf_qwen3.hidden_size]
    assert choice["sae_features"]["shape"] == [1, 3]


def test_http_bad_sae_fields_are_400s_naming_what_is_allowed(http):
    for bad, match in (
        ({"top_k": 0}, "top_k"),
        ({"top_k": D_SAE + 1}, f"1..{D_SAE}"),
        ([3], "top_k"),
        ({"top_k": 2, "x": 1}, "top_k"),
    ):
        r = http.post("/v1/completions", json=body(sae_features=bad))
        assert r.status_code == 400, r.text
        assert match in r.json()["error"]["message"]
    r = http.post("/v1/completions", json=body(return_hidden_states=False))
    assert r.status_code == 400


def test_activation_store_rows_land_with_the_schema(http, store_dir):
    import duckdb

    r = http.post("/v1/completions", json=body("all"))
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    request_id = r.json()["id"]
    expected = int((np.asarray(choice["sae_features"]["ids"]) >= 0).sum())
    glob = str(store_dir / "sae_features" / "date=*" / "*.parquet")

    source = f"read_parquet('{glob}', hive_partitioning = true)"
    where = f"WHERE request_id LIKE '{request_id}%'"

    def count():
        try:
            return duckdb.sql(f"SELECT count(*) FROM {source} {where}").fetchall()[0][0]
        except duckdb.IOException:  # no file yet
            return 0

    wait_until(lambda: count() >= expected, "the request's rows in the activation store")
    assert count() == expected
    rel = duckdb.sql(f"SELECT * FROM {source} {where}")
    assert {
        "request_id",
        "step",
        "token_position",
        "token_id",
        "created_at",
        "sae_release",
        "sae_layer",
        "feature_id",
        "activation_value",
        "rank",
        "source_mode",
        "model_id",
        "schema_version",
    } <= set(rel.columns)
    tokens = tokens_of(r.json(), choice)
    positions = duckdb.sql(f"SELECT DISTINCT token_position FROM {source} {where}").fetchall()
    assert {p for (p,) in positions} == set(range(len(tokens)))
    meta = duckdb.sql(
        f"SELECT DISTINCT model_id, sae_release, sae_layer, source_mode FROM {source} {where}"
    ).fetchall()
    assert meta == [(MODEL, "jump-final", choice["sae_features"]["layer"], "inline")]
    top = duckdb.sql(
        f"SELECT feature_id, token_id, step FROM {source} {where} "
        "AND token_position = 3 AND rank = 0"
    ).fetchall()
    assert top == [(choice["sae_features"]["ids"][3][0], tokens[3], 0)]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_store_query_by_the_response_id_finds_every_choice(http, store_dir, route, capsys):
    """The ``id`` of the response, given to ``store query --request-id``,
    finds the rows of each of its n=2 choices (``--choice-index``)."""
    import duckdb

    from vllm_hidden_states.tools.cli import main

    common = dict(
        model=MODEL,
        max_tokens=4,
        temperature=1.0,
        seed=7,
        n=2,
        return_token_ids=True,
        sae_features={"top_k": TOP_K},
        hidden_states_positions="all",
    )
    if route == "completions":
        r = http.post("/v1/completions", json={**common, "prompt": PROMPT})
    else:
        r = http.post(
            "/v1/chat/completions",
            json={**common, "messages": [{"role": "user", "content": PROMPT}]},
        )
    assert r.status_code == 200, r.text
    response = r.json()
    request_id = response["id"]
    glob = str(store_dir / "sae_features" / "date=*" / "*.parquet")

    expected = sum(
        int((np.asarray(c["sae_features"]["ids"]) >= 0).sum()) for c in response["choices"]
    )

    def landed():  # both choices' rows, under whatever id they were written
        try:
            return (
                duckdb.sql(
                    f"SELECT count(*) FROM read_parquet('{glob}', union_by_name = true) "
                    f"WHERE starts_with(request_id, '{request_id}')"
                ).fetchall()[0][0]
                >= expected
            )
        except duckdb.IOException:  # no file yet
            return False

    wait_until(landed, "the request's rows in the activation store")
    for choice in response["choices"]:
        prompt = choice.get("prompt_token_ids") or response["prompt_token_ids"]
        tokens = list(prompt) + list(choice["token_ids"])
        argv = [
            "store",
            "query",
            str(store_dir),
            "deltas",
            "--request-id",
            request_id,
            "--format",
            "json",
        ]
        if choice["index"]:
            argv += ["--choice-index", str(choice["index"])]
        assert main(argv) == 0
        rows = json.loads(capsys.readouterr().out)
        assert rows, f"no rows for --request-id {request_id} choice {choice['index']}"
        assert {(row["token_position"], row["token_id"]) for row in rows} == set(enumerate(tokens))
    assert (
        main(
            [
                "store",
                "query",
                str(store_dir),
                "sql",
                f"SELECT DISTINCT request_id, choice_index FROM sae_features "
                f"WHERE request_id = '{request_id}' ORDER BY 2",
                "--format",
                "json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out) == [
        {"request_id": request_id, "choice_index": 0},
        {"request_id": request_id, "choice_index": 1},
    ]


def test_read_only_store_directory_is_logged_and_requests_are_served(qwen3_dir, sae_jump, tmp_path):
    """As root (which ignores modes) the store directory is a read-only bind
    mount in a private mount namespace (``unshare -rm``); otherwise chmod 555."""
    store = tmp_path / "ro-store"
    store.mkdir()
    wrap = None
    if os.geteuid() == 0:
        import shutil

        if (
            shutil.which("unshare") is None
            or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0
        ):
            pytest.skip("running as root without unshare: cannot make a read-only directory")
        wrap = [
            "unshare",
            "-rm",
            "sh",
            "-c",
            f'mount --bind {store} {store} && mount -o remount,bind,ro {store} && exec "$@"',
            "sh",
        ]
    else:
        os.chmod(store, 0o555)
    process = sae_server(qwen3_dir, sae_jump[0], store, tmp_path, wrap)
    process.start()
    try:
        process.wait_ready(timeout=600)
        with httpx.Client(base_url=process.base_url, timeout=120.0) as client:
            for _ in range(2):
                r = client.post("/v1/completions", json=body("all"))
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["sae_features"]["shape"][1] == TOP_K
        # The store said so in the server log (through vLLM's logger).
        wait_until(
            lambda: "is not writable" in process.log_path.read_text(errors="replace"),
            "the activation store's warning in the server log",
        )
    finally:
        process.stop()
        os.chmod(store, 0o755)
    assert not any(store.rglob("*.parquet"))
