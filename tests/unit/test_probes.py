# SPDX-License-Identifier: Apache-2.0
"""Probes without an engine: the file format and its refusals at start, the
``probes`` field through the one resolver and HTTP parsing, the scorer
against numpy, and a choice's ``probe_scores`` object."""

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from vllm_hidden_states.engine_args import probe_problems, probes_entry
from vllm_hidden_states.hidden_states_config import HiddenStatesConfig, probe_capture_ids
from vllm_hidden_states.layers import model_layers_for
from vllm_hidden_states.probes import ProbeSet, read_probe, save_probe, score_numpy
from vllm_hidden_states.request_fields import FieldError, RequestFields, resolve_fields
from vllm_hidden_states.server.errors import ApiError
from vllm_hidden_states.server.openai_request import parse_ask
from vllm_hidden_states.server.openai_response import encode_choice_scores

HIDDEN = 16
N_LAYERS = 4


def probe(tmp_path, name="p", k=2, point="resid_post.1", output="none", **tensors):
    rng = np.random.default_rng(0)
    return save_probe(
        tmp_path / f"{name}.safetensors",
        tensors.pop("weight", rng.standard_normal((k, HIDDEN))),
        tensors.pop("bias", rng.standard_normal(k)),
        point,
        output,
        **tensors,
    )


def config(tmp_path, hidden=HIDDEN) -> HiddenStatesConfig:
    """An engine's config with the probes of ``tmp_path``, built by hand."""
    model = model_layers_for("Qwen3ForCausalLM", N_LAYERS)
    probes = probe_capture_ids(probes_entry(str(tmp_path)), N_LAYERS, model)
    return HiddenStatesConfig(N_LAYERS, tuple(range(N_LAYERS + 1)), probes=probes)


# --------------------------------------------------------------------------
# The file format


def test_a_one_dimensional_weight_is_a_probe_of_one_output(tmp_path):
    path = probe(tmp_path, weight=np.ones(HIDDEN), bias=np.array(0.5), output="sigmoid")
    p = read_probe(path)
    assert (p.k, p.width, p.output, p.point) == (1, HIDDEN, "sigmoid", "resid_post.1")
    assert p.entry()["normalised"] is False


@pytest.mark.parametrize(
    "tensors, says",
    [
        ({"weight": np.ones((2, HIDDEN)) * np.nan}, "tensor .weight. holds non-finite"),
        ({"bias": np.ones(3)}, r"bias has shape \[3\]; .* must be \[2\]"),
        (
            {"mean": np.zeros(HIDDEN + 1)},
            rf"mean has shape \[{HIDDEN + 1}\]; it must be \[{HIDDEN}\]",
        ),
        ({"scale": np.zeros(HIDDEN)}, "scale has zeros"),
    ],
)
def test_a_bad_tensor_is_refused_naming_the_file_and_the_rule(tmp_path, tensors, says):
    path = probe(tmp_path, name="bad", **tensors)
    with pytest.raises(ValueError, match=f"probe bad.safetensors: {says}"):
        read_probe(path)


def test_missing_bias_unknown_tensors_and_bad_metadata_are_refused(tmp_path):
    save_file(
        {"weight": np.ones((2, HIDDEN), np.float32)},
        str(tmp_path / "nobias.safetensors"),
        metadata={"point": "-1"},
    )
    with pytest.raises(ValueError, match="nobias.safetensors: no 'bias' tensor"):
        read_probe(tmp_path / "nobias.safetensors")
    save_file(
        {
            "weight": np.ones(HIDDEN, np.float32),
            "bias": np.ones(1, np.float32),
            "extra": np.ones(1, np.float32),
        },
        str(tmp_path / "extra.safetensors"),
        metadata={"point": "-1"},
    )
    with pytest.raises(ValueError, match=r"unknown tensors \['extra'\]"):
        read_probe(tmp_path / "extra.safetensors")
    save_file(
        {"weight": np.ones(HIDDEN, np.float32), "bias": np.ones(1, np.float32)},
        str(tmp_path / "nopoint.safetensors"),
    )
    with pytest.raises(ValueError, match="names no 'point'"):
        read_probe(tmp_path / "nopoint.safetensors")
    with pytest.raises(
        ValueError, match=r"output 'relu' is not one of \['none', 'sigmoid', 'softmax'\]"
    ):
        read_probe(probe(tmp_path, name="relu", output="relu"))
    with pytest.raises(ValueError, match="softmax over one output is always 1"):
        read_probe(probe(tmp_path, name="soft1", k=1, output="softmax"))


def test_a_float64_value_past_float32s_range_is_refused_as_non_finite(tmp_path):
    save_file(
        {"weight": np.ones(HIDDEN), "bias": np.array([1e300])},
        str(tmp_path / "huge.safetensors"),
        metadata={"point": "-1"},
    )
    with pytest.raises(ValueError, match="tensor 'bias' holds non-finite.*float32's range"):
        read_probe(tmp_path / "huge.safetensors")


