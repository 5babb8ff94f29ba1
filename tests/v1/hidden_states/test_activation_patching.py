# SPDX-License-Identifier: Apache-2.0
"""Activation patching and SAE splicing through ``SamplingParams.steering``
(``op: "patch"`` and ``op: "sae_splice"``), against HF forward hooks making
the same replacement: batches of differently patched requests, the extract
of "last", n > 1, a patch over a chunked prefill, the patch table full
(requests wait), and the refusals.

Per-head writes at attn_z (``patch`` with ``heads``, ``ablate_heads``)
against HF forward pre-hooks on o_proj replacing the same columns.

One in-process engine: tiny Qwen3, eager, every steerable point, a top-k SAE
at ``blocks.1.hook_resid_pre`` (the splice's point), a 24-row patch table and
chunked prefill at 64 tokens. The family matrix (test_architectures.py,
``test_patch_at_every_steerable_kind_matches_hf_hooks`` and its compiled
twin) patches every point kind of every family.
"""

import gc

import numpy as np
import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm_hidden_states.sae import random_sae, save_sae

from .conftest import (
    COMMON_ENGINE_ARGS,
    HFReference,
    assert_close,
    in_process_engine,
    shut_down_in_process,
    token_ids_of,
)

PROMPT = "Once upon a time there was a small robot who loved to count"
DONOR = "In a land far away, a quiet girl loved to draw pictures with friends"
SAE_LAYER = 1
D_SAE = 48
TOP_K = 6
PATCH_ROWS = 24
MAX_TOKENS = 4
pytestmark = pytest.mark.four_modes


@pytest.fixture(scope="module")
def sae(tmp_path_factory, hf_qwen3) -> dict:
    weights, cfg = random_sae(
        hf_qwen3.hidden_size, D_SAE, f"blocks.{SAE_LAYER}.hook_resid_pre", "topk", seed=3, k=TOP_K
    )
    path = save_sae(tmp_path_factory.mktemp("splice-sae"), weights, cfg)
    return {"path": path, "weights": weights, "cfg": cfg}


@pytest.fixture(scope="module")
def llm(qwen3_dir, sae):
    with in_process_engine():
        engine = LLM(
            model=str(qwen3_dir),
            enable_hidden_states=True,
            # The heads' outputs where a per-head patch writes them.
            hidden_states_points="attn_z.2",
            enable_steering=True,
            steering_points="all",
            sae=str(sae["path"]),
            max_patch_rows=PATCH_ROWS,
            enforce_eager=True,
            max_model_len=512,
            **dict(COMMON_ENGINE_ARGS, max_num_seqs=8),
        )
    yield engine
    shut_down_in_process(engine)
    del engine
    gc.collect()


def params(steering: list[dict], positions="all", **extra) -> SamplingParams:
    fields = dict(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        return_hidden_states=True,
        hidden_states_layers=list(range(5)),
        hidden_states_positions=positions,
        steering=steering,
    )
    return SamplingParams(**{**fields, **extra})


def donor_rows(llm, hf: HFReference, point: str, start: int, end: int) -> torch.Tensor:
    return hf.points(llm.get_tokenizer()(DONOR)["input_ids"])[point][start:end].float()


def patch(point: str, rows: torch.Tensor, start: int) -> dict:
    return {
        "point": point,
        "op": "patch",
        "rows": rows.numpy(),
        "positions": {"start": start, "end": start + rows.shape[0]},
    }


def reference_item(item: dict, sae: dict | None = None) -> dict:
    """An intervention as HFReference.steering takes it."""
    if item["op"] == "patch":
        rows = torch.from_numpy(np.asarray(item["rows"]))
        rows = rows.flatten(1)  # attn_z's [n, heads, head_dim]: the flat input of o_proj
        start = item["positions"]["start"]
        return {"point": item["point"], "op": "patch", "rows": rows, "start": start,
                "end": start + rows.shape[0]}  # fmt: skip
    assert sae is not None
    return {
        "point": f"resid_pre.{SAE_LAYER}",
        "op": "sae_splice",
        "sae": {k: torch.as_tensor(v) for k, v in sae["weights"].items()},
        "architecture": "topk",
        "k": TOP_K,
        "edits": item.get("edits"),
        "keep_error": item.get("keep_error", False),
        "start": 0,
        "end": None,
    }


