# SPDX-License-Identifier: Apache-2.0
"""Every layer and every capture point, every position, on every supported
architecture.

One tiny random-weight model per architecture
(:func:`vllm_hidden_states.tools.tiny_models.build_tiny_model`), each on an
engine with every layer and every point capturable (``hidden_states_points=
"all"``) and steerable (``steering_points="all"``), compared with HF
transformers on the same token ids: the states of the last token and of every
position at every layer ``0..L`` (``output_hidden_states``), and every point of
every layer (forward hooks on HF's own modules, :meth:`HFReference.points`).
The points also satisfy the residual identities among themselves. Steering
(``add`` at every layer, ``add`` and ``ablate`` at every kind of point) is
compared with HF forward hooks that apply the same intervention
(:meth:`HFReference.steered_states`). A representative subset also runs
torch.compile'd.

Engines are expensive on a 2-core CPU, so tests are grouped by architecture
(the module-scoped ``arch`` fixture makes pytest run both tests of one
architecture back to back) and :func:`engine_for` keeps only the current
architecture's engine alive, shutting the previous one down first. Engines run
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, seconds to start instead of
half a minute for two spawned processes), except on vLLM's Transformers
backend (OLMo 2 in vLLM 0.32): it decorates the HF model classes in place for
torch.compile, after which HF transformers cannot run them in this process, so
those engines run in their own processes (which also covers the ZMQ path).
"""

import gc
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm_hidden_states.layers import ModelLayers
from vllm_hidden_states.points import POINT_KINDS
from vllm_hidden_states.steering_config import STEERABLE_KINDS
from vllm_hidden_states.tools.tiny_models import CORE_ARCHS, SHORT_WINDOW, build_tiny_model
from vllm_hidden_states.tools.tiny_vlms import VLM_ARCHS, build_tiny_vlm

from .conftest import (
    COMMON_ENGINE_ARGS,
    MODELS,
    REL_TOL,
    HFReference,
    assert_close,
    decoder_layers_of,
    env_set,
    in_process_engine,
    point_sites,
    shut_down_in_process,
    token_ids_of,
)

# Compiled (torch.compile, the default off eager) for one of each reader and
# every hybrid.
COMPILED_ARCHS = (
    "llama",
    "gemma2",
    "olmo2",
    "qwen3_moe",
    "granitemoehybrid",
    "nemotron_h",
    "falcon_h1",
)

# Compiled with Inductor (C++ code generated and built: about a minute per
# family on 2 cores): one reader and one hybrid. The other compiled families,
# here and in test_families_*.py, are traced by Dynamo and run on its eager
# backend (vLLM's own CPU CI setting, VLLM_CPU_CI_ENV=1): the same graph
# capture, custom ops in the graph and dynamic shapes, without Inductor's
# lowering of them, which these two and conftest's ``llm_compiled`` cover.
INDUCTOR_ARCHS = ("llama", "nemotron_h")

# ~20 tokens: longer than the Gemma models' 8-token sliding window.
PROMPT = "Once upon a time there was a small robot who loved to count"
MAX_TOKENS = 4

ENGINE_ARGS = dict(COMMON_ENGINE_ARGS, max_num_seqs=8, max_model_len=512)
# Where vLLM runs a family by another convention than HF's code: the HF
# reference runs it by vLLM's (test_families_dense.py shows the difference).
# Cohere's sliding layers see the window's keys plus the query's own (vLLM
# passes sliding_window + 1, "the training convention"; HF's mask one fewer).
REFERENCE_CONFIG = {
    "cohere2": dict(sliding_window=SHORT_WINDOW + 1),
    "cohere2_moe": dict(sliding_window=SHORT_WINDOW + 1),
}

# Modules vLLM holds in bfloat16 whatever the model's dtype, by the suffix of
# their name: the HF reference holds them in bfloat16 too (cast after
# loading), so it computes what vLLM does. Apertus: vLLM's XIELU keeps
# alpha_p, alpha_n, beta and eps in bfloat16 (activation.py; HF's own
# XIELUActivation's default dtype, which its float32 load casts away), and
# softplus(alpha) is computed and rounded there: HF's float32 xIELU is 8e-4
# relative off vLLM at the final state.
REFERENCE_BFLOAT16 = {"apertus": ".act_fn"}

# vLLM picks its AMX MLA backend on CPUs with AMX (Intel Xeon since
# Sapphire Rapids), which takes bfloat16 weights only; its portable one runs
# float32: every MLA family names it, whatever the machine.
ARCH_ENGINE_ARGS = {
    "deepseek_v2": dict(attention_backend="CPU_MLA"),
    "deepseek_v3": dict(attention_backend="CPU_MLA"),
    "axk1": dict(attention_backend="CPU_MLA"),
    "glm4_moe_lite": dict(attention_backend="CPU_MLA"),
    "sarvam_mla": dict(attention_backend="CPU_MLA"),
    "mistral_large_3": dict(attention_backend="CPU_MLA"),
    # Nemotron-NAS's config class is remote code (the tiny model carries it).
    "decilm": dict(trust_remote_code=True),
    # vLLM's Mamba2 mixer fails prefilling a pure Mamba2 model with prefix
    # caching on (an IndexError in mamba_mixer2.py, plain vLLM too): off.
    "mamba2": dict(enable_prefix_caching=False),
}


class _Current:
    """The one live engine: its key ``(arch, compiled)``, the engine and the
    HF reference, or the error it failed to start with."""

    key: tuple[str, bool] | None = None
    engine: LLM | None = None
    reference: HFReference | None = None
    error: str | None = None


