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
