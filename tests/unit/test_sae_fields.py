# SPDX-License-Identifier: Apache-2.0
"""SAE fields without an engine: HTTP parsing (``sae_features``), the
front-end resolver, ``--sae`` at start (config entry and refusals), the
tracker's features, and a choice's ``sae_features`` object."""

import json

import pytest
import torch

from vllm_hidden_states.engine_args import sae_entry, sae_problems
from vllm_hidden_states.hidden_states_config import HiddenStatesConfig
from vllm_hidden_states.request_fields import FieldError, RequestFields, resolve_fields
from vllm_hidden_states.server.errors import ApiError
from vllm_hidden_states.server.openai_request import HiddenStatesAsk, parse_ask
from vllm_hidden_states.server.openai_response import encode_choice_features


def bad(extra) -> str:
    with pytest.raises(ApiError) as e:
        parse_ask(extra)
    assert e.value.status == 400
    return str(e.value)


# --------------------------------------------------------------------------
# HTTP fields


def test_sae_features_alone_asks_for_features_only():
    ask = parse_ask({"sae_features": {"top_k": 20}})
    assert ask == HiddenStatesAsk((), "float", "last", False, 20)


def test_sae_features_with_layers_asks_for_both_and_positions_apply():
    ask = parse_ask(
        {
            "return_hidden_states": True,
            "sae_features": {"top_k": 3},
            "hidden_states_layers": [-1, 2],
            "hidden_states_positions": "all",
            "hidden_states_stream": True,
        }
    )
    assert ask.layers == (-1, 2) and ask.sae_top_k == 3 and ask.positions == "all"
    assert ask.stream


@pytest.mark.parametrize(
    "value",
    [
        {"top_k": 0},
        {"top_k": -2},
        {"top_k": True},
        {"top_k": 2.0},
        {"k": 3},
        {"top_k": 3, "x": 1},
        [3],
        3,
        "top_k",
    ],
)
def test_bad_sae_features_are_400s_naming_the_shape(value):
    assert '{"top_k": k}' in bad({"sae_features": value})


def test_sae_features_with_return_hidden_states_false_or_empty_layers_is_400():
    assert "return_hidden_states" in bad(
        {"sae_features": {"top_k": 2}, "return_hidden_states": False}
    )
    assert "leave it out" in bad({"sae_features": {"top_k": 2}, "hidden_states_layers": []})


def test_requests_without_sae_fields_are_unchanged():
    assert parse_ask({"return_hidden_states": True}).sae_top_k == 0
    assert parse_ask({"return_hidden_states": True}).layers == (-1,)
    assert parse_ask({"temperature": 0}) is None


def test_choice_object_concatenates_deltas_and_keeps_dtypes(wire):
    ids = torch.tensor([[5, 2, -1], [1, 0, 7]], dtype=torch.int32)
    values = torch.tensor([[3.0, 1.5, 0.0], [2.0, 1.0, 0.5]])
    parts = [
        {"layer": 4, "ids": ids[:1], "values": values[:1]},
        {"layer": 4, "ids": ids[1:], "values": values[1:]},
    ]
    ask = HiddenStatesAsk((), "float", "all", True, 3)
    obj = wire(encode_choice_features(parts, ask, start=7))
    assert obj == {
        "layer": 4,
        "top_k": 3,
        "positions": "all",
        "start": 7,
        "shape": [2, 3],
        "ids": ids.tolist(),
        "values": values.tolist(),
    }
    last = wire(encode_choice_features(parts, HiddenStatesAsk((), "float", "last", False, 3)))
    assert last["shape"] == [1, 3] and "start" not in last and last["ids"] == [[1, 0, 7]]
    assert encode_choice_features([], ask) is None


# --------------------------------------------------------------------------
# --sae at start


def write_sae(tmp_path, d_in=16, hook="blocks.2.hook_resid_post"):
    from vllm_hidden_states.sae import save_sae

    weights = {
        "W_enc": torch.zeros(d_in, 8),
        "b_enc": torch.zeros(8),
        "W_dec": torch.zeros(8, d_in),
        "b_dec": torch.zeros(d_in),
    }
    cfg = {"architecture": "standard", "d_in": d_in, "d_sae": 8, "metadata": {"hook_name": hook}}
    return save_sae(tmp_path / "my-sae", weights, cfg)


def test_sae_entry_reads_layer_from_hook_or_flag(tmp_path):
    path = write_sae(tmp_path)
    entry = sae_entry(str(path))
    assert entry == {
        "path": str(path.resolve()),
        "layer": 3,
        "point": None,
        "hook_name": "blocks.2.hook_resid_post",
        "d_in": 16,
        "d_sae": 8,
        "name": "my-sae",
    }
    given = sae_entry(str(path), -2)
    assert given["layer"] == -2 and given["hook_name"] is None  # the flag's layer, not the hook's


