# SPDX-License-Identifier: Apache-2.0
"""vllm_hidden_states.config: layer convention, resolve(), the CLI flags."""

import logging
from types import SimpleNamespace

import pytest

from vllm_hidden_states.engine_args import (
    add_cli_args,
    additional_config_entry,
    join_layers_value,
    parse_layers_arg,
)
from vllm_hidden_states.hidden_states_config import (
    ADDITIONAL_CONFIG_KEY,
    CAPTURE_VERSION,
    DEFAULT_BUFFER_MIB,
    DEFAULT_MAX_ROWS,
    HiddenStatesConfig,
    built_once,
)

L = 36  # Qwen3-4B's num_hidden_layers


def every_layer(num_layers: int = L) -> HiddenStatesConfig:
    return HiddenStatesConfig(
        num_layers=num_layers, layers=tuple(range(num_layers + 1)), given=None
    )


def restricted() -> HiddenStatesConfig:
    """Capturable 0, 2, -2, -1 as an operator would write them."""
    return HiddenStatesConfig(
        num_layers=L,
        layers=(0, 2, L - 1, L),
        given=(0, 2, -2, -1),
        architecture="Qwen3ForCausalLM",
    )


class _FakeVllmConfig(SimpleNamespace):
    """A stand-in that, like ``VllmConfig``, takes weak references."""


def fake_vllm_config(
    entry,
    num_layers: int = L,
    max_num_batched_tokens: int = 8192,
    hidden_size: int = 2560,
    dtype=None,
    architecture: str = "Qwen3ForCausalLM",
):
    """Just the attributes ``HiddenStatesConfig.from_vllm_config`` reads
    (default: Qwen3-4B's shape in bf16)."""
    import torch

    extra = None if entry is None else {ADDITIONAL_CONFIG_KEY: entry}
    text_config = SimpleNamespace(num_hidden_layers=num_layers)
    return _FakeVllmConfig(
        additional_config=extra,
        model_config=SimpleNamespace(
            architectures=[architecture],
            hf_text_config=text_config,
            get_hidden_size=lambda: hidden_size,
            dtype=dtype or torch.bfloat16,
        ),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_num_batched_tokens),
    )


# --------------------------------------------------------------------------
# resolve(): the layer convention


@pytest.mark.parametrize("layer", [0, 1, 17, L - 1, L])
def test_resolve_returns_non_negative_indices_unchanged(layer):
    assert every_layer().resolve(layer) == layer


@pytest.mark.parametrize("k", range(-1, -(L + 2), -1))
def test_resolve_maps_negative_index_k_to_L_plus_1_plus_k(k):
    assert every_layer().resolve(k) == L + 1 + k


def test_resolve_minus_one_is_the_final_post_norm_layer_L():
    assert every_layer().resolve(-1) == L


def test_resolve_minus_two_is_the_residual_stream_entering_the_last_layer():
    assert every_layer().resolve(-2) == L - 1


def test_resolve_lowest_negative_index_is_the_embedding_output():
    assert every_layer().resolve(-(L + 1)) == 0


def test_resolve_out_of_range_names_the_layer_model_size_and_valid_range():
    with pytest.raises(ValueError) as e:
        every_layer().resolve(40)
    assert "layer 40 is out of range for a 36-layer model; valid indices are -37..36" in str(
        e.value
    )


@pytest.mark.parametrize("layer", [L + 1, -(L + 2), 10**9, -(10**9)])
def test_resolve_rejects_every_index_outside_minus_L_plus_1_to_L(layer):
    with pytest.raises(ValueError, match=f"layer {layer} is out of range"):
        every_layer().resolve(layer)


def test_resolve_out_of_range_on_a_full_engine_says_every_layer_is_capturable():
    with pytest.raises(ValueError, match=r"capturable layers: all \(-37\.\.36\)"):
        every_layer().resolve(37)


def test_resolve_out_of_range_names_the_capturable_set_as_configured():
    with pytest.raises(ValueError, match="capturable layers: 0, 2, -2, -1"):
        restricted().resolve(-38)


def test_resolve_not_capturable_names_the_capturable_set_as_configured():
    with pytest.raises(ValueError) as e:
        restricted().resolve(5)
    message = str(e.value)
    assert "layer 5 is not capturable on this engine" in message
    assert "capturable layers: 0, 2, -2, -1" in message


def test_resolve_not_capturable_negative_index_is_reported_as_requested():
    with pytest.raises(ValueError, match="layer -3 is not capturable"):
        restricted().resolve(-3)