def _shutdown() -> None:
    if _Current.engine is not None:
        shut_down_in_process(_Current.engine)
    _Current.key = _Current.engine = _Current.reference = _Current.error = None
    gc.collect()


def on_transformers_backend(model_dir: Path) -> bool:
    """Whether vLLM runs this model on its Transformers backend."""
    from vllm import ModelRegistry

    arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    model = ModelRegistry.models.get(arch)  # unregistered: the Transformers backend
    return model is None or getattr(model, "module_name", "").endswith(".transformers")


def engine_for(arch: str, compiled: bool = False) -> tuple[LLM, HFReference]:
    """The engine (every layer capturable) and HF reference of ``arch``.

    Starting another architecture's engine shuts the previous one down first,
    so at most one is alive. An engine that failed to start is not retried by
    the next test of the same architecture; that test fails with the error.
    """
    key = (arch, compiled)
    if _Current.key != key:
        _shutdown()
        _Current.key = key
        model_dir = (
            build_tiny_vlm(MODELS / f"tiny-{arch}", arch=arch)
            if arch in VLM_ARCHS
            else build_tiny_model(MODELS / f"tiny-{arch}", arch=arch)
        )
        _Current.reference = HFReference(model_dir)
        for key, value in REFERENCE_CONFIG.get(arch, {}).items():
            setattr(_Current.reference.model.config, key, value)
        if arch in REFERENCE_BFLOAT16:
            for name, module in _Current.reference.model.named_modules():
                if name.endswith(REFERENCE_BFLOAT16[arch]):
                    module.to(torch.bfloat16)
        # The textbook attention: SDPA drops Gemma 2's logit soft-capping.
        _Current.reference.model.set_attn_implementation("eager")
        # vLLM's Transformers backend decorates HF's classes in place: its
        # engines run in their own process (see the module docstring).
        place = (
            env_set("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
            if on_transformers_backend(model_dir)
            else in_process_engine()
        )
        dynamo_only = compiled and arch not in INDUCTOR_ARCHS
        try:
            with place, env_set("VLLM_CPU_CI_ENV", "1" if dynamo_only else "0"):
                _Current.engine = LLM(
                    model=str(model_dir),
                    enable_hidden_states=True,
                    hidden_states_points="all",
                    # Every steerable point of every layer: its hooks are in
                    # every test's graph, steered or not.
                    enable_steering=True,
                    steering_points="all",
                    enforce_eager=not compiled,
                    **{**ENGINE_ARGS, **ARCH_ENGINE_ARGS.get(arch, {})},
                )
        except Exception as e:
            _Current.error = f"{type(e).__name__}: {e}"
            raise
        finally:
            # A spawned engine freezes vLLM's env reads (envs cache) too.
            import vllm.envs as envs

            envs.disable_envs_cache()
    if _Current.error is not None:
        pytest.fail(f"the {arch} engine failed to start: {_Current.error}")
    return _Current.engine, _Current.reference


@pytest.fixture(scope="module", autouse=True)
def _last_engine_is_shut_down():
    yield
    _shutdown()


@pytest.fixture(scope="module", params=CORE_ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=COMPILED_ARCHS)
def compiled_arch(request) -> str:
    return request.param


def every_layer(hf: HFReference, positions: str) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        return_hidden_states=True,
        hidden_states_layers=list(range(hf.num_layers + 1)),
        hidden_states_positions=positions,
    )


def assert_every_layer_matches_hf(out, hf: HFReference, positions: str, what: str):
    ids = token_ids_of(out)
    reference = hf.states(ids)
    states = out.outputs[0].hidden_states
    assert list(states) == list(range(hf.num_layers + 1)), what
    for layer, tensor in states.items():
        expected = reference[layer] if positions == "all" else reference[layer][-1:]
        assert tensor.dtype == torch.float32, (what, layer, tensor.dtype)
        rows = len(ids) if positions == "all" else 1
        assert tensor.shape == (rows, hf.hidden_size), (what, layer, tensor.shape)
        assert_close(tensor, expected, f"{what} {positions} layer {layer}")


def test_every_layer_of_the_last_token_matches_hf(arch):
    llm, hf = engine_for(arch)
    (out,) = llm.generate([PROMPT], every_layer(hf, "last"), use_tqdm=False)
    assert_every_layer_matches_hf(out, hf, "last", arch)


def test_every_layer_of_every_position_matches_hf(arch):
    llm, hf = engine_for(arch)
    (out,) = llm.generate([PROMPT], every_layer(hf, "all"), use_tqdm=False)
    assert_every_layer_matches_hf(out, hf, "all", arch)


# A point whose meaning does not fit the layer, per hybrid family: (its
# architecture, the point, the layer class, the points that layer has).
MISFIT_POINTS = [
    # Nemotron-H: one block per layer (norm, mixer, add): no resid_mid.
    (
        "nemotron_h",
        "resid_mid.1",
        "NemotronHAttentionDecoderLayer",
        "resid_pre, attn_out, resid_post, attn_pattern, attn_z",
    ),
    # Falcon-H1: attention and Mamba2 side by side: no one block's attn_out.
    (
        "falcon_h1",
        "attn_out.1",
        "FalconH1ParallelHybrid",
        "resid_pre, resid_mid, mlp_out, resid_post, attn_pattern, mlp_post, attn_z",
    ),
]


