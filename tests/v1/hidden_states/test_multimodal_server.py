# SPDX-License-Identifier: Apache-2.0
"""Chat with an image over HTTP: a real ``vllm serve`` of a tiny LLaVA
checkpoint and the official ``openai`` client, every row against HF's own
``LlavaForConditionalGeneration`` given the same pixels; the image rows are
marked in the choice's ``hidden_states`` (``mm_positions``)."""

import base64
import io

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from vllm_hidden_states.client import to_torch
from vllm_hidden_states.tools.tiny_vlms import build_tiny_vlm

from .conftest import MODELS, HFReference, assert_close
from .server_utils import running_server

MODEL = "tiny-llava"
LAYERS = [0, 2, -1]


@pytest.fixture(scope="module")
def llava_dir():
    return build_tiny_vlm(MODELS / "tiny-llava", arch="llava")


@pytest.fixture(scope="module")
def hf(llava_dir) -> HFReference:
    return HFReference(llava_dir)


@pytest.fixture(scope="module")
def server(llava_dir, tmp_path_factory):
    with running_server(
        llava_dir,
        ["--enable-hidden-states", "--hidden-states-layers", "all", "--max-model-len", "512"],
        tmp_path_factory.mktemp("multimodal-server") / "server.log",
        name=MODEL,
    ) as process:
        yield process


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused")


def picture() -> Image.Image:
    pixels = np.random.RandomState(3).rand(30, 40, 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


def messages(image: Image.Image) -> list[dict]:
    png = io.BytesIO()
    image.save(png, format="PNG")  # lossless: the server decodes these pixels
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is the small robot counting?"},
            ],
        }
    ]


def reference(hf: HFReference, ids: list[int], image: Image.Image) -> tuple:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(hf.model.name_or_path)
    pixels = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    return hf.states(ids, {"pixel_values": pixels})


def image_positions(hf: HFReference, ids: list[int]) -> list[int]:
    token = hf.model.config.image_token_index
    return [i for i, t in enumerate(ids) if t == token]


def test_chat_with_an_image_returns_every_prompt_row_with_the_image_rows_marked(client, hf):
    image = picture()
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages(image),
        max_tokens=3,
        temperature=0.0,
        extra_body={
            "return_hidden_states": True,
            "hidden_states_layers": LAYERS,
            "hidden_states_positions": "prompt",
            "return_token_ids": True,
        },
    )
    ids = r.prompt_token_ids
    obj = r.choices[0].hidden_states
    marked = image_positions(hf, ids)
    assert marked and obj["mm_positions"] == {"image": marked}
    rows = to_torch(obj)
    expected = reference(hf, ids, image)
    for i, layer in enumerate(LAYERS):
        assert_close(rows[i], expected[layer], f"prompt layer {layer}")


def test_a_streamed_chat_with_an_image_ends_with_its_last_row(client, hf):
    """ "last" replays the image in its extract: the final chunk's row is HF's
    at the final token of prompt + output."""
    image = picture()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages(image),
        max_tokens=3,
        temperature=0.0,
        stream=True,
        extra_body={
            "return_hidden_states": True,
            "hidden_states_layers": LAYERS,
            "return_token_ids": True,
        },
    )
    prompt_ids, output_ids, final = None, [], None
    for chunk in stream:
        prompt_ids = getattr(chunk, "prompt_token_ids", None) or prompt_ids
        for choice in chunk.choices:
            output_ids += getattr(choice, "token_ids", None) or []
            if getattr(choice, "hidden_states", None) is not None:
                final = choice.hidden_states
    assert final is not None and prompt_ids
    ids = prompt_ids + output_ids
    assert final["mm_positions"] == {"image": image_positions(hf, prompt_ids)}
    rows = to_torch(final)
    expected = reference(hf, ids, image)
    for i, layer in enumerate(LAYERS):
        assert_close(rows[i], expected[layer][-1], f"last layer {layer}")
    assert torch.is_tensor(rows)