@pytest.mark.parametrize(
    "layer, absolute", [(0, 0), (2, 2), (-2, L - 1), (-1, L), (L, L), (L - 1, L - 1)]
)
def test_resolve_accepts_capturable_layers_in_either_spelling(layer, absolute):
    assert restricted().resolve(layer) == absolute


@pytest.mark.parametrize("layer", [True, False])
def test_resolve_rejects_booleans(layer):
    with pytest.raises(ValueError, match="entries must be integers"):
        every_layer().resolve(layer)


@pytest.mark.parametrize("layer", [1.0, -1.5, "1", "-1", None, [1]])
def test_resolve_rejects_non_integers(layer):
    with pytest.raises(ValueError, match="entries must be integers"):
        every_layer().resolve(layer)


# --------------------------------------------------------------------------
# inner_layers / describe_capturable


def test_inner_layers_excludes_the_final_layer_L():
    assert restricted().inner_layers == (0, 2, L - 1)


def test_inner_layers_of_a_full_engine_is_0_to_L_minus_1():
    assert every_layer().inner_layers == tuple(range(L))


def test_inner_layers_is_empty_when_only_the_final_layer_is_capturable():
    cfg = HiddenStatesConfig(num_layers=L, layers=(L,), given=(-1,))
    assert cfg.inner_layers == ()


def test_describe_capturable_of_a_full_engine_gives_the_index_range():
    assert every_layer(4).describe_capturable() == "all (-5..4)"


# --------------------------------------------------------------------------
# from_vllm_config (with a stand-in VllmConfig)


def test_from_vllm_config_is_none_when_hidden_states_are_not_enabled():
    assert HiddenStatesConfig.from_vllm_config(fake_vllm_config(None)) is None


def test_from_vllm_config_without_layers_makes_every_layer_capturable():
    cfg = HiddenStatesConfig.from_vllm_config(fake_vllm_config({"layers": None}))
    assert cfg.layers == every_layer().layers and cfg.given is None


def test_from_vllm_config_stores_sorted_distinct_absolute_layers_and_the_given_spelling():
    entry = {"layers": [-1, 2, -2, 0, 36]}
    cfg = HiddenStatesConfig.from_vllm_config(fake_vllm_config(entry))
    assert cfg.num_layers == L
    assert cfg.layers == (0, 2, L - 1, L)
    assert cfg.given == (-1, 2, -2, 0, 36)


def test_from_vllm_config_rejects_an_out_of_range_layer_with_the_valid_range():
    entry = {"layers": [-1, 99]}
    expected = r"entry 99 is out of range for a 36-layer model; valid indices are -37\.\.36"
    with pytest.raises(ValueError, match=expected):
        HiddenStatesConfig.from_vllm_config(fake_vllm_config(entry))


def test_built_once_builds_an_engine_config_once_per_vllm_config():
    vllm_config = fake_vllm_config({"layers": [-1]})
    first = built_once(HiddenStatesConfig, vllm_config)
    assert first == HiddenStatesConfig.from_vllm_config(vllm_config)
    assert built_once(HiddenStatesConfig, vllm_config) is first
    other = fake_vllm_config({"layers": [0]})
    assert built_once(HiddenStatesConfig, other).layers == (0,)


def test_built_once_forgets_a_vllm_config_that_is_gone():
    import gc

    from vllm_hidden_states import hidden_states_config as config_module

    vllm_config = fake_vllm_config({"layers": [-1]})
    built_once(HiddenStatesConfig, vllm_config)
    key = (id(vllm_config), HiddenStatesConfig)
    assert key in config_module._BUILT
    del vllm_config
    gc.collect()
    assert key not in config_module._BUILT


# --------------------------------------------------------------------------
# parse_layers_arg


def test_parse_layers_arg_reads_comma_separated_integers_in_order():
    assert parse_layers_arg("-1,-2,16") == [-1, -2, 16]


def test_parse_layers_arg_ignores_spaces():
    assert parse_layers_arg(" -1, -2 , 16 ") == [-1, -2, 16]


def test_parse_layers_arg_all_means_every_layer():
    assert parse_layers_arg("all") is None


def test_parse_layers_arg_empty_string_means_every_layer():
    assert parse_layers_arg("") is None


def test_parse_layers_arg_none_means_every_layer():
    assert parse_layers_arg(None) is None