# Tests of a subset of the families take ``arch`` indirectly: pytest then runs
# them with the family's other tests, on its one engine (engine_for).
@pytest.mark.parametrize(
    ("arch", "point", "layer_class", "points"), MISFIT_POINTS, indirect=["arch"], scope="module"
)
def test_a_point_that_does_not_fit_a_hybrid_layer_is_refused_per_request(
    arch, point, layer_class, points
):
    """Refused to capture and to steer, each naming the layer class and the
    points it has (the message at start is tested in
    tests/unit/test_layer_classes.py)."""
    llm, hf = engine_for(arch)
    capture = SamplingParams(max_tokens=1, return_hidden_states=True, hidden_states_points=[point])
    kind, layer = point.split(".")
    why = rf"{point}: decoder layer {layer} \({layer_class}\).*its points: {points}"
    with pytest.raises(VLLMValidationError, match=why):
        llm.generate([PROMPT], capture, use_tqdm=False)
    steer = steered(hf, [{"point": point, "vector": random_vector(hf, 0)}])
    with pytest.raises(VLLMValidationError, match=why):
        llm.generate([PROMPT], steer, use_tqdm=False)


@pytest.mark.parametrize("arch", ["granitemoehybrid"], indirect=True, scope="module")
def test_attn_z_at_a_mamba_layer_is_refused_per_request_and_never_steered(arch):
    """The heads' outputs (attn_z) exist only where the mixer is attention:
    at a Mamba2 layer the request is refused naming the layer class, its
    points and the layers with attn_z, ablate_heads there too; add at
    attn_z is refused at an attention layer (only patch and ablate_heads
    write the heads' outputs)."""
    llm, hf = engine_for(arch)
    model = layers_of(hf)
    attention = [i for i in range(hf.num_layers) if "attn_z" in model.kinds_at(i)]
    mamba = next(i for i in range(hf.num_layers) if i not in attention)
    capture = SamplingParams(
        max_tokens=1, return_hidden_states=True, hidden_states_points=[f"attn_z.{mamba}"]
    )
    why = (
        rf"attn_z.{mamba}: decoder layer {mamba} \(GraniteMoeHybridMambaDecoderLayer\).*"
        rf"its points: .*layers with attn_z: \[{', '.join(map(str, attention))}\]"
    )
    with pytest.raises(VLLMValidationError, match=why):
        llm.generate([PROMPT], capture, use_tqdm=False)
    ablate = SamplingParams(
        max_tokens=1, steering=[{"point": f"attn_z.{mamba}", "op": "ablate_heads", "heads": [0]}]
    )
    with pytest.raises(VLLMValidationError, match=why):
        llm.generate([PROMPT], ablate, use_tqdm=False)
    steer = steered(hf, [{"point": f"attn_z.{attention[0]}", "vector": random_vector(hf, 0)}])
    with pytest.raises(VLLMValidationError, match="attn_z cannot be steered"):
        llm.generate([PROMPT], steer, use_tqdm=False)


# Hybrids keep Mamba state per request: a prompt prefilled in chunks carries
# it from chunk to chunk, and the "last" extract of a finished request (a
# prefill of its tokens after sampling) must recompute it, not read the
# request's final state nor another request's.
# (Mamba2 and Zamba2: the sweep's families, test_families_sweep_remote_d.py.)
HYBRID_ARCHS = ("granitemoehybrid", "nemotron_h", "falcon_h1", "mamba2", "zamba2")


@pytest.mark.parametrize("arch", HYBRID_ARCHS, indirect=True)
def test_a_hybrid_over_a_chunked_prefill_matches_hf_at_every_layer(arch):
    """ "all" over a prompt longer than the 64-token budget (its prefill runs
    in chunks), then "last" of the same prompt again (its prefix cached where
    vLLM caches hybrids), each against HF."""
    llm, hf = engine_for(arch)
    for positions in ("all", "last"):
        params = every_layer(hf, positions)
        params.ignore_eos = True
        (out,) = llm.generate([LONG_PROMPT], params, use_tqdm=False)
        assert len(out.prompt_token_ids) > COMMON_ENGINE_ARGS["max_num_batched_tokens"]
        assert_every_layer_matches_hf(out, hf, positions, f"{arch} chunked")


@pytest.mark.parametrize("arch", HYBRID_ARCHS, indirect=True)
def test_last_extracts_of_a_batch_of_hybrid_requests_match_hf(arch):
    """Requests of different lengths and outputs, batched: each one's "last"
    extract runs after it finished, beside the others' decodes and
    extracts, and matches HF on its own tokens."""
    llm, hf = engine_for(arch)
    prompts = [PROMPT, LONG_PROMPT, "Hello world!", PROMPT + " and then"]
    params = []
    for j in range(len(prompts)):
        p = every_layer(hf, "last")
        p.max_tokens = MAX_TOKENS + 3 * j
        p.ignore_eos = True
        params.append(p)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for j, out in enumerate(outs):
        assert len(out.outputs[0].token_ids) == MAX_TOKENS + 3 * j
        assert_every_layer_matches_hf(out, hf, "last", f"{arch} batch {j}")


def test_compiled_engine_matches_hf_at_every_layer(compiled_arch):
    llm, hf = engine_for(compiled_arch, compiled=True)
    outs = llm.generate(
        [PROMPT, PROMPT], [every_layer(hf, "last"), every_layer(hf, "all")], use_tqdm=False
    )
    for out, positions in zip(outs, ("last", "all")):
        assert_every_layer_matches_hf(out, hf, positions, f"compiled {compiled_arch}")


# --------------------------------------------------------------------------
# Capture points beyond the residual stream


def layers_of(hf: HFReference) -> ModelLayers:
    """The package's view of the model's decoder layers (their classes, as
    vLLM will load them), from its HF config."""
    config = SimpleNamespace(
        architectures=hf.model.config.architectures,
        hf_text_config=hf.model.config.get_text_config(),
    )
    return ModelLayers.of(config, hf.num_layers)


