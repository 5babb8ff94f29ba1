# SPDX-License-Identifier: Apache-2.0
"""Steering on the Python API: per-request interventions, exact against HF
transformers with forward hooks applying the same ones
(:meth:`HFReference.steered_states`).

The session engine (tiny Qwen3, every steerable point steerable, the named
vectors of :func:`write_steering_vectors`, chunked prefill at 64 tokens,
24-row capture buffers, prefix caching on). Every steered request also
captures every layer at every position, so a wrong row anywhere (a missed
decode step, a chunk, the final token's extract) shows.
"""

import pytest
import torch

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

from .conftest import (
    COMMON_ENGINE_ARGS,
    STEERING_VECTOR,
    assert_close,
    llm_in_process,
    num_preemptions,
    shut_down_in_process,
    token_ids_of,
)

PROMPT = "Once upon a time there was a small robot who loved to count"
MAX_TOKENS = 6
STRENGTH = 4.0


def vector(hf, seed: int) -> torch.Tensor:
    return torch.randn(hf.hidden_size, generator=torch.Generator().manual_seed(seed))


def named_vector(steering_vectors_dir) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(steering_vectors_dir / f"{STEERING_VECTOR}.safetensors"))["v"]


def params(hf, steering=None, positions="all", **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    kwargs.setdefault("temperature", 0.0)
    return SamplingParams(
        ignore_eos=True,
        return_hidden_states=True,
        hidden_states_layers=list(range(hf.num_layers + 1)),
        hidden_states_positions=positions,
        steering=None
        if steering is None
        else [
            {**s, "vector": s["vector"].tolist()} if "vector" in s else dict(s) for s in steering
        ],
        **kwargs,
    )


def reference_items(steering, prompt_len: int, vectors: dict | None = None) -> list[dict]:
    """Interventions as :meth:`HFReference.steered_states` takes them."""
    out = []
    for s in steering:
        positions = s.get("positions", "all")
        start, end = 0, None
        if positions == "prompt":
            end = prompt_len
        elif positions == "generated":
            start = prompt_len
        elif isinstance(positions, dict):
            start, end = positions["start"], positions.get("end")
        out.append(
            {
                "point": s["point"],
                "op": s.get("op", "add"),
                "vector": s["vector"] if "vector" in s else vectors[s["name"]],
                "strength": s.get("strength", 1.0),
                "start": start,
                "end": end,
            }
        )
    return out


def assert_steered(out, hf, steering, what: str, vectors: dict | None = None, choice: int = 0):
    """Every layer at every position of one choice equals HF with the same
    interventions."""
    ids = list(out.prompt_token_ids) + list(out.outputs[choice].token_ids)
    reference = hf.steered_states(
        ids, reference_items(steering, len(out.prompt_token_ids), vectors)
    )
    states = out.outputs[choice].hidden_states
    for layer in range(hf.num_layers + 1):
        assert_close(states[layer], reference[layer], f"{what} layer {layer}")


def assert_plain(out, hf, what: str):
    reference = hf.states(token_ids_of(out))
    for layer in range(hf.num_layers + 1):
        assert_close(out.outputs[0].hidden_states[layer], reference[layer], f"{what} {layer}")


@pytest.mark.four_modes
def test_a_named_vector_steers_like_the_same_vector_inline(llm, hf_qwen3, steering_vectors_dir):
    v = named_vector(steering_vectors_dir)
    by_name = [{"point": "resid_pre.1", "name": STEERING_VECTOR, "strength": STRENGTH}]
    inline = [{"point": "resid_pre.1", "vector": v, "strength": STRENGTH}]
    a, b = llm.generate(
        [PROMPT, PROMPT], [params(hf_qwen3, by_name), params(hf_qwen3, inline)], use_tqdm=False
    )
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for layer in range(hf_qwen3.num_layers + 1):
        assert torch.equal(a.outputs[0].hidden_states[layer], b.outputs[0].hidden_states[layer])
    assert_steered(a, hf_qwen3, by_name, "named", {STEERING_VECTOR: v})


def test_steering_changes_the_greedy_output(llm, hf_qwen3):
    steering = [{"point": "resid_pre.1", "vector": vector(hf_qwen3, 0), "strength": 8.0}]
    plain, steered = llm.generate(
        [PROMPT, PROMPT], [params(hf_qwen3), params(hf_qwen3, steering)], use_tqdm=False
    )
    assert plain.outputs[0].token_ids != steered.outputs[0].token_ids
    assert_steered(steered, hf_qwen3, steering, "greedy")


def test_ablate_removes_the_direction_from_the_stream_at_its_point(llm, hf_qwen3):
    d = vector(hf_qwen3, 1)
    steering = [{"point": "resid_pre.2", "op": "ablate", "vector": d}]
    (out,) = llm.generate([PROMPT], params(hf_qwen3, steering), use_tqdm=False)
    # The stream entering layer 2 (captured after the steering) has no
    # component along d left, at every position.
    dots = out.outputs[0].hidden_states[2] @ (d / d.norm())
    assert dots.abs().max() < 1e-4 * out.outputs[0].hidden_states[2].abs().max()
    assert_steered(out, hf_qwen3, steering, "ablate")


@pytest.mark.parametrize("positions", ["prompt", "generated", {"start": 3, "end": 9}, {"start": 5}])
def test_positions_steer_only_their_positions(llm, hf_qwen3, positions):
    steering = [
        {
            "point": "resid_pre.1",
            "vector": vector(hf_qwen3, 2),
            "strength": STRENGTH,
            "positions": positions,
        }
    ]
    (out,) = llm.generate([PROMPT], params(hf_qwen3, steering), use_tqdm=False)
    assert_steered(out, hf_qwen3, steering, f"positions {positions}")
    # Positions before the first steered one are the unsteered model's.
    first = {"prompt": 0, "generated": len(out.prompt_token_ids)}.get(
        positions if isinstance(positions, str) else "", None
    )
    first = positions["start"] if isinstance(positions, dict) else first
    plain = hf_qwen3.states(token_ids_of(out))
    if first:
        final = hf_qwen3.num_layers
        got = out.outputs[0].hidden_states[final][:first]
        assert_close(got, plain[final][:first], "before the steered positions")


def test_interventions_at_one_point_apply_in_list_order(llm, hf_qwen3):
    """add then ablate (overlapping windows) at one point: the add's component
    along the ablated direction is removed where both apply."""
    steering = [
        {
            "point": "attn_out.1",
            "vector": vector(hf_qwen3, 3),
            "strength": STRENGTH,
            "positions": {"start": 2, "end": 12},
        },
        {
            "point": "attn_out.1",
            "op": "ablate",
            "vector": vector(hf_qwen3, 4),
            "positions": {"start": 6},
        },
    ]
    (out,) = llm.generate([PROMPT], params(hf_qwen3, steering), use_tqdm=False)
    assert_steered(out, hf_qwen3, steering, "add then ablate")


@pytest.mark.four_modes
def test_eight_different_interventions_share_a_batch_with_unsteered_requests(llm, hf_qwen3):
    n = hf_qwen3.num_layers
    kinds = ["resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post"]
    steering = [
        [
            {
                "point": f"{kinds[i % len(kinds)]}.{i % n}",
                "op": "ablate" if i % 3 == 2 else "add",
                "vector": vector(hf_qwen3, 10 + i),
                **({} if i % 3 == 2 else {"strength": 1.0 + i}),
            }
        ]
        for i in range(8)
    ]
    prompts = [f"{PROMPT} number {i}" for i in range(10)]
    outs = llm.generate(
        prompts,
        [params(hf_qwen3, s) for s in steering] + [params(hf_qwen3), params(hf_qwen3)],
        use_tqdm=False,
    )
    for out, s in zip(outs, steering):
        assert_steered(out, hf_qwen3, s, f"batch {s[0]['point']} {s[0]['op']}")
    for out in outs[8:]:
        assert_plain(out, hf_qwen3, "unsteered in a steered batch")


@pytest.mark.four_modes
def test_a_prompt_longer_than_the_token_budget_is_steered_in_every_chunk(llm, hf_qwen3):
    prompt = " ".join([PROMPT] * 12)  # ~150 tokens: three chunks of 64
    steering = [
        {"point": "resid_mid.0", "vector": vector(hf_qwen3, 5), "strength": STRENGTH},
        {
            "point": "resid_pre.2",
            "vector": vector(hf_qwen3, 6),
            "positions": {"start": 50, "end": 140},
        },
    ]
    (out,) = llm.generate([prompt], params(hf_qwen3, steering, max_tokens=3), use_tqdm=False)
    assert len(out.prompt_token_ids) > 128
    assert_steered(out, hf_qwen3, steering, "chunked prefill")


def test_each_of_n_choices_is_steered(llm, hf_qwen3):
    steering = [{"point": "resid_pre.1", "vector": vector(hf_qwen3, 7), "strength": STRENGTH}]
    p = params(hf_qwen3, steering, n=2, temperature=1.0, seed=3)
    (out,) = llm.generate([PROMPT], p, use_tqdm=False)
    assert len(out.outputs) == 2
    for choice in range(2):
        assert_steered(out, hf_qwen3, steering, f"choice {choice}", choice=choice)


@pytest.mark.four_modes
def test_the_last_token_extract_replays_the_steering(llm, hf_qwen3):
    """ "last" is a post-sampling prefill (an extract): it recomputes the final
    position on the request's steered KV and must steer it too."""
    steering = [
        {"point": "resid_pre.1", "vector": vector(hf_qwen3, 8), "strength": STRENGTH},
        {"point": "mlp_out.2", "op": "ablate", "vector": vector(hf_qwen3, 9)},
    ]
    (out,) = llm.generate([PROMPT], params(hf_qwen3, steering, positions="last"), use_tqdm=False)
    ids = token_ids_of(out)
    reference = hf_qwen3.steered_states(ids, reference_items(steering, len(out.prompt_token_ids)))
    for layer in range(hf_qwen3.num_layers + 1):
        assert_close(out.outputs[0].hidden_states[layer], reference[layer][-1:], f"last {layer}")


def test_steered_and_unsteered_requests_never_share_prefix_cache_blocks(llm, hf_qwen3):
    """Same prompt, back to back: unsteered, steered, unsteered, steered.
    Each reads the blocks of its own kind only (the steering digest salts
    the block hashes), and each is exact ("last": no capture forces a
    recompute, so the prefix cache is used)."""
    prompt = " ".join([PROMPT] * 6) + " unique to the prefix cache test"
    steering = [{"point": "resid_pre.1", "vector": vector(hf_qwen3, 11), "strength": STRENGTH}]
    plain = params(hf_qwen3, positions="last")
    steered = params(hf_qwen3, steering, positions="last")
    outs = [llm.generate([prompt], p, use_tqdm=False)[0] for p in (plain, steered, plain, steered)]
    assert outs[1].num_cached_tokens == 0  # not the unsteered blocks
    assert outs[2].num_cached_tokens > 0  # the first request's
    assert outs[3].num_cached_tokens > 0  # the second's
    for out, s in zip(outs, (None, steering, None, steering)):
        ids = token_ids_of(out)
        items = [] if s is None else reference_items(s, len(out.prompt_token_ids))
        reference = hf_qwen3.steered_states(ids, items)
        for layer in range(hf_qwen3.num_layers + 1):
            assert_close(
                out.outputs[0].hidden_states[layer], reference[layer][-1:], f"{s is None} {layer}"
            )
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == outs[3].outputs[0].token_ids


def test_a_steered_request_without_hidden_states_generates_the_steered_tokens(llm, hf_qwen3):
    steering = [{"point": "resid_pre.1", "vector": vector(hf_qwen3, 12), "strength": 8.0}]
    with_states = params(hf_qwen3, steering)
    alone = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        steering=[{**steering[0], "vector": steering[0]["vector"].tolist()}],
    )
    a, b = llm.generate([PROMPT, PROMPT], [with_states, alone], use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert b.outputs[0].hidden_states is None


def test_a_bad_intervention_fails_alone_and_the_engine_keeps_serving(llm, hf_qwen3):
    bad = SamplingParams(max_tokens=2, steering=[{"point": "resid_pre.99", "vector": [0.0]}])
    with pytest.raises(VLLMValidationError, match=r"steering\[0\]\.point: .*out of range"):
        llm.generate([PROMPT], bad, use_tqdm=False)
    (out,) = llm.generate([PROMPT], params(hf_qwen3), use_tqdm=False)
    assert_plain(out, hf_qwen3, "after a refused request")


def test_resid_post_beside_steering_at_the_next_resid_pre_is_a_clear_refusal(llm, hf_qwen3):
    """resid_post.1 would be read after the intervention at resid_pre.2 (one
    place in the stream); steering at resid_post.1 reads it steered, as
    TransformerLens does."""
    v = vector(hf_qwen3, 7).tolist()
    asks = dict(max_tokens=2, return_hidden_states=True, hidden_states_points=["resid_post.1"])
    bad = SamplingParams(steering=[{"point": "resid_pre.2", "vector": v}], **asks)
    with pytest.raises(VLLMValidationError, match=r"Steer at resid_post\.1 instead"):
        llm.generate([PROMPT], bad, use_tqdm=False)
    good = SamplingParams(steering=[{"point": "resid_post.1", "vector": v}], **asks)
    (out,) = llm.generate([PROMPT], good, use_tqdm=False)
    ids = token_ids_of(out)
    item = {"point": "resid_post.1", "op": "add", "vector": torch.tensor(v), "strength": 1.0}
    reference = hf_qwen3.steered_points(ids, [{**item, "start": 0, "end": None}])
    got = out.outputs[0].hidden_states["resid_post.1"]
    assert_close(got, reference["resid_post.1"][-1:], "resid_post.1 steered there")


def test_an_engine_without_steering_refuses_it_naming_the_flag(llm_compiled):
    p = SamplingParams(max_tokens=2, steering=[{"point": "resid_pre.0", "vector": [1.0]}])
    with pytest.raises(VLLMValidationError, match="enable-steering"):
        llm_compiled.generate([PROMPT], p, use_tqdm=False)


# --------------------------------------------------------------------------
# preemption


@pytest.mark.four_modes
def test_preempted_steered_requests_are_recomputed_steered(llm_small_kv, hf_qwen3):
    steering = [
        [{"point": f"resid_pre.{i % 3}", "vector": vector(hf_qwen3, 20 + i), "strength": 2.0}]
        for i in range(4)
    ]
    prompts = [f"{PROMPT} number {i}" for i in range(4)]
    outs = llm_small_kv.generate(
        prompts, [params(hf_qwen3, s, max_tokens=60) for s in steering], use_tqdm=False
    )
    preemptions = num_preemptions(llm_small_kv)
    assert preemptions > 0  # the case under test happened
    for out, s in zip(outs, steering):
        assert_steered(out, hf_qwen3, s, f"preempted {s[0]['point']}")


@pytest.mark.four_modes
def test_preempted_patched_requests_are_recomputed_patched(llm_small_kv, hf_qwen3):
    """A preempted request's patch rows come back with it (its table rows are
    given back and lent again; the scheduler keeps them counted)."""
    rows = [
        torch.randn(4, hf_qwen3.hidden_size, generator=torch.Generator().manual_seed(30 + i))
        for i in range(4)
    ]
    items = [
        {"point": f"resid_pre.{i % 3}", "op": "patch", "rows": r.numpy(),
         "positions": {"start": 2, "end": 6}}
        for i, r in enumerate(rows)
    ]  # fmt: skip
    prompts = [f"{PROMPT} number {i}" for i in range(4)]
    before = num_preemptions(llm_small_kv)
    outs = llm_small_kv.generate(
        prompts, [params(hf_qwen3, [x], max_tokens=60) for x in items], use_tqdm=False
    )
    assert num_preemptions(llm_small_kv) > before  # the case under test happened
    for out, item, r in zip(outs, items, rows):
        ids = token_ids_of(out)
        patch = {"point": item["point"], "op": "patch", "rows": r, "start": 2, "end": 6}
        reference = hf_qwen3.steered_states(ids, [patch])
        for layer in range(hf_qwen3.num_layers + 1):
            got = out.outputs[0].hidden_states[layer]
            assert_close(got, reference[layer], f"preempted patch {item['point']} layer {layer}")


# --------------------------------------------------------------------------
# the engine's SAE: clamp a feature, steer along a decoder row


@pytest.fixture(scope="module", params=["standard", "jumprelu"])
def sae_steering(request, tmp_path_factory, qwen3_dir, hf_qwen3):
    """An engine with an SAE at ``blocks.1.hook_resid_post`` (resid_pre.2)
    and steering; yields ``(engine, SAE weights as torch tensors)``."""
    from vllm_hidden_states.sae import random_sae, save_sae

    weights, cfg = random_sae(
        hf_qwen3.hidden_size, 64, "blocks.1.hook_resid_post", request.param, seed=5
    )
    path = tmp_path_factory.mktemp("sae") / request.param
    save_sae(path, weights, cfg)
    engine = llm_in_process(
        model=str(qwen3_dir),
        sae=str(path),
        enable_steering=True,
        enforce_eager=True,
        max_model_len=512,
        **COMMON_ENGINE_ARGS,
    )
    yield engine, {k: torch.as_tensor(v) for k, v in weights.items()}
    shut_down_in_process(engine)


def test_clamp_sae_feature_matches_hf_hooks(sae_steering, hf_qwen3):
    """x += (value - f(x)) W_dec[f] at the SAE's point (resid_pre.2; point
    left out), against an HF hook computing f with the SAE's own formula."""
    llm, sae = sae_steering
    pre = hf_qwen3.states(llm.get_tokenizer().encode(PROMPT))[2].double() - sae["b_dec"].double()
    feature = int((pre @ sae["W_enc"].double() + sae["b_enc"].double()).mean(0).argmax())
    steering = [{"op": "clamp_sae_feature", "sae_feature": feature, "value": 5.0}]
    (out,) = llm.generate([PROMPT], params(hf_qwen3, steering), use_tqdm=False)
    ids = token_ids_of(out)
    item = {
        "point": "resid_pre.2",
        "op": "clamp_sae_feature",
        "sae": sae,
        "sae_feature": feature,
        "value": 5.0,
        "start": 0,
        "end": None,
    }
    reference = hf_qwen3.steered_states(ids, [item])
    plain = hf_qwen3.states(ids)
    for layer in range(hf_qwen3.num_layers + 1):
        assert_close(out.outputs[0].hidden_states[layer], reference[layer], f"clamp {layer}")
    changed = (reference[2] - plain[2]).abs().max() / plain[2].abs().max()
    assert changed > 1e-2, f"the clamp changed resid_pre.2 by only {changed:.1e}"


def test_sae_features_at_resid_post_beside_steering_the_next_resid_pre_is_refused(
    sae_steering, hf_qwen3
):
    """The SAE reads blocks.1.hook_resid_post; an add at resid_pre.2 comes
    after it in the network, but this engine reads both at one place."""
    llm, _ = sae_steering
    p = SamplingParams(
        max_tokens=2,
        sae_features={"top_k": 3},
        steering=[{"point": "resid_pre.2", "vector": vector(hf_qwen3, 9).tolist()}],
    )
    with pytest.raises(
        VLLMValidationError, match=r"sae_features reads the SAE at 'blocks\.1\.hook_resid_post'"
    ):
        llm.generate([PROMPT], p, use_tqdm=False)


def test_a_clamp_then_the_features_of_its_sae_are_served(sae_steering, hf_qwen3):
    """A clamp sits at the SAE's hook: its features are read after it (the
    clamped feature of the last token equals the SAE's encoding of HF's
    clamped stream, not of the plain one)."""
    llm, sae = sae_steering
    # The feature whose decoder row its encoder reads most: clamping it
    # moves its own reading.
    feature = int((sae["W_dec"] * sae["W_enc"].T).sum(-1).argmax())
    value = 20.0
    p = SamplingParams(
        max_tokens=2,
        temperature=0.0,
        sae_features={"top_k": sae["W_dec"].shape[0]},
        steering=[{"op": "clamp_sae_feature", "sae_feature": feature, "value": value}],
    )
    (out,) = llm.generate([PROMPT], p, use_tqdm=False)
    features = out.outputs[0].sae_features
    ids, values = torch.as_tensor(features["ids"]), torch.as_tensor(features["values"])
    got = float(values[ids == feature].sum())
    item = {"point": "resid_pre.2", "op": "clamp_sae_feature", "sae": sae, "sae_feature": feature}
    item.update(value=value, start=0, end=None)
    tokens = token_ids_of(out)

    def encoded(x: torch.Tensor) -> float:
        w = {k: t.double() for k, t in sae.items()}
        pre = (x[-1].double() - w["b_dec"]) @ w["W_enc"][:, feature] + w["b_enc"][feature]
        threshold = w["threshold"][feature] if "threshold" in w else 0.0
        return float(torch.relu(pre) * (pre > threshold))

    after = encoded(hf_qwen3.steered_states(tokens, [item])[2])
    before = encoded(hf_qwen3.states(tokens)[2])
    assert abs(got - after) <= 1e-3 * max(abs(after), 1.0), (got, after, before)
    assert abs(after - before) > 1e-2, (after, before)


def test_add_along_an_sae_feature_is_its_decoder_row(sae_steering, hf_qwen3):
    llm, sae = sae_steering
    row = sae["W_dec"][7].float()
    by_feature = [{"point": "resid_pre.1", "sae_feature": 7, "strength": 3.0}]
    inline = [{"point": "resid_pre.1", "vector": row, "strength": 3.0}]
    a, b = llm.generate(
        [PROMPT, PROMPT], [params(hf_qwen3, by_feature), params(hf_qwen3, inline)], use_tqdm=False
    )
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for layer in range(hf_qwen3.num_layers + 1):
        assert torch.equal(a.outputs[0].hidden_states[layer], b.outputs[0].hidden_states[layer])
    assert_steered(a, hf_qwen3, inline, "along W_dec[7]")


def test_clamp_at_another_point_is_refused_naming_the_saes(sae_steering):
    llm, _ = sae_steering
    p = SamplingParams(
        max_tokens=2,
        steering=[{"op": "clamp_sae_feature", "point": "resid_pre.1", "sae_feature": 0}],
    )
    with pytest.raises(VLLMValidationError, match=r"the SAE's point, 'resid_pre.2'"):
        llm.generate([PROMPT], p, use_tqdm=False)