def test_parse_layers_arg_accepts_a_list():
    assert parse_layers_arg([-1, 2]) == [-1, 2]


def test_parse_layers_arg_accepts_a_tuple_and_returns_a_list():
    assert parse_layers_arg((3, -1)) == [3, -1]


@pytest.mark.parametrize("garbage", ["abc", "1,x", "1.5", "-1;-2", "ALL", "1,,two"])
def test_parse_layers_arg_rejects_garbage_naming_the_flag(garbage):
    with pytest.raises(ValueError) as e:
        parse_layers_arg(garbage)
    assert "--hidden-states-layers" in str(e.value)
    assert repr(garbage) in str(e.value)


# --------------------------------------------------------------------------
# join_layers_value


def test_join_layers_value_joins_a_dash_leading_value_into_the_flag():
    assert join_layers_value(["--hidden-states-layers", "-1,-2"]) == [
        "--hidden-states-layers=-1,-2"
    ]


def test_join_layers_value_leaves_the_other_args_untouched_and_in_order():
    args = [
        "serve",
        "m",
        "--port",
        "8000",
        "--hidden-states-layers",
        "-1,-2",
        "--enable-hidden-states",
    ]
    assert join_layers_value(args) == [
        "serve",
        "m",
        "--port",
        "8000",
        "--hidden-states-layers=-1,-2",
        "--enable-hidden-states",
    ]


def test_join_layers_value_leaves_a_value_not_starting_with_dash_separate():
    args = ["--hidden-states-layers", "16,2"]
    assert join_layers_value(args) == ["--hidden-states-layers", "16,2"]


def test_join_layers_value_leaves_the_equals_spelling_untouched():
    args = ["--hidden-states-layers=-1,-2", "--port", "1"]
    assert join_layers_value(args) == args


def test_join_layers_value_leaves_a_trailing_flag_without_value_untouched():
    args = ["--enable-hidden-states", "--hidden-states-layers"]
    assert join_layers_value(args) == args


def test_join_layers_value_does_not_modify_its_input():
    args = ["--hidden-states-layers", "-1"]
    join_layers_value(args)
    assert args == ["--hidden-states-layers", "-1"]


# --------------------------------------------------------------------------
# add_cli_args on vLLM's own parser (patch 0005 joins the layers value)


def parser_with_flags():
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    parser.add_argument("--port", type=int, default=8000)
    add_cli_args(parser)
    return parser


def test_add_cli_args_defaults_are_disabled_and_every_layer():
    ns = parser_with_flags().parse_args([])
    assert ns.enable_hidden_states is False
    assert ns.hidden_states_layers is None


def test_add_cli_args_parses_the_natural_dash_leading_spelling_to_the_raw_string():
    ns = parser_with_flags().parse_args(
        ["--enable-hidden-states", "--hidden-states-layers", "-1,-2,16"]
    )
    assert ns.enable_hidden_states is True
    assert ns.hidden_states_layers == "-1,-2,16"


def test_add_cli_args_keeps_the_parsers_other_options_working():
    ns = parser_with_flags().parse_args(["--hidden-states-layers", "-2", "--port", "9000"])
    assert ns.hidden_states_layers == "-2"
    assert ns.port == 9000


def test_add_cli_args_joins_sys_argv_when_no_args_are_given(monkeypatch):
    monkeypatch.setattr("sys.argv", ["prog", "--hidden-states-layers", "-1,-2,16"])
    assert parser_with_flags().parse_args().hidden_states_layers == "-1,-2,16"


def test_add_cli_args_leaves_the_parsers_methods_alone():
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = parser_with_flags()
    assert "parse_known_args" not in vars(parser)
    assert type(parser).parse_args is FlexibleArgumentParser.parse_args


def test_add_cli_args_value_feeds_parse_layers_arg():
    ns = parser_with_flags().parse_args(["--hidden-states-layers", "-1,-2,16"])
    assert parse_layers_arg(ns.hidden_states_layers) == [-1, -2, 16]


# --------------------------------------------------------------------------
# capture buffers: max_rows and memory


def test_max_rows_default_is_the_rows_that_fit_the_buffer_budget():
    # Qwen3-4B bf16, every layer capturable: 36 buffers x 2560 x 2 bytes a row.
    cfg = HiddenStatesConfig.from_vllm_config(fake_vllm_config({"layers": None}))
    assert cfg.max_rows == DEFAULT_BUFFER_MIB * 2**20 // (36 * 2560 * 2) == 1456