def every_point(hf: HFReference) -> list[str]:
    """Every row point of every layer that has it (attention patterns have
    their own tests: test_patterns.py), both address forms (SAELens' for odd
    layers). MoE models have no mlp_post."""
    model = layers_of(hf)
    return [
        f"blocks.{i}.hook_{kind}" if i % 2 else f"{kind}.{i}"
        for kind in POINT_KINDS
        if kind != "attn_pattern"
        for i in range(hf.num_layers)
        if kind in model.kinds_at(i)
    ]


# Why a model without pattern layers refuses them: OLMo 2 runs on vLLM's
# Transformers backend (no vLLM attention module), DeepSeek attends with MLA,
# Bloom with ALiBi biases a pattern of queries and keys leaves out; Falcon's
# has no HF reference (HF's eager Falcon attention is not causal).
# A model without attention (Mamba2) refuses them at every layer: not attention.
NO_PATTERN = (
    "Transformers backend|multi-head latent attention|ALiBi|attention pattern is not verified"
    "|it is not attention"
)


def pattern_layers(hf: HFReference) -> list[int]:
    """Decoder layers with vLLM's attention module (Granite 4.0-H: its
    attention layers, not its Mamba ones; OLMo 2: none)."""
    model = layers_of(hf)
    return [i for i in range(hf.num_layers) if "attn_pattern" in model.kinds_at(i)]


def _kind_layer(address: str) -> str:
    """``blocks.3.hook_attn_out`` -> ``attn_out.3`` (the reference's keys)."""
    if address.startswith("blocks."):
        _, layer, hook = address.split(".")
        return f"{hook.removeprefix('hook_')}.{layer}"
    return address


def points_of(llm: LLM, hf: HFReference, positions: str) -> tuple[dict, list[int]]:
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        return_hidden_states=True,
        hidden_states_points=every_point(hf),
        hidden_states_positions=positions,
    )
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    return out.outputs[0].hidden_states, token_ids_of(out)


def assert_every_point_matches_hf(states, ids, hf: HFReference, positions: str, what: str):
    reference = hf.points(ids)
    assert list(states) == every_point(hf), what
    for address, tensor in states.items():
        expected = reference[_kind_layer(address)]
        expected = expected if positions == "all" else expected[-1:]
        assert tensor.dtype == torch.float32, (what, address, tensor.dtype)
        assert_close(tensor, expected, f"{what} {positions} {address}")


def test_every_point_of_the_last_token_matches_hf(arch):
    llm, hf = engine_for(arch)
    states, ids = points_of(llm, hf, "last")
    assert_every_point_matches_hf(states, ids, hf, "last", arch)


def test_every_point_of_every_position_matches_hf(arch):
    llm, hf = engine_for(arch)
    states, ids = points_of(llm, hf, "all")
    assert_every_point_matches_hf(states, ids, hf, "all", arch)


def test_points_satisfy_the_residual_identities(arch):
    """resid_mid = resid_pre + attn_out (where there is one attn_out: not
    Falcon-H1's), resid_post = resid_mid + mlp_out (a single-block layer,
    Nemotron-H's: resid_post = resid_pre + its block's attn_out or mlp_out;
    Cohere's side-by-side blocks: resid_post = resid_pre + attn_out + mlp_out;
    Gemma 4 adds its per-layer input and scales after the MLP's add),
    resid_post.i = resid_pre.(i+1) = HF layer i+1 below the last layer."""
    llm, hf = engine_for(arch)
    states, ids = points_of(llm, hf, "all")
    by_name = {_kind_layer(a): t for a, t in states.items()}
    layers = hf.states(ids)
    model = layers_of(hf)
    hf_layers = decoder_layers_of(hf.model)
    for i in range(hf.num_layers):
        pre, post = by_name[f"resid_pre.{i}"], by_name[f"resid_post.{i}"]
        if "resid_mid" in model.kinds_at(i):
            mid = by_name[f"resid_mid.{i}"]
            if "attn_out" in model.kinds_at(i):  # not Falcon-H1's two mixers side by side
                assert_close(pre + by_name[f"attn_out.{i}"], mid, f"{arch} resid_mid.{i}")
            # Gemma 4: + PLE, x scalar; Granite MoE shared: no one mlp_out
            if "mlp_out" in model.kinds_at(i) and not hasattr(hf_layers[i], "per_layer_input_gate"):
                assert_close(mid + by_name[f"mlp_out.{i}"], post, f"{arch} resid_post.{i}")
        else:  # one block (Nemotron-H), or two side by side (Cohere)
            blocks = [
                by_name[f"{k}.{i}"] for k in ("attn_out", "mlp_out") if k in model.kinds_at(i)
            ]
            assert_close(pre + sum(blocks), post, f"{arch} resid_post.{i}")
        assert_close(pre, layers[i], f"{arch} resid_pre.{i} = HF layer {i}")
        if i < hf.num_layers - 1:
            assert torch.equal(post, by_name[f"resid_pre.{i + 1}"]), (arch, i)


def test_compiled_engine_matches_hf_at_every_point(compiled_arch):
    llm, hf = engine_for(compiled_arch, compiled=True)
    for positions in ("last", "all"):
        states, ids = points_of(llm, hf, positions)
        assert_every_point_matches_hf(states, ids, hf, positions, f"compiled {compiled_arch}")


# Longer than the engines' 64-token budget: its prefill runs in chunks.
LONG_PROMPT = " ".join(f"word{i}" for i in range(60))


