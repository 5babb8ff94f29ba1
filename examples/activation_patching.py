# SPDX-License-Identifier: Apache-2.0
"""Activation patching against a running server: where does the answer live?

A clean and a corrupted prompt of the same length differ in one name, and so
in their answer. The clean run's residual stream (``resid_pre.k`` at every
position) is captured into the server's activation store; then, for each
layer ``k`` and position ``p``, the corrupted run is repeated with that one
row replaced by the clean run's, by reference to the stored rows (no
tensor through the client). The logit difference of the two answers,
``log p(clean answer) - log p(corrupted answer)`` at the last position, is
read from the prompt's logprobs; its recovery per (layer, position),
``(patched - corrupted) / (clean - corrupted)``, is plotted as a PNG.

    make serve SERVE_ARGS="--activation-store .activation-store --activation-store-hidden-states"
    .venv/bin/python examples/activation_patching.py [--base-url http://127.0.0.1:8000/v1]
"""

import argparse
import asyncio
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# One word differs (a token each in make serve's tiny vocabulary, and in most
# real ones); each prompt's answer repeats it. With a real model, try an
# indirect-object pair such as "When Mary and John went to the store, John
# gave a drink to" / "... Mary gave ..." with " Mary" / " John".
CLEAN = "The model splits the prompt into two tokens and the sky has two"
CORRUPTED = "The model splits the prompt into six tokens and the sky has six"
CLEAN_ANSWER, CORRUPTED_ANSWER = " two", " six"


@dataclass
class Sweep:
    """The sweep's numbers: ``diff[k, p]``, the logit difference with
    ``resid_pre.k`` at position ``p`` patched from the clean run; the clean
    and corrupted runs' own."""

    layers: list[int]  # the rows of diff: resid_pre.k for these k
    diff: np.ndarray  # float64 [layers, positions]
    clean: float
    corrupted: float

    @property
    def recovery(self) -> np.ndarray:
        return (self.diff - self.corrupted) / (self.clean - self.corrupted)


async def answer_logprob(client, model: str, prompt_ids: list[int], steering=None) -> float:
    """``log p(prompt_ids[-1] | prompt_ids[:-1])``, by the server's prompt
    logprobs (with ``steering`` applied to the forward)."""
    extra: dict = {"prompt_logprobs": 0}
    if steering:
        extra["steering"] = steering
    out = await client.completions.create(
        model=model, prompt=prompt_ids, max_tokens=1, temperature=0.0, extra_body=extra
    )
    last = out.choices[0].model_extra["prompt_logprobs"][-1]
    return float(last[str(prompt_ids[-1])]["logprob"])


async def logit_diff(client, model, clean_ids, corrupt_ids, prompt_ids, steering=None) -> float:
    """log p(clean answer) - log p(corrupted answer) after ``prompt_ids``."""
    a, b = await asyncio.gather(
        answer_logprob(client, model, [*prompt_ids, clean_ids], steering),
        answer_logprob(client, model, [*prompt_ids, corrupt_ids], steering),
    )
    return a - b


async def sweep(base_url: str, concurrency: int = 16) -> Sweep:
    """The sweep against the server at ``base_url`` (``/v1``): every layer
    whose ``resid_pre`` the server can steer (GET /v1/steering_vectors)."""
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=600.0)
    root = base_url.removesuffix("/v1")
    async with httpx.AsyncClient(base_url=root, timeout=60.0) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        steerable = (await http.get("/v1/steering_vectors")).json()["points"]

        async def ids_of(text: str) -> list[int]:
            body = {"model": model, "prompt": text, "add_special_tokens": False}
            r = await http.post("/tokenize", json=body)
            r.raise_for_status()
            return r.json()["tokens"]

        clean_ids, corrupt_ids = await ids_of(CLEAN), await ids_of(CORRUPTED)
        # An answer is scored by its first token.
        a, b = (await ids_of(CLEAN_ANSWER))[0], (await ids_of(CORRUPTED_ANSWER))[0]
    layers = sorted(int(p.split(".")[1]) for p in steerable if p.startswith("resid_pre."))
    assert len(clean_ids) == len(corrupt_ids), "the prompts must have the same length"
    n = len(clean_ids)
    # The clean run: its resid_pre.k at every position, stored by the server
    # under the response's id.
    captured = await client.completions.create(
        model=model,
        prompt=clean_ids,
        max_tokens=1,
        temperature=0.0,
        extra_body={
            "return_hidden_states": True,
            "hidden_states_layers": layers,  # layer k is resid_pre.k
            "hidden_states_positions": "all",
        },
    )
    clean = await logit_diff(client, model, a, b, clean_ids)
    corrupted = await logit_diff(client, model, a, b, corrupt_ids)
    gate = asyncio.Semaphore(concurrency)

    async def patched(k: int, p: int) -> float:
        steering = [{
            "op": "patch",
            "point": f"resid_pre.{k}",
            "positions": {"start": p, "end": p + 1},
            "stored": {"request_id": captured.id},
        }]  # fmt: skip
        async with gate:
            return await logit_diff(client, model, a, b, corrupt_ids, steering)

    cells = [(k, p) for k in layers for p in range(n)]
    values = await asyncio.gather(*(patched(k, p) for k, p in cells))
    diff = np.asarray(values, dtype=np.float64).reshape(len(layers), n)
    return Sweep(layers, diff, clean, corrupted)


def plot(result: Sweep, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, positions = result.diff.shape
    fig, ax = plt.subplots(figsize=(2 + 0.45 * positions, 1.5 + 0.45 * rows))
    image = ax.imshow(result.recovery, cmap="RdBu", vmin=-1, vmax=1, aspect="auto")
    ax.set_yticks(range(rows), [str(k) for k in result.layers])
    ax.set_xlabel("position patched")
    ax.set_ylabel("layer k (resid_pre.k)")
    ax.set_title("logit-difference recovery, clean -> corrupted")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--out", default="activation_patching.png")
    args = parser.parse_args()
    result = asyncio.run(sweep(args.base_url))
    print(f"logit difference: clean {result.clean:+.4f}, corrupted {result.corrupted:+.4f}")
    print("recovery per (layer, position):")
    print(np.array2string(result.recovery, precision=2, suppress_small=True))
    print(f"wrote {plot(result, Path(args.out))}")


if __name__ == "__main__":
    main()