def test_an_empty_or_missing_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no \\*.safetensors file"):
        probes_entry(str(tmp_path))
    with pytest.raises(ValueError, match="not a directory"):
        probes_entry(str(tmp_path / "absent"))


def test_start_refuses_a_wrong_width_and_a_point_the_model_lacks(tmp_path):
    probe(tmp_path, name="ok", point="blocks.2.hook_resid_pre")
    probe(tmp_path, name="neurons", point="mlp_post.1")
    probe(tmp_path, name="heads", point="blocks.1.attn.hook_z")
    probe(tmp_path, name="far", point="-9")
    cfg = config(tmp_path)
    assert cfg.probes["ok"]["capture_id"] == 2  # resid_pre.2 = HF layer 2
    problems = probe_problems(cfg, HIDDEN + 1)
    assert (
        sum(f"{HIDDEN} wide but the model's hidden size is {HIDDEN + 1}" in p for p in problems)
        == 4
    )
    assert any("'neurons'" in p and "not a residual-stream row" in p for p in problems)
    assert any("'heads'" in p and "not a residual-stream row" in p for p in problems)
    assert any("'far'" in p and "out of range for a 4-layer model" in p for p in problems)
    assert not any("'ok'" in p and "cannot capture" in p for p in problems)


# --------------------------------------------------------------------------
# The request field


def test_the_resolver_checks_names_against_the_engines_probes(tmp_path):
    probe(tmp_path, name="tox")
    cfg = config(tmp_path)
    asked = resolve_fields(cfg, RequestFields(probes=["tox"]))
    assert asked.probes == ("tox",) and asked.layers == ()  # probes alone: no vectors
    with pytest.raises(
        FieldError, match=r"probe 'x' is not loaded on this engine; available probes: \['tox'\]"
    ):
        resolve_fields(cfg, RequestFields(probes=["x"]))
    no_probes = HiddenStatesConfig(N_LAYERS, tuple(range(N_LAYERS + 1)))
    with pytest.raises(FieldError, match="--probes DIR"):
        resolve_fields(no_probes, RequestFields(probes=["tox"]))
    with pytest.raises(FieldError, match="--probes DIR") as e:
        resolve_fields(None, RequestFields(probes=["tox"]))
    assert e.value.parameter == "probes"


def test_http_parses_probes_alone_and_refuses_a_malformed_list():
    ask = parse_ask({"probes": ["a", "b"], "hidden_states_positions": "all"})
    assert ask.probes == ("a", "b") and ask.layers == () and ask.positions == "all"
    with pytest.raises(ApiError, match="non-empty list of probe names"):
        parse_ask({"probes": [1]})


# --------------------------------------------------------------------------
# Scoring


@pytest.mark.parametrize("output", ["none", "sigmoid", "softmax"])
def test_the_scorer_equals_the_numpy_reference(tmp_path, output):
    rng = np.random.default_rng(1)
    path = probe(
        tmp_path,
        name="s",
        k=3,
        output=output,
        mean=rng.standard_normal(HIDDEN),
        scale=rng.uniform(0.5, 2, HIDDEN),
    )
    entry = {**read_probe(path).entry(), "capture_id": 2}
    scorer = ProbeSet([entry], torch.device("cpu"))
    x = torch.from_numpy(rng.standard_normal((5, HIDDEN)).astype(np.float32))
    got = scorer.score(("s",), lambda k: x).numpy()
    np.testing.assert_allclose(got, score_numpy(x.numpy(), read_probe(path)), atol=1e-5, rtol=0)


def test_a_choices_scores_object_names_each_probe_with_its_shape():
    parts = [
        {"a": torch.ones(2, 3), "b": torch.zeros(2, 1)},
        {"a": torch.ones(1, 3), "b": torch.ones(1, 1)},
    ]
    ask = parse_ask({"probes": ["a", "b"], "hidden_states_positions": "all"})
    obj = encode_choice_scores(parts, ask, start=4)
    assert obj["a"]["shape"] == [3, 3] and obj["b"]["shape"] == [3, 1] and obj["a"]["start"] == 4
    assert np.asarray(obj["b"]["data"]).ravel().tolist() == [0.0, 0.0, 1.0]


def test_the_client_decodes_probe_scores_in_either_encoding():
    from vllm_hidden_states.client import probe_scores

    scores = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    for fmt in ("float", "base64"):
        ask = parse_ask({"probes": ["a"], "hidden_states_format": fmt})
        choice = {"index": 0, "probe_scores": encode_choice_scores([{"a": scores}], ask)}
        if fmt == "float":  # as JSON brings it: lists, not numpy
            choice["probe_scores"]["a"]["data"] = choice["probe_scores"]["a"]["data"].tolist()
        decoded = probe_scores(choice)
        np.testing.assert_array_equal(decoded["a"], scores[-1:].numpy())  # "last": one row