def assert_like_hf(out, hf: HFReference, references: list[dict], what: str, choice: int = 0):
    ids = (
        token_ids_of(out)
        if choice == 0
        else [*out.prompt_token_ids, *out.outputs[choice].token_ids]
    )
    expected = hf.steered_states(ids, references)
    got = out.outputs[choice].hidden_states
    for layer in range(hf.num_layers + 1):
        assert_close(got[layer], expected[layer], f"{what} layer {layer}")
    plain = hf.states(ids)
    changed = max((e - p).abs().max() / p.abs().max() for e, p in zip(expected[1:], plain[1:]))
    assert changed > 3e-3, f"{what}: the intervention changed no layer (by {changed:.1e})"


def test_a_splice_with_edits_matches_hf_hooks_splicing_the_same_sae(llm, hf_qwen3, sae):
    item = {"op": "sae_splice", "edits": [{"feature": 3, "set": 4.0}, {"feature": 7, "scale": 0.0}]}
    (out,) = llm.generate([PROMPT], params([item]), use_tqdm=False)
    assert_like_hf(out, hf_qwen3, [reference_item(item, sae)], "splice with edits")


def test_a_splice_keeping_the_error_term_edits_only_the_features(llm, hf_qwen3, sae):
    item = {"op": "sae_splice", "keep_error": True, "edits": [{"feature": 5, "set": 6.0}]}
    (out,) = llm.generate([PROMPT], params([item]), use_tqdm=False)
    assert_like_hf(out, hf_qwen3, [reference_item(item, sae)], "splice keeping the error")


def test_differently_patched_and_spliced_requests_share_a_batch_each_exact(llm, hf_qwen3, sae):
    a = patch("resid_pre.2", donor_rows(llm, hf_qwen3, "resid_pre.2", 2, 6), 2)
    b = patch("mlp_out.3", donor_rows(llm, hf_qwen3, "mlp_out.3", 5, 9), 5)
    c = {"op": "sae_splice"}
    plain = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, return_hidden_states=True,
        hidden_states_layers=list(range(5)), hidden_states_positions="all",
    )  # fmt: skip
    outs = llm.generate(
        [PROMPT] * 4, [params([a]), params([b]), params([c]), plain], use_tqdm=False
    )
    assert_like_hf(outs[0], hf_qwen3, [reference_item(a)], "patch resid_pre.2 in a batch")
    assert_like_hf(outs[1], hf_qwen3, [reference_item(b)], "patch mlp_out.3 in a batch")
    assert_like_hf(outs[2], hf_qwen3, [reference_item(c, sae)], "splice in a batch")
    ids = token_ids_of(outs[3])
    expected = hf_qwen3.states(ids)
    for layer in range(hf_qwen3.num_layers + 1):
        got = outs[3].outputs[0].hidden_states[layer]
        assert_close(got, expected[layer], f"unpatched beside patched, layer {layer}")


def test_the_final_tokens_extract_replays_the_patch(llm, hf_qwen3):
    """ "last" is read by a recomputing extract: it patches the same rows."""
    a = patch("resid_pre.2", donor_rows(llm, hf_qwen3, "resid_pre.2", 1, 7), 1)
    (out,) = llm.generate([PROMPT], params([a], positions="last"), use_tqdm=False)
    ids = token_ids_of(out)
    expected = hf_qwen3.steered_states(ids, [reference_item(a)])
    for layer in range(hf_qwen3.num_layers + 1):
        assert_close(out.outputs[0].hidden_states[layer], expected[layer][-1:], f"last {layer}")


def test_every_sample_of_n_is_patched(llm, hf_qwen3):
    a = patch("attn_out.1", donor_rows(llm, hf_qwen3, "attn_out.1", 3, 8), 3)
    (out,) = llm.generate([PROMPT], params([a], n=2, temperature=1.0, seed=7), use_tqdm=False)
    for choice in range(2):
        assert_like_hf(out, hf_qwen3, [reference_item(a)], f"sample {choice}", choice)