@pytest.mark.parametrize("positions", ["all", {"start": 10, "end": 90}])
def test_compiled_engine_points_over_a_chunked_prefill(compiled_arch, positions):
    """Every point of every layer over a prompt prefilled in chunks (~290
    tokens, 64 a step), for every position and for a window inside it that
    spans chunks."""
    llm, hf = engine_for(compiled_arch, compiled=True)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        return_hidden_states=True,
        hidden_states_points=every_point(hf),
        hidden_states_positions=positions,
    )
    (out,) = llm.generate([LONG_PROMPT], params, use_tqdm=False)
    ids = token_ids_of(out)
    assert len(out.prompt_token_ids) > COMMON_ENGINE_ARGS["max_num_batched_tokens"]
    rows = slice(None) if positions == "all" else slice(positions["start"], positions["end"])
    reference = hf.points(ids)
    for address, tensor in out.outputs[0].hidden_states.items():
        expected = reference[_kind_layer(address)][rows]
        assert_close(tensor, expected, f"compiled {compiled_arch} chunked {address}")


def test_compiled_engine_attention_patterns_match_hf_eager(compiled_arch):
    """The pattern point's query/key capture inside the compiled graph, at
    every attention layer (OLMo 2, on vLLM's Transformers backend, has no vLLM
    attention module: refused; Granite 4.0-H: its attention layers)."""
    llm, hf = engine_for(compiled_arch, compiled=True)
    layers = pattern_layers(hf) or list(range(hf.num_layers))  # none: all, refused
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        return_hidden_states=True,
        hidden_states_points=[f"attn_pattern.{i}" for i in layers],
        hidden_states_positions="all",
    )
    if not pattern_layers(hf):
        with pytest.raises(VLLMValidationError, match=NO_PATTERN):
            llm.generate([PROMPT], params, use_tqdm=False)
        return
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    ids = token_ids_of(out)
    with torch.inference_mode():
        reference = hf.model(torch.tensor([ids]), output_attentions=True).attentions
    # HF returns one pattern per attention layer, in layer order.
    for j, i in enumerate(layers):
        expected = reference[i if len(reference) == hf.num_layers else j][0]
        got = out.outputs[0].hidden_states[f"attn_pattern.{i}"]
        assert_close(got, expected, f"compiled {compiled_arch} attn_pattern.{i}")


# --------------------------------------------------------------------------
# Steering: the engine's interventions against HF forward hooks applying the
# same ones, every layer and position of the steered request compared.

STRENGTH = 4.0


def random_vector(hf: HFReference, seed: int) -> torch.Tensor:
    return torch.randn(hf.hidden_size, generator=torch.Generator().manual_seed(seed))


def steered(hf: HFReference, steering: list[dict], positions: str = "all") -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        return_hidden_states=True,
        hidden_states_layers=list(range(hf.num_layers + 1)),
        hidden_states_positions=positions,
        steering=[{**item, "vector": item["vector"].tolist()} for item in steering],
    )


def as_reference(item: dict, prompt_len: int = 0) -> dict:
    """An intervention as :meth:`HFReference.steered_states` takes it."""
    return {
        "point": item["point"],
        "op": item.get("op", "add"),
        "vector": item["vector"],
        "strength": item.get("strength", 1.0),
        "start": 0,
        "end": None,
    }


def assert_steered_like_hf(out, hf: HFReference, steering: list[dict], what: str):
    ids = token_ids_of(out)
    reference = hf.steered_states(ids, [as_reference(item) for item in steering])
    plain = hf.states(ids)
    states = out.outputs[0].hidden_states
    for layer in range(hf.num_layers + 1):
        assert_close(states[layer], reference[layer], f"{what} layer {layer}")
    # The intervention did something the comparison would see at some layer:
    # three times its tolerance (so it is not plain vs plain).
    changed = max((r - p).abs().max() / p.abs().max() for r, p in zip(reference[1:], plain[1:]))
    assert changed > 3 * REL_TOL, f"{what}: steering changed no layer by over {changed:.1e}"


def test_add_at_every_layer_matches_hf_hooks(arch):
    """One request per layer, each adding its own vector at resid_pre.i, all
    in one batch (same prompt: the steering digest keeps their KV apart)."""
    llm, hf = engine_for(arch)
    steering = [
        [{"point": f"resid_pre.{i}", "vector": random_vector(hf, i), "strength": STRENGTH}]
        for i in range(hf.num_layers)
    ]
    outs = llm.generate(
        [PROMPT] * len(steering), [steered(hf, s) for s in steering], use_tqdm=False
    )
    for i, (out, s) in enumerate(zip(outs, steering)):
        assert_steered_like_hf(out, hf, s, f"{arch} add at resid_pre.{i}")


def steerable_kinds(hf: HFReference) -> list[str]:
    """The steerable kinds of the middle layer (the one the tests steer)."""
    kinds = layers_of(hf).kinds_at(hf.num_layers // 2)
    return [k for k in STEERABLE_KINDS if k in kinds]


@pytest.mark.parametrize("op", ["add", "ablate"])
def test_every_steerable_kind_matches_hf_hooks(arch, op):
    """add / ablate at each kind of point (middle layer), one request per
    kind, in one batch with an unsteered request. A random vector is added;
    the direction ablated is the point's own mean over the prompt (random
    directions carry too little of some points to see their removal)."""
    llm, hf = engine_for(arch)
    layer = hf.num_layers // 2
    prompt_points = hf.points(llm.get_tokenizer()(PROMPT)["input_ids"])
    steering = []
    for j, kind in enumerate(steerable_kinds(hf)):
        point = f"{kind}.{layer}"
        vector = prompt_points[point].mean(0) if op == "ablate" else random_vector(hf, 100 + j)
        item = {"point": point, "op": op, "vector": vector}
        if op == "add":
            item["strength"] = STRENGTH
        steering.append([item])
    plain = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        return_hidden_states=True,
        hidden_states_layers=list(range(hf.num_layers + 1)),
        hidden_states_positions="all",
    )
    outs = llm.generate(
        [PROMPT] * (len(steering) + 1),
        [steered(hf, s) for s in steering] + [plain],
        use_tqdm=False,
    )
    for out, s in zip(outs, steering):
        assert_steered_like_hf(out, hf, s, f"{arch} {op} at {s[0]['point']}")
    assert_every_layer_matches_hf(outs[-1], hf, "all", f"{arch} unsteered beside steered")


