# SPDX-License-Identifier: Apache-2.0
"""SAELens-format SAE loading and the top-k encoder vs a float64 numpy reference.

Random SAEs are written by the tests in the on-disk format SAELens's
``save_model`` produces (``cfg.json`` + ``sae_weights.safetensors``).
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from vllm_hidden_states.sae import (  # noqa: E402
    encode_topk,
    encode_topk_numpy,
    layer_of_hook,
    load_sae,
    save_sae,
)

D_IN, D_SAE, N = 64, 512, 40


def random_sae(tmp_path, architecture="standard", seed=0, **cfg_extra):
    from vllm_hidden_states.sae import random_sae as make

    weights, cfg = make(
        D_IN, D_SAE, "blocks.2.hook_resid_post", architecture, seed, device="cpu", **cfg_extra
    )
    path = save_sae(tmp_path / f"sae-{architecture}-{seed}", weights, cfg)
    return path, {k: v.numpy() for k, v in weights.items()}, cfg


def assert_topk_matches(ids, values, ref_ids, ref_values):
    """Values equal within 1e-4 relative; ids equal wherever the reference's
    neighbouring values are not a near-tie (float32 vs float64 may swap those)."""
    ids, values = ids.numpy(), values.numpy()
    assert ids.dtype == np.int32 and values.dtype == np.float32
    assert ids.shape == ref_ids.shape
    scale = np.abs(ref_values).max()
    np.testing.assert_allclose(values, ref_values, atol=1e-4 * scale, rtol=0)
    gaps = np.abs(np.diff(ref_values, axis=1, prepend=np.inf, append=-np.inf))
    clear = np.minimum(gaps[:, :-1], gaps[:, 1:]) > 1e-4 * scale
    active = ref_values > 0
    assert clear[active].mean() > 0.9  # the check below is not vacuous
    clear |= ~active  # empty slots: id -1 on both sides
    assert np.array_equal(ids[clear], ref_ids[clear])


@pytest.mark.parametrize(
    "architecture,extra",
    [
        ("standard", {}),
        ("jumprelu", {}),
        ("topk", {"k": 16}),
        ("standard", {"normalize_activations": "constant_norm_rescale"}),
        ("standard", {"normalize_activations": "layer_norm", "apply_b_dec_to_input": False}),
    ],
)
def test_topk_features_match_numpy_reference(tmp_path, architecture, extra):
    path, weights, cfg = random_sae(tmp_path, architecture, **extra)
    sae = load_sae(path)
    x = torch.randn(N, D_IN, generator=torch.Generator().manual_seed(1)) * 3
    for k in (1, 8, 20):
        ids, values = encode_topk(x, sae, k)
        ref_ids, ref_values = encode_topk_numpy(x.numpy(), weights, cfg, k)
        assert_topk_matches(ids, values, ref_ids, ref_values)


def test_inactive_slots_are_minus_one_with_zero_value(tmp_path):
    path, weights, cfg = random_sae(tmp_path, "topk", k=4)
    sae = load_sae(path)
    x = torch.randn(N, D_IN, generator=torch.Generator().manual_seed(2))
    ids, values = encode_topk(x, sae, 10)  # a topk-4 SAE has at most 4 active
    assert (ids[:, 4:] == -1).all() and (values[:, 4:] == 0).all()
    assert ((ids >= 0) == (values > 0)).all()
    ref_ids, ref_values = encode_topk_numpy(x.numpy(), weights, cfg, 10)
    assert_topk_matches(ids, values, ref_ids, ref_values)


def test_bfloat16_input_and_sae_dtype(tmp_path):
    path, weights, cfg = random_sae(tmp_path)
    sae = load_sae(path)
    x = torch.randn(N, D_IN, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    ids, values = encode_topk(x, sae, 8)  # encoded in the SAE's float32
    ref_ids, ref_values = encode_topk_numpy(x.float().numpy(), weights, cfg, 8)
    assert_topk_matches(ids, values, ref_ids, ref_values)


def test_layer_from_hook_name_and_override(tmp_path):
    assert layer_of_hook("blocks.2.hook_resid_post") == 3
    assert layer_of_hook("blocks.2.hook_resid_pre") == 2
    assert layer_of_hook("blocks.2.attn.hook_z") is None
    path, _, _ = random_sae(tmp_path)
    assert load_sae(path).layer == 3
    assert load_sae(path, layer=-2).layer == -2
    # SAELens <= 5: hook fields at the top level
    cfg = json.loads((path / "cfg.json").read_text())
    cfg.pop("metadata")
    cfg["hook_name"] = "blocks.0.hook_resid_pre"
    (path / "cfg.json").write_text(json.dumps(cfg))
    sae = load_sae(path, name="my-release")
    assert sae.layer == 0 and sae.name == "my-release"


def test_log_threshold_is_exponentiated(tmp_path):
    path, weights, cfg = random_sae(tmp_path, "jumprelu")
    from safetensors.torch import load_file, save_file

    w = load_file(str(path / "sae_weights.safetensors"))
    w["log_threshold"] = w.pop("threshold").log()
    save_file(w, str(path / "sae_weights.safetensors"))
    sae = load_sae(path)
    np.testing.assert_allclose(sae.threshold.numpy(), weights["threshold"], rtol=1e-6)


def test_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="cfg.json"):
        load_sae(tmp_path)
    path, _, _ = random_sae(tmp_path, architecture="standard")
    cfg = json.loads((path / "cfg.json").read_text())
    (path / "cfg.json").write_text(json.dumps({**cfg, "architecture": "gated"}))
    with pytest.raises(ValueError, match="'gated' is not supported; supported: standard"):
        load_sae(path)
    (path / "cfg.json").write_text(json.dumps({**cfg, "d_in": D_IN + 1}))
    with pytest.raises(ValueError, match=r"W_enc has shape \(64, 512\); expected \(65, 512\)"):
        load_sae(path)
    (path / "cfg.json").write_text(json.dumps({**cfg, "architecture": "jumprelu"}))
    with pytest.raises(ValueError, match="missing tensor 'threshold'"):
        load_sae(path)
    (path / "cfg.json").write_text(json.dumps(cfg))
    sae = load_sae(path)
    with pytest.raises(ValueError, match="top_k must be in 1..512"):
        encode_topk(torch.zeros(1, D_IN), sae, 0)
    with pytest.raises(ValueError, match=r"expected \[n, 64\]"):
        encode_topk(torch.zeros(1, D_IN + 1), sae, 4)


def test_tiny_sae_command_writes_an_sae_that_loads_at_its_layer(tmp_path):
    import json

    from vllm_hidden_states.sae import load_sae
    from vllm_hidden_states.tools.cli import main

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 16}))
    assert (
        main(
            [
                "tiny-sae",
                str(tmp_path / "sae"),
                "--model",
                str(model),
                "--layer",
                "2",
                "--d-sae",
                "32",
            ]
        )
        == 0
    )
    sae = load_sae(tmp_path / "sae")
    assert (sae.layer, sae.d_in, sae.d_sae) == (2, 16, 32)


def test_random_sae_refuses_a_negative_layer(tmp_path):
    from vllm_hidden_states.sae import build_random_sae

    with pytest.raises(ValueError, match="absolute index"):
        build_random_sae(tmp_path / "sae", d_in=16, layer=-1)