def test_a_patch_across_chunks_of_a_long_prefill_is_exact(llm, hf_qwen3):
    """Chunked prefill at 64 tokens: a window over positions 60..69 is
    patched partly in each of two chunks."""
    prompt = " ".join([PROMPT] * 8)
    n = len(llm.get_tokenizer()(prompt)["input_ids"])
    assert n > 80, n
    rows = torch.randn(10, hf_qwen3.hidden_size, generator=torch.Generator().manual_seed(2))
    a = patch("resid_pre.3", rows, 60)
    (out,) = llm.generate([prompt], params([a]), use_tqdm=False)
    assert_like_hf(out, hf_qwen3, [reference_item(a)], "patch across chunks")


def test_requests_whose_rows_do_not_fit_the_table_wait_and_finish_exact(llm, hf_qwen3):
    """Three requests of 10 rows each against a 24-row table: one waits
    until another finishes; none is truncated."""
    items = [
        patch("resid_pre.2", torch.randn(10, hf_qwen3.hidden_size,
              generator=torch.Generator().manual_seed(10 + j)), 1)
        for j in range(3)
    ]  # fmt: skip
    outs = llm.generate([PROMPT] * 3, [params([x]) for x in items], use_tqdm=False)
    for j, (out, item) in enumerate(zip(outs, items)):
        assert_like_hf(out, hf_qwen3, [reference_item(item)], f"request {j} of 3")


# -- per-head patching and ablation at attn_z -----------------------------------


def head_dim_of(hf: HFReference) -> int:
    config = hf.model.config
    return int(getattr(config, "head_dim", 0) or config.hidden_size // config.num_attention_heads)


def head_rows(rows: torch.Tensor, heads: list[int]) -> torch.Tensor:
    """``[n, len(heads), head_dim]``: the given heads of attn_z rows ``[n,
    heads, head_dim]``."""
    return rows[:, heads].contiguous()


def head_reference(item: dict, hf: HFReference) -> dict:
    """A per-head intervention as HFReference.steering's ``patch_heads``
    (a patch without heads: the plain ``patch``)."""
    if item["op"] == "patch" and "heads" not in item:
        return reference_item(item)
    d = head_dim_of(hf)
    if item["op"] == "patch":
        rows = torch.from_numpy(np.asarray(item["rows"], dtype=np.float32))
        start, end = item["positions"]["start"], item["positions"]["end"]
    else:
        mean = item.get("mean")
        rows = (
            torch.zeros(1, len(item["heads"]), d)
            if mean is None
            else torch.as_tensor(np.asarray(mean, dtype=np.float32))[None]
        )
        start, end = 0, None
    layer = item["point"].split(".")[1]  # attn_z.i or blocks.i.attn.hook_z
    return {"point": f"attn_z.{layer}", "op": "patch_heads", "heads": item["heads"],
            "head_dim": d, "rows": rows, "start": start, "end": end}  # fmt: skip


def per_head_items(llm, hf: HFReference) -> list[dict]:
    """A per-head patch (donor rows of head 1), a zero ablation of head 0,
    a mean ablation of both heads in reverse order, and a patch of every
    head (rows ``[n, heads, head_dim]``, as captured), at attention layers
    1..3."""
    donor = hf.points(llm.get_tokenizer()(DONOR)["input_ids"])
    mean = head_rows(donor["attn_z.3"], [1, 0]).mean(0)
    return [
        {"point": "attn_z.2", "op": "patch", "heads": [1],
         "rows": head_rows(donor["attn_z.2"][2:6], [1]).numpy(),
         "positions": {"start": 2, "end": 6}},
        {"point": "blocks.1.attn.hook_z", "op": "ablate_heads", "heads": [0]},
        {"point": "attn_z.3", "op": "ablate_heads", "heads": [1, 0], "mode": "mean",
         "mean": mean.tolist()},
        patch("attn_z.1", donor["attn_z.1"][3:5].float(), 3),
    ]  # fmt: skip


def test_per_head_patches_and_ablations_share_a_batch_each_exact(llm, hf_qwen3):
    """Each per-head write matches HF forward pre-hooks on o_proj replacing
    the same columns, in one batch with an unpatched request."""
    items = per_head_items(llm, hf_qwen3)
    plain = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, return_hidden_states=True,
        hidden_states_layers=list(range(5)), hidden_states_positions="all",
    )  # fmt: skip
    outs = llm.generate(
        [PROMPT] * (len(items) + 1), [params([x]) for x in items] + [plain], use_tqdm=False
    )
    for out, item in zip(outs, items):
        what = f"{item['op']} at {item['point']} heads {item.get('heads', 'all')} in a batch"
        assert_like_hf(out, hf_qwen3, [head_reference(item, hf_qwen3)], what)
    expected = hf_qwen3.states(token_ids_of(outs[-1]))
    for layer in range(hf_qwen3.num_layers + 1):
        got = outs[-1].outputs[0].hidden_states[layer]
        assert_close(got, expected[layer], f"unpatched beside per-head patches, layer {layer}")