# The donor prompt of the patching tests: its rows replace the prompt's own
# at PATCHED positions (the activation-patching experiment's clean run).
DONOR = "In a land far away, a quiet girl loved to draw pictures with friends"
PATCHED = (2, 6)


def patched_points(hf: HFReference, item: dict) -> list[str]:
    """Every point (the patched one among them) but resid_post.(i-1) beside
    a patch of resid_pre.i: one place in the stream, read once, after the
    patch (refused; test_steering.py)."""
    kind, i = item["point"].split(".")
    before = f"resid_post.{int(i) - 1}" if kind == "resid_pre" else None
    return [a for a in every_point(hf) if _kind_layer(a) != before]


def patched(hf: HFReference, item: dict) -> SamplingParams:
    """Every layer and every point at every position (the patched one
    among them)."""
    return SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        return_hidden_states=True,
        hidden_states_layers=list(range(hf.num_layers + 1)),
        hidden_states_points=patched_points(hf, item),
        hidden_states_positions="all",
        steering=[{**item, "rows": item["rows"].numpy()}],
    )


def assert_patched_like_hf(out, hf: HFReference, item: dict, what: str):
    """The patched point holds the given rows (bit for bit where its value
    is one tensor, unscaled: attn_out, mlp_out; within float32 rounding of
    the sum where vLLM keeps the stream as two tensors) and every layer
    matches HF hooks making the same replacement."""
    start, end = item["positions"]["start"], item["positions"]["end"]
    ids = token_ids_of(out)
    got = out.outputs[0].hidden_states
    kind, i = item["point"].split(".")
    scale = point_sites(decoder_layers_of(hf.model)[int(i)])[kind][2]
    address = next(a for a in every_point(hf) if _kind_layer(a) == item["point"])
    rows = got[address][start:end]
    if scale == 1.0 and kind in ("attn_out", "mlp_out"):
        assert torch.equal(rows, item["rows"]), f"{what}: the patched rows are not the given ones"
    else:
        err = (rows - item["rows"]).abs().max() / item["rows"].abs().max()
        assert err < 1e-6, f"{what}: the patched rows differ from the given ones by {err:.1e}"
    patch = {
        "point": item["point"],
        "op": "patch",
        "rows": item["rows"],
        "start": start,
        "end": end,
    }
    reference = hf.steered_states(ids, [patch])
    for layer in range(hf.num_layers + 1):
        assert_close(got[layer], reference[layer], f"{what} layer {layer}")
    points = hf.steered_points(ids, [patch])
    for address in patched_points(hf, item):
        assert_close(got[address], points[_kind_layer(address)], f"{what} {address}")
    plain = hf.states(ids)
    changed = max((r - p).abs().max() / p.abs().max() for r, p in zip(reference[1:], plain[1:]))
    assert changed > 3 * REL_TOL, f"{what}: the patch changed no layer by over {changed:.1e}"


def patch_items(llm, hf: HFReference) -> list[dict]:
    """A patch at each steerable kind of the middle layer over PATCHED, with
    the donor prompt's rows there."""
    layer = hf.num_layers // 2
    donor = hf.points(llm.get_tokenizer()(DONOR)["input_ids"])
    return [
        {
            "point": f"{kind}.{layer}",
            "op": "patch",
            "rows": donor[f"{kind}.{layer}"][PATCHED[0] : PATCHED[1]].float().contiguous(),
            "positions": {"start": PATCHED[0], "end": PATCHED[1]},
        }
        for kind in steerable_kinds(hf)
    ]


def test_patch_at_every_steerable_kind_matches_hf_hooks(arch):
    """patch at each kind of point (middle layer) over positions 2..5 with a
    donor prompt's rows there, one request per kind, in one batch with an
    unpatched request."""
    llm, hf = engine_for(arch)
    items = patch_items(llm, hf)
    plain = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        return_hidden_states=True,
        hidden_states_layers=list(range(hf.num_layers + 1)),
        hidden_states_positions="all",
    )
    outs = llm.generate(
        [PROMPT] * (len(items) + 1), [patched(hf, x) for x in items] + [plain], use_tqdm=False
    )
    for out, item in zip(outs, items):
        assert_patched_like_hf(out, hf, item, f"{arch} patch at {item['point']}")
    assert_every_layer_matches_hf(outs[-1], hf, "all", f"{arch} unpatched beside patched")


def test_compiled_engine_patches_like_hf_hooks(compiled_arch):
    """patch at each steerable kind under torch.compile (the op opaque to
    the graph), one batch."""
    llm, hf = engine_for(compiled_arch, compiled=True)
    items = patch_items(llm, hf)
    outs = llm.generate([PROMPT] * len(items), [patched(hf, x) for x in items], use_tqdm=False)
    for out, item in zip(outs, items):
        assert_patched_like_hf(out, hf, item, f"compiled {compiled_arch} patch at {item['point']}")


def head_layers(hf: HFReference) -> list[int]:
    """The decoder layers whose mixer attends (attn_z exact there): every
    layer of a reader, a hybrid's attention layers only, none on vLLM's
    Transformers backend."""
    model = layers_of(hf)
    return [i for i in range(hf.num_layers) if "attn_z" in model.kinds_at(i)]