@pytest.mark.parametrize("kind", ["attn_out", "mlp_out", "resid_mid"])
def test_sae_entry_reads_a_capture_point_from_its_hook(tmp_path, kind):
    entry = sae_entry(str(write_sae(tmp_path, hook=f"blocks.2.hook_{kind}")))
    assert entry["point"] == f"{kind}.2" and entry["layer"] is None


def test_sae_entry_refusals_name_what_is_allowed(tmp_path):
    with pytest.raises(ValueError, match="cfg.json"):
        sae_entry(str(tmp_path / "missing"))
    path = write_sae(tmp_path, hook="blocks.2.attn.hook_z")
    with pytest.raises(ValueError, match="--sae-layer"):
        sae_entry(str(path))
    (path / "cfg.json").write_text(
        json.dumps({"d_in": 16, "d_sae": "8", "hook_name": "blocks.0.hook_resid_pre"})
    )
    with pytest.raises(ValueError, match="d_sae"):
        sae_entry(str(path))


def cfg_with(sae_layer_given: int, layers=None, num_layers=4):
    sae = {"path": "/x", "layer": sae_layer_given, "d_in": 16, "d_sae": 8, "name": "x"}
    inside = -(num_layers + 1) <= sae_layer_given <= num_layers
    all_layers = tuple(range(num_layers + 1)) if layers is None else tuple(layers)
    return HiddenStatesConfig(
        num_layers,
        all_layers,
        None,
        24,
        sae,
        sae_layer_given % (num_layers + 1) if inside else None,
    )


def test_sae_problems_at_start():
    assert sae_problems(cfg_with(2), 16) == []
    assert "d_in is 16" in sae_problems(cfg_with(2), 32)[0]
    assert "out of range" in sae_problems(cfg_with(9), 16)[0]
    assert "not capturable" in sae_problems(cfg_with(2, layers=[4]), 16)[0]


def sae_top_k_of(cfg: HiddenStatesConfig, sae_features) -> int:
    fields = RequestFields(sae_features=sae_features, hidden_states_layers=[0])
    return resolve_fields(cfg, fields).sae_top_k


def test_sae_features_need_an_sae_on_the_engine():
    with pytest.raises(FieldError, match="--sae") as e:
        sae_top_k_of(HiddenStatesConfig(4, (0, 1, 2, 3, 4)), {"top_k": 3})
    assert e.value.parameter == "sae_features"


def test_sae_top_k_is_bounded_by_the_saes_d_sae():
    assert sae_top_k_of(cfg_with(2), {"top_k": 8}) == 8
    with pytest.raises(FieldError, match=r"1\.\.8"):
        sae_top_k_of(cfg_with(2), {"top_k": 9})


# --------------------------------------------------------------------------
# The front-end tracker


def test_tracker_inline_features_cut_and_delta():
    from vllm.v1.engine import CapturedRows, HiddenStatesSpec
    from vllm_hidden_states.frontend.dispatcher import HiddenStatesTracker

    spec = HiddenStatesSpec([], [], "all", inline=True, sae_top_k=2, sae_layer=3)
    t = HiddenStatesTracker(spec, None, 0)

    def feats(rows):
        ids = torch.arange(rows * 2, dtype=torch.int32).reshape(rows, 2)
        return CapturedRows(sae_ids=ids, sae_values=torch.ones(rows, 2))

    t.receive(feats(4))
    first = t.output_fields(False, True)
    assert first["hidden_states"] is None  # features only: no hidden states
    assert first["sae_features"]["layer"] == 3 and first["sae_features"]["ids"].shape == (4, 2)
    t.receive(feats(2))
    # a stop string trimmed the sequence to 5 tokens: 4 inline rows + the final one
    t.finish(feats(1), 5)
    assert t.error is None and t.complete.sae_ids.shape == (5, 2)
    last = t.output_fields(True, True)["sae_features"]
    assert last["ids"].shape == (1, 2)
    assert HiddenStatesTracker(spec, None, 0).output_fields(False, True)["sae_features"] is None


def test_tracker_of_a_request_without_sae_features_gives_none():
    from vllm.v1.engine import CapturedRows, HiddenStatesSpec
    from vllm_hidden_states.frontend.dispatcher import HiddenStatesTracker

    t = HiddenStatesTracker(HiddenStatesSpec([-1], [4], "last"), None, 0)
    t.finish(CapturedRows(hidden=torch.zeros(1, 1, 8)), 3)
    fields = t.output_fields(True, False)
    assert fields["sae_features"] is None and fields["hidden_states"][-1].shape == (1, 8)