def test_a_per_head_patch_writes_its_heads_and_keeps_the_others(llm, hf_qwen3):
    """attn_z.2 read after the write: head 1's columns are the given rows
    bit for bit over the window; head 0's, and every column elsewhere, are
    the model's own (HF's)."""
    item = per_head_items(llm, hf_qwen3)[0]
    d = head_dim_of(hf_qwen3)
    (out,) = llm.generate(
        [PROMPT], params([item], hidden_states_points=["attn_z.2"]), use_tqdm=False
    )
    got = out.outputs[0].hidden_states["attn_z.2"]  # [positions, heads, head_dim]
    assert got.shape[1:] == (hf_qwen3.num_heads, d)
    given = torch.from_numpy(item["rows"])[:, 0]
    assert torch.equal(got[2:6, 1], given), "head 1 is not the given rows"
    own = hf_qwen3.points(token_ids_of(out))["attn_z.2"]
    assert_close(got[:, 0], own[:, 0], "head 0 of attn_z.2")
    assert_close(torch.cat([got[:2], got[6:]]), torch.cat([own[:2], own[6:]]), "outside")


def test_the_final_tokens_extract_replays_a_head_ablation(llm, hf_qwen3):
    """ "last" is read by a recomputing extract: it ablates the same heads
    at every position, the final token's included."""
    item = per_head_items(llm, hf_qwen3)[2]
    (out,) = llm.generate([PROMPT], params([item], positions="last"), use_tqdm=False)
    expected = hf_qwen3.steered_states(token_ids_of(out), [head_reference(item, hf_qwen3)])
    for layer in range(hf_qwen3.num_layers + 1):
        assert_close(out.outputs[0].hidden_states[layer], expected[layer][-1:], f"last {layer}")


def test_every_sample_of_n_gets_the_per_head_writes(llm, hf_qwen3):
    """n=2, sampled: each choice's stream has head 1 of attn_z.2 patched and
    head 0 of attn_z.1 ablated, as HF's hooks on o_proj do over that
    choice's tokens."""
    items = per_head_items(llm, hf_qwen3)[:2]
    (out,) = llm.generate([PROMPT], params(items, n=2, temperature=1.0, seed=7), use_tqdm=False)
    references = [head_reference(item, hf_qwen3) for item in items]
    for choice in range(2):
        assert_like_hf(out, hf_qwen3, references, f"per-head writes, sample {choice}", choice)


def test_a_per_head_patch_across_chunks_of_a_long_prefill_is_exact(llm, hf_qwen3):
    """Chunked prefill at 64 tokens: head 1 of attn_z.2 is patched over
    positions 60..69, partly in each of two chunks."""
    prompt = " ".join([PROMPT] * 8)
    n = len(llm.get_tokenizer()(prompt)["input_ids"])
    assert n > 80, n
    rows = torch.randn(10, 1, head_dim_of(hf_qwen3), generator=torch.Generator().manual_seed(4))
    item = {"point": "attn_z.2", "op": "patch", "heads": [1], "rows": rows.numpy(),
            "positions": {"start": 60, "end": 70}}  # fmt: skip
    (out,) = llm.generate([prompt], params([item]), use_tqdm=False)
    assert_like_hf(out, hf_qwen3, [head_reference(item, hf_qwen3)], "per-head patch in chunks")