def head_items(llm, hf: HFReference) -> tuple[list[dict], list[dict]]:
    """Per-head writes at two attending layers (the engine's items and HF's
    ``patch_heads`` references): at the middle one the donor's head 1 over
    PATCHED, at the one before it (the same one if it is the only one) head
    0 zeroed at every position and both heads (reversed) set to the donor's
    mean (a one-head model, LFM2: head 0 for each). Heads and head_dim are
    read from HF's capture (``[n, heads, head_dim]``), not from the
    package."""
    attending = head_layers(hf)
    layer = attending[len(attending) // 2]
    other = attending[max(len(attending) // 2 - 1, 0)]
    donor = hf.points(llm.get_tokenizer()(DONOR)["input_ids"])
    z, z_other = donor[f"attn_z.{layer}"].float(), donor[f"attn_z.{other}"].float()
    d = z.shape[-1]
    one, both = ([1], [1, 0]) if z.shape[1] > 1 else ([0], [0])
    rows = z[PATCHED[0] : PATCHED[1], one].contiguous()
    mean = z_other[:, both].mean(0)
    window = {"start": PATCHED[0], "end": PATCHED[1]}
    items = [
        {"point": f"attn_z.{layer}", "op": "patch", "heads": one, "rows": rows.numpy(),
         "positions": window},
        {"point": f"attn_z.{other}", "op": "ablate_heads", "heads": [0]},
        {"point": f"attn_z.{other}", "op": "ablate_heads", "heads": both, "mode": "mean",
         "mean": mean.numpy()},
    ]  # fmt: skip
    references = [
        {"point": f"attn_z.{layer}", "op": "patch_heads", "heads": one, "head_dim": d,
         "rows": rows, "start": PATCHED[0], "end": PATCHED[1]},
        {"point": f"attn_z.{other}", "op": "patch_heads", "heads": [0], "head_dim": d,
         "rows": torch.zeros(1, 1, d), "start": 0, "end": None},
        {"point": f"attn_z.{other}", "op": "patch_heads", "heads": both, "head_dim": d,
         "rows": mean[None], "start": 0, "end": None},
    ]  # fmt: skip
    return items, references


def assert_heads_written_like_hf(llm, hf: HFReference, what: str) -> None:
    """patch with heads and ablate_heads (zero, mean) at attn_z, one request
    each, in one batch with an unpatched request: every layer, and every
    attn_z point, as HF forward pre-hooks on the attention output
    projection (o_proj, c_proj, dense, out_proj) replacing the same
    columns; each write changed some layer by over three times the
    tolerance."""
    items, references = head_items(llm, hf)
    z_points = [f"attn_z.{i}" for i in head_layers(hf)]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            return_hidden_states=True,
            hidden_states_layers=list(range(hf.num_layers + 1)),
            hidden_states_points=z_points,
            hidden_states_positions="all",
            steering=[item] if item else None,
        )
        for item in [*items, None]
    ]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for out, item, reference in zip(outs, [*items, None], [*references, None]):
        at = f"{item['op']} {item.get('mode', '')} at {item['point']}" if item else "unpatched"
        ids = token_ids_of(out)
        expected = hf.steered_states(ids, [reference] if reference else [])
        points = hf.steered_points(ids, [reference] if reference else [])
        got = out.outputs[0].hidden_states
        for layer in range(hf.num_layers + 1):
            assert_close(got[layer], expected[layer], f"{what} {at} layer {layer}")
        for address in z_points:
            if not points[address].any():  # a one-head model's only head zeroed
                assert not got[address].any(), f"{what} {at} {address}: not zero"
                continue
            assert_close(got[address], points[address], f"{what} {at} {address}")
        if reference is not None:
            plain = hf.states(ids)
            changed = max(
                (r - p).abs().max() / p.abs().max() for r, p in zip(expected[1:], plain[1:])
            )
            assert changed > 3 * REL_TOL, f"{what} {at}: changed no layer (by {changed:.1e})"


# Why a family without writable heads refuses them (OLMo 2 runs on vLLM's
# Transformers backend: no vLLM attention module, no attn_z; Mamba2 has no
# attention).
NO_HEADS = "Transformers backend|multi-head latent attention|it is not attention"


def test_heads_are_patched_and_ablated_like_hf_hooks(arch):
    """Every family of the matrix: a per-head patch at the middle attending
    layer, a zero and a mean ablate_heads at another, and an unpatched
    request, one batch, as HF hooks (hybrids: their attention layers only).
    A family without attn_z refuses both ops per request, saying why."""
    llm, hf = engine_for(arch)
    if head_layers(hf):
        assert_heads_written_like_hf(llm, hf, arch)
    else:
        assert_heads_refused(llm, hf)


def assert_heads_refused(llm, hf: HFReference) -> None:
    """Both per-head ops refused per request, naming why, on a family
    without writable heads."""
    layer = hf.num_layers // 2
    d = hf.hidden_size // (hf.num_heads or 1)  # (Mamba2: no attention heads)
    for item in (
        {"point": f"attn_z.{layer}", "op": "ablate_heads", "heads": [0]},
        {"point": f"attn_z.{layer}", "op": "patch", "heads": [0], "rows": [[[0.0] * d]]},
    ):
        with pytest.raises(VLLMValidationError, match=rf"attn_z.{layer}.*({NO_HEADS})"):
            llm.generate([PROMPT], SamplingParams(max_tokens=1, steering=[item]), use_tqdm=False)


def test_compiled_engine_patches_and_ablates_heads_like_hf_hooks(compiled_arch):
    """The same under torch.compile (Llama and Nemotron-H under Inductor:
    the write is aten ops in the graph; the others traced by Dynamo)."""
    llm, hf = engine_for(compiled_arch, compiled=True)
    if head_layers(hf):
        assert_heads_written_like_hf(llm, hf, f"compiled {compiled_arch}")
    else:
        assert_heads_refused(llm, hf)


def test_points_are_captured_after_the_steering_at_them(arch):
    """One request adding at every kind of point of the middle layer after
    its resid_pre (four: the engine's default --max-steering) while capturing
    every point of every layer: a point steered is captured with its
    intervention, and the points after it carry it on. (Steering resid_pre.i
    beside resid_post.(i-1) is refused: test_steering.py.)"""
    llm, hf = engine_for(arch)
    layer = hf.num_layers // 2
    kinds = [k for k in steerable_kinds(hf) if k != "resid_pre"]
    steering = [
        {"point": f"{kind}.{layer}", "vector": random_vector(hf, 200 + j), "strength": STRENGTH}
        for j, kind in enumerate(kinds)
    ]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        return_hidden_states=True,
        hidden_states_points=every_point(hf),
        hidden_states_positions="all",
        steering=[{**item, "vector": item["vector"].tolist()} for item in steering],
    )
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    ids = token_ids_of(out)
    reference = hf.steered_points(ids, [as_reference(item) for item in steering])
    plain = hf.points(ids)
    states = out.outputs[0].hidden_states
    assert list(states) == every_point(hf)
    for address, tensor in states.items():
        name = _kind_layer(address)
        assert_close(tensor, reference[name], f"{arch} steered {name}")
    for item in steering:  # each steered point differs from the plain one
        name = item["point"]
        changed = (reference[name] - plain[name]).abs().max() / plain[name].abs().max()
        assert changed > 1e-2, f"{arch}: steering changed {name} by only {changed:.1e}"


