# SPDX-License-Identifier: Apache-2.0
"""The architecture audit (docs/architectures.md, vllm_hidden_states/tools/
audit.py): every text-generation architecture in vLLM's registry has a status,
and the doc says what the code does."""

from pathlib import Path

import pytest

from vllm_hidden_states.tools import audit

DOC = Path(__file__).resolve().parents[2] / "docs" / "architectures.md"


@pytest.fixture(scope="module")
def rows() -> list[audit.Row]:
    return audit.audit()


def test_every_registry_architecture_has_a_status(rows):
    missing = [r.architecture for r in rows if r.status is None]
    assert not missing, (
        f"architectures new to vLLM's registry, with no status: {missing}; test them, "
        "or list them in vllm_hidden_states/tools/audit.py (REFUSED or CPU_CANNOT_RUN)"
    )


def test_every_hand_listed_architecture_is_in_the_registry(rows):
    names = {r.architecture for r in rows}
    listed = audit.REFUSED | set(audit.CPU_CANNOT_RUN) | set(audit.NOTES)
    assert listed <= names, sorted(listed - names)


def test_no_tested_architecture_is_also_listed_as_refused(rows):
    exact = {r.architecture for r in rows if r.status in ("tested", "shares")}
    assert not exact & (audit.REFUSED | set(audit.CPU_CANNOT_RUN))


def test_every_architecture_has_its_decoder_layer_classes_or_a_reason(rows):
    found = [r for r in rows if r.layer_classes]
    assert len(found) > 0.85 * len(rows)
    by_name = {r.architecture: r for r in rows}
    assert by_name["Phi3ForCausalLM"].layer_classes == ("LlamaDecoderLayer",)
    assert set(by_name["NemotronHForCausalLM"].layer_classes) == {
        f"NemotronH{k}DecoderLayer" for k in ("Mamba", "Attention", "MLP", "MoE")
    }


def test_the_doc_is_current(rows):
    assert DOC.read_text() == audit.render(rows), (
        "docs/architectures.md is stale: "
        "python -m vllm_hidden_states.tools.audit > docs/architectures.md"
    )


# The multimodal table and `audit MODEL_DIR` (one checkpoint's config.json).


@pytest.fixture(scope="module")
def mm_rows(rows) -> list[audit.MultimodalRow]:
    return audit.multimodal_audit(rows)


def test_every_multimodal_registry_architecture_has_a_row(mm_rows):
    from vllm.model_executor.models import registry

    assert [r.architecture for r in mm_rows] == list(registry._MULTIMODAL_MODELS)


def test_every_tiny_multimodal_checkpoint_names_a_registry_architecture_tested_exact(mm_rows):
    from vllm_hidden_states.tools.tiny_vlms import BF16_VLM_ARCHS, VLM_ARCHS

    assert set(audit.VLM_ARCHITECTURES) == set(VLM_ARCHS) | set(BF16_VLM_ARCHS)
    by_name = {r.architecture: r for r in mm_rows}
    assert {by_name[a].status for a in audit.VLM_ARCHITECTURES.values()} == {"tested"}
    assert sum(r.status == "tested" for r in mm_rows) == len(audit.VLM_ARCHITECTURES)


def test_a_multimodal_wrapper_with_no_language_model_listed_is_refused(mm_rows):
    from vllm_hidden_states.layers import LANGUAGE_MODELS

    unlisted = [r for r in mm_rows if r.wrapper not in LANGUAGE_MODELS]
    assert unlisted and all(r.status == "refused" for r in unlisted)


def test_a_wrapper_around_a_tested_language_model_shares_it(mm_rows):
    by_name = {r.architecture: r for r in mm_rows}
    assert by_name["Qwen2VLForConditionalGeneration"].status == "shares"
    assert by_name["Gemma3nForConditionalGeneration"].status == "refused"


def test_the_summary_counts_exact_text_and_multimodal_architectures(rows, mm_rows):
    text = sum(r.status in ("tested", "shares") for r in rows)
    mm = sum(r.status in ("tested", "shares") for r in mm_rows)
    line = audit.summary(rows, mm_rows)
    assert f"{text} of {len(rows)}" in line and f"{mm} of {len(mm_rows)}" in line
    assert line in DOC.read_text().split("\n\n", 3)[2]


def test_image_prompts_are_tested_exactly_where_layers_says(mm_rows):
    from vllm_hidden_states import layers

    tested = getattr(layers, "IMAGE_PROMPTS_TESTED", frozenset())
    for r in mm_rows:
        assert r.image_prompts == (r.wrapper in tested or r.wrapper.rsplit(".", 1)[1] in tested)


def _gemma3_checkpoint(path: Path) -> Path:
    import transformers

    config = transformers.Gemma3Config(
        text_config=dict(num_hidden_layers=3), vision_config=dict(model_type="siglip_vision_model")
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    config.save_pretrained(path)
    return path


def _llava_checkpoint(path: Path) -> Path:
    import transformers

    text = transformers.LlamaConfig(num_hidden_layers=3)
    config = transformers.LlavaConfig(text_config=text.to_dict())
    config.architectures = ["LlavaForConditionalGeneration"]
    config.save_pretrained(path)
    return path


def _unknown_checkpoint(path: Path) -> Path:
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=3)
    config.architectures = ["FrobnicatorForCausalLM"]
    config.save_pretrained(path)
    return path


def test_audit_of_a_gemma3_checkpoint_finds_every_inner_layer_exact(tmp_path):
    report = audit.checkpoint_report(_gemma3_checkpoint(tmp_path))
    assert report["registry"] == "multimodal"
    assert report["language_model"].endswith("gemma3.Gemma3ForCausalLM")
    assert report["exact_layers"] == [0, 1, 2, 3]
    assert all(layer["layer_class"].endswith("Gemma3DecoderLayer") for layer in report["layers"])


def test_audit_of_a_llava_checkpoint_finds_the_llama_inside_exact(tmp_path):
    report = audit.checkpoint_report(_llava_checkpoint(tmp_path))
    assert report["language_model_from"] == "text_config"
    assert report["language_model"].endswith("llama.LlamaForCausalLM")
    assert report["exact_layers"] == [0, 1, 2, 3]
    assert "resid_mid" in report["layers"][1]["kinds"]


def test_audit_of_an_unknown_architecture_refuses_the_inner_layers_and_says_why(tmp_path):
    report = audit.checkpoint_report(_unknown_checkpoint(tmp_path))
    assert report["registry"] is None and report["vllm_class"] is None
    assert report["exact_layers"] == [0, 3]
    assert set(report["refused_layers"]) == {1, 2}
    assert "not verified" in report["refused_layers"][1]
    assert any("neither vLLM's registry nor HF transformers" in n for n in report["notes"])


def test_the_audit_command_prints_json_for_a_checkpoint_dir(tmp_path, capsys):
    import json

    from vllm_hidden_states.tools import cli

    assert cli.main(["audit", str(_llava_checkpoint(tmp_path)), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["architecture"] == "LlavaForConditionalGeneration"
    assert report["exact_layers"] == [0, 1, 2, 3]


def test_the_audit_command_prints_text_naming_the_refused_layers(tmp_path, capsys):
    from vllm_hidden_states.tools import cli

    assert cli.main(["audit", str(_unknown_checkpoint(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "FrobnicatorForCausalLM (not in vLLM's registry)" in out
    assert "decoder layer 1-2: (class not predicted)" in out
    assert "exact on this model: layers 0 (the embedding output), 3 = -1" in out