def _bad_head_items(d: int) -> list[tuple[dict, tuple[str, ...]]]:
    nan_rows = np.zeros((2, 1, d), np.float32)
    nan_rows[1, 0, 3] = np.nan
    window = {"start": 0, "end": 2}
    return [
        ({"point": "attn_z.1", "op": "ablate_heads", "heads": [2]},
         ("head 2 is out of range", "0..1")),
        ({"point": "attn_z.1", "op": "ablate_heads", "heads": [1, 1]}, ("head 1 is given twice",)),
        ({"point": "attn_z.1", "op": "patch", "heads": [0], "rows": np.zeros((2, 2, d)),
          "positions": window}, (f"[n, 1, {d}]", "got shape [2, 2, 64]")),
        ({"point": "attn_z.1", "op": "patch", "heads": [0], "rows": nan_rows,
          "positions": window}, ("must be finite",)),
        ({"point": "resid_pre.1", "op": "patch", "heads": [0], "rows": np.zeros((2, 1, d)),
          "positions": window}, ("heads selects attention heads of an attn_z point",)),
        ({"point": "resid_pre.1", "op": "ablate_heads", "heads": [0]}, ("its point is attn_z",)),
        ({"point": "attn_z.1", "op": "ablate_heads", "heads": [0], "mode": "one"},
         ("must be one of ['zero', 'mean']",)),
        ({"point": "attn_z.1", "op": "ablate_heads", "heads": [0], "mode": "mean"},
         (f"needs mean: [1, {d}]",)),
        ({"point": "attn_z.1", "op": "ablate_heads", "heads": [0], "mode": "mean",
          "mean": np.zeros((2, d))}, (f"must be [1, {d}]", "got shape [2, 64]")),
        ({"point": "attn_z.1", "op": "ablate_heads", "heads": [0], "mean": np.zeros((1, d))},
         ("mean belongs to mode 'mean'",)),
        ({"point": "attn_z.1", "vector": [1.0] * 128}, ("attn_z cannot be steered by 'add'",)),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(11))
def test_bad_per_head_interventions_are_refused_naming_what_is_allowed(llm, hf_qwen3, case):
    item, needles = _bad_head_items(head_dim_of(hf_qwen3))[case]
    refused(llm, [item], "steering[0].", *needles)


# -- refusals: before the engine sees the request ------------------------------


def refused(llm, steering: list[dict], *needles: str) -> None:
    with pytest.raises(VLLMValidationError) as e:
        llm.generate([PROMPT], params(steering), use_tqdm=False)
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_a_row_count_unlike_the_window_is_refused(llm, hf_qwen3):
    rows = np.zeros((3, hf_qwen3.hidden_size), np.float32)
    item = {
        "point": "resid_pre.2",
        "op": "patch",
        "rows": rows,
        "positions": {"start": 0, "end": 4},
    }
    refused(llm, [item], "has 3 rows", "0..3 are 4")


def test_rows_of_the_wrong_width_are_refused_naming_hidden_size(llm, hf_qwen3):
    h = hf_qwen3.hidden_size
    refused(llm, [patch("resid_pre.2", torch.zeros(2, h + 1), 0)], f"must be [n, {h}]")


def test_non_finite_rows_are_refused(llm, hf_qwen3):
    rows = torch.zeros(2, hf_qwen3.hidden_size)
    rows[1, 0] = float("nan")
    refused(llm, [patch("resid_pre.2", rows, 0)], "must be finite")


def test_more_rows_than_the_table_holds_are_refused_naming_the_flag(llm, hf_qwen3):
    rows = torch.zeros(PATCH_ROWS + 1, hf_qwen3.hidden_size)
    refused(llm, [patch("resid_pre.2", rows, 0)], f"holds {PATCH_ROWS} rows", "--max-patch-rows")


def test_a_patch_beside_another_intervention_at_its_point_is_refused(llm, hf_qwen3):
    h = hf_qwen3.hidden_size
    add = {"point": "resid_pre.2", "vector": [1.0] * h}
    refused(llm, [patch("resid_pre.2", torch.zeros(2, h), 0), add], "only intervention")


def test_a_stored_rows_reference_is_refused_off_http(llm):
    item = {"point": "resid_pre.2", "op": "patch", "stored": {"request_id": "x"}}
    refused(llm, [item], "resolved by the API server")


def test_a_splice_edit_of_an_unknown_feature_is_refused(llm):
    refused(llm, [{"op": "sae_splice", "edits": [{"feature": D_SAE, "set": 1.0}]}],
            f"0..{D_SAE - 1}")  # fmt: skip


def test_the_engine_keeps_serving_after_refusals(llm, hf_qwen3):
    (out,) = llm.generate([PROMPT], params([{"op": "sae_splice"}]), use_tqdm=False)
    assert out.outputs[0].hidden_states[0].shape[0] == len(token_ids_of(out))