def test_max_rows_default_covers_a_whole_step_when_few_layers_are_capturable():
    cfg = HiddenStatesConfig.from_vllm_config(fake_vllm_config({"layers": [-2, -1]}))
    assert cfg.max_rows == 8192  # max_num_batched_tokens: a prefill is never split


def test_max_rows_default_is_never_below_512_rows():
    vllm_config = fake_vllm_config({"layers": None}, num_layers=80, hidden_size=8192)
    assert HiddenStatesConfig.from_vllm_config(vllm_config).max_rows == DEFAULT_MAX_ROWS == 512


def test_max_rows_default_with_only_the_final_layer_is_the_step_budget():
    cfg = HiddenStatesConfig.from_vllm_config(fake_vllm_config({"layers": [-1]}))
    assert cfg.max_rows == 8192


def test_max_rows_default_never_exceeds_the_step_token_budget():
    vllm_config = fake_vllm_config({"layers": None}, max_num_batched_tokens=64)
    assert HiddenStatesConfig.from_vllm_config(vllm_config).max_rows == 64


def test_max_rows_given_is_kept():
    vllm_config = fake_vllm_config({"layers": None, "max_rows": 16})
    assert HiddenStatesConfig.from_vllm_config(vllm_config).max_rows == 16


def test_buffer_bytes_is_one_max_rows_by_hidden_buffer_per_inner_layer():
    # Qwen3-4B: 36 layers, hidden 2560, bf16, every layer capturable.
    cfg = HiddenStatesConfig(num_layers=36, layers=tuple(range(37)), max_rows=512)
    assert cfg.buffer_bytes(hidden_size=2560, dtype_bytes=2) == 36 * 512 * 2560 * 2


def test_additional_config_entry_keys_the_compile_cache_with_layers_points_rows_and_version():
    entry = additional_config_entry("-1,-2", 128, points="attn_out, mlp_out.3")
    assert entry == {
        "layers": [-1, -2],
        "points": ["attn_out", "mlp_out.3"],
        "max_rows": 128,
        "capture": CAPTURE_VERSION,
    }


@pytest.mark.parametrize("bad", [0, -3, True])
def test_additional_config_entry_refuses_a_non_positive_max_rows(bad):
    with pytest.raises(ValueError, match="--hidden-states-max-rows must be a positive"):
        additional_config_entry(None, bad)


# -- async scheduling ---------------------------------------------------------


@pytest.mark.parametrize("requested", [None, True, False])
def test_async_scheduling_is_left_to_vllm(monkeypatch, requested):
    from vllm_hidden_states.engine_args import ASYNC_SCHEDULING_ENV, async_scheduling_for

    monkeypatch.delenv(ASYNC_SCHEDULING_ENV, raising=False)
    assert async_scheduling_for(requested) is requested


@pytest.mark.parametrize("requested", [None, False])
def test_opting_out_of_async_scheduling_switches_it_off_with_one_log_line(
    monkeypatch, caplog, requested
):
    from vllm_hidden_states.engine_args import ASYNC_SCHEDULING_ENV, async_scheduling_for

    monkeypatch.setenv(ASYNC_SCHEDULING_ENV, "0")
    with caplog.at_level(logging.INFO, logger="vllm_hidden_states"):
        assert async_scheduling_for(requested) is False
    lines = [r.getMessage() for r in caplog.records if "async scheduling off" in r.getMessage()]
    assert len(lines) == 1 and ASYNC_SCHEDULING_ENV in lines[0], lines


def test_opting_out_beside_an_explicit_async_scheduling_is_refused_naming_both(monkeypatch):
    from vllm_hidden_states.engine_args import ASYNC_SCHEDULING_ENV, async_scheduling_for

    monkeypatch.setenv(ASYNC_SCHEDULING_ENV, "0")
    with pytest.raises(ValueError, match="--async-scheduling contradicts") as e:
        async_scheduling_for(True)
    assert f"{ASYNC_SCHEDULING_ENV}=0" in str(e.value)


def test_resolve_all_returns_absolute_indices_in_request_order():
    assert every_layer(4).resolve_all([-1, 0, 2]) == [4, 0, 2]


def test_resolve_all_refuses_a_layer_named_twice_in_either_spelling():
    with pytest.raises(
        ValueError,
        match=r"hidden_states_layers names layer 4 twice "
        r"\(-1 and 4\); name each layer once",
    ):
        every_layer(4).resolve_all([-1, 4])