def test_attention_patterns_are_those_of_the_steered_forward(arch):
    """Patterns are served by an extract that recomputes every position: it
    replays the request's steering (an add at attn_out.0; Falcon-H1, without
    one attn_out: at resid_mid.0), so every later layer's weights are HF
    eager's under the same hook."""
    llm, hf = engine_for(arch)
    point = "attn_out.0" if "attn_out" in layers_of(hf).kinds_at(0) else "resid_mid.0"
    steering = [{"point": point, "vector": random_vector(hf, 300), "strength": STRENGTH}]
    layers = pattern_layers(hf) or list(range(hf.num_layers))  # none: all, refused
    patterns = [f"attn_pattern.{i}" for i in layers]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        return_hidden_states=True,
        hidden_states_points=patterns,
        hidden_states_positions="all",
        steering=[{**item, "vector": item["vector"].tolist()} for item in steering],
    )
    if not pattern_layers(hf):
        with pytest.raises(VLLMValidationError, match=NO_PATTERN):
            llm.generate([PROMPT], params, use_tqdm=False)
        return
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    ids = torch.tensor([token_ids_of(out)])
    with hf.steering([as_reference(item) for item in steering]), torch.inference_mode():
        reference = hf.model(ids, output_attentions=True).attentions
    with torch.inference_mode():
        plain = hf.model(ids, output_attentions=True).attentions
    # HF returns one pattern per attention layer, in layer order.
    if len(reference) != hf.num_layers:
        assert len(reference) == len(patterns), (arch, len(reference))
    for j, (i, address) in enumerate(zip(layers, patterns)):
        expected = reference[i if len(reference) == hf.num_layers else j][0]
        assert_close(out.outputs[0].hidden_states[address], expected, f"{arch} {address}")
    moved = (reference[-1] - plain[-1]).abs().max()
    assert moved > 1e-2, f"{arch}: the steering moved the last layer's weights by only {moved:.1e}"
    # A layer without attention (Granite 4.0-H's Mamba layers) has no pattern:
    # refused per request, naming its mixer.
    for i in sorted(set(range(hf.num_layers)) - set(layers)):
        params.hidden_states_points = [f"attn_pattern.{i}"]
        with pytest.raises(VLLMValidationError, match=rf"attn_pattern.{i}: .*not attention"):
            llm.generate([PROMPT], params, use_tqdm=False)


def test_compiled_engine_steers_like_hf_hooks(compiled_arch):
    """An add, an ablate at the last MLP (a model without MLPs, Mamba2's,
    Zamba2's: at the last token mixer), and both inside block 0, at the
    points each layer has (a hybrid's layers lack some)."""
    llm, hf = engine_for(compiled_arch, compiled=True)
    model = layers_of(hf)
    block = next(
        k
        for k in ("mlp_out", "attn_out")
        if any(k in model.kinds_at(i) for i in range(hf.num_layers))
    )
    last = max(i for i in range(hf.num_layers) if block in model.kinds_at(i))
    inside = [
        {"point": "attn_out.0", "vector": random_vector(hf, 3), "strength": STRENGTH},
        {"point": "resid_mid.0", "op": "ablate", "vector": random_vector(hf, 4)},
    ]
    steering = [
        [{"point": "resid_pre.1", "vector": random_vector(hf, 1), "strength": STRENGTH}],
        [{"point": f"{block}.{last}", "op": "ablate", "vector": random_vector(hf, 2)}],
        [item for item in inside if item["point"].split(".")[0] in model.kinds_at(0)],
    ]
    outs = llm.generate(
        [PROMPT] * len(steering), [steered(hf, s) for s in steering], use_tqdm=False
    )
    for out, s in zip(outs, steering):
        assert_steered_like_hf(out, hf, s, f"compiled {compiled_arch} {s[0]['point']}")
