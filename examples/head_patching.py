# SPDX-License-Identifier: Apache-2.0
"""Which attention heads carry the answer? A heads x positions patching
sweep in one call.

    .venv/bin/python examples/head_patching.py [--out DIR] [--base-url URL]

An indirect-object task in the IOI style: "When A and B went to the sky, B
gave a token to" is answered by A; the corrupted prompt swaps the repeated
name, so its answer is B. One ``POST /v1/patch_sweep`` captures the clean
run's heads' outputs (``attn_z.L``, ``[positions, heads, head_dim]``) and
runs the corrupted prompt once per (layer, head, position) cell with that one
head's row replaced by the clean run's, all cells batched in the server; the
logit difference ``log p(A) - log p(B)`` of each cell comes back as a grid.
Rows arrive as server-sent events while the sweep runs (a progress bar).

Without ``--base-url`` it starts ``make serve``'s server (the tiny
random-weight Qwen3, no downloads) with the flags a head sweep needs:
``--enable-steering --steering-points all --hidden-states-points attn_z``.
It writes ``head_patching.png`` (the recovery ``(cell - corrupted) / (clean
- corrupted)`` per layer, heads x positions) and ``head_patching.json``
under ``--out``.

The tiny model's vocabulary has no one-token names, so two one-token words
stand in for them; with a real model (``--model``) use names, e.g. " Mary"
and " John".
"""

import argparse
import json
import sys
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from probe_loop import Server, free_port  # noqa: E402

A, B = " two", " six"
TEMPLATE = "When{a} and{b} went to the sky,{repeated} gave a token to"
CLEAN = TEMPLATE.format(a=A, b=B, repeated=B)  # answer: A
CORRUPTED = TEMPLATE.format(a=A, b=B, repeated=A)  # answer: B
SERVER_FLAGS = ["--enable-steering", "--steering-points", "all", "--hidden-states-points", "attn_z"]


def sweep_heads(base_url: str, model: str, layers: list[int]) -> dict:
    """The sweep's answer (POST /v1/patch_sweep, streamed): ``head_grid``
    ``[layers, heads, positions]`` of logit differences, with the clean and
    corrupted runs' own."""
    from tqdm import tqdm

    body = {
        "model": model,
        "clean": CLEAN,
        "corrupted": CORRUPTED,
        "points": [f"attn_z.{k}" for k in layers],
        "heads": "all",
        "positions": "all",
        "metric": {"logit_diff": [A, B]},
        "stream": True,
    }
    answer = None
    with (
        httpx.Client(base_url=base_url, timeout=3600.0) as http,
        http.stream("POST", "/v1/patch_sweep", json=body) as r,
    ):
        if r.status_code != 200:
            raise SystemExit(f"the sweep was refused ({r.status_code}): {r.read().decode()}")
        bar = None
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if event["object"] == "patch_sweep.row":
                bar = bar or tqdm(total=event["cells_total"], desc="cells", unit="cell")
                bar.update(event["cells_done"] - bar.n)
            else:
                answer = event
        if bar is not None:
            bar.close()
    if answer is None:
        raise SystemExit("the sweep's stream ended without an answer")
    return answer


def plot(answer: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.asarray(answer["head_grid"])  # [layers, heads, positions]
    recovery = (grid - answer["corrupted"]) / (answer["clean"] - answer["corrupted"])
    fig, axes = plt.subplots(
        len(answer["head_points"]), 1, figsize=(8, 1.2 + 0.5 * grid.shape[1] * grid.shape[0])
    )
    for ax, point, rows in zip(np.atleast_1d(axes), answer["head_points"], recovery):
        image = ax.imshow(rows, cmap="RdBu", vmin=-1, vmax=1, aspect="auto")
        ax.set_ylabel(f"{point}\nhead")
        ax.set_yticks(range(len(answer["heads"])), answer["heads"])
    ax.set_xlabel("position patched")
    fig.colorbar(image, ax=axes, label="recovery")
    fig.suptitle("clean head rows patched into the corrupted run")
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="head_patching_out", help="where the plot and JSON go")
    parser.add_argument("--base-url", default=None, help="a running server (else one is started)")
    parser.add_argument("--model", default=None, help="a model to serve instead of the tiny one")
    parser.add_argument("--layers", default=None, help="comma-separated layers (default: all)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = "tiny-qwen3" if args.model is None else args.model

    def run(base_url: str) -> dict:
        if args.layers is not None:
            layers = [int(k) for k in args.layers.split(",")]
        else:
            layers = head_layers(base_url)
        return sweep_heads(base_url, model, layers)

    if args.base_url is not None:
        answer = run(args.base_url)
    else:
        port = free_port()
        with Server(port, SERVER_FLAGS, out / "server.log", args.model) as server:
            answer = run(server.base_url)
    (out / "head_patching.json").write_text(json.dumps(answer))
    plot(answer, out / "head_patching.png")
    grid = np.asarray(answer["head_grid"])
    layer, head, position = np.unravel_index(
        np.abs(grid - answer["corrupted"]).argmax(), grid.shape
    )
    print(
        f"{grid.size} cells; clean {answer['clean']:.3f}, corrupted {answer['corrupted']:.3f}; "
        f"the largest move: {answer['head_points'][layer]} head {answer['heads'][head]} at "
        f"position {answer['positions'][position]}; wrote {out / 'head_patching.png'}"
    )
    return answer


def head_layers(base_url: str) -> list[int]:
    """The layers whose heads the server lets a request patch (GET
    /v1/steering_vectors lists the writable points, attn_z.L among them)."""
    points = httpx.get(f"{base_url}/v1/steering_vectors", timeout=60.0).json()["points"]
    return [int(p.split(".")[1]) for p in points if p.startswith("attn_z.")]


if __name__ == "__main__":
    main()
