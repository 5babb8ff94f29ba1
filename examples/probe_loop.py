# SPDX-License-Identifier: Apache-2.0
"""The probe loop: harvest states, train a probe, serve it, watch it, steer it.

    .venv/bin/python examples/probe_loop.py [--out DIR] [--port 8011]

On ``make serve``'s model (the tiny random-weight Qwen3, no downloads):

1. start the server as ``make serve`` does and harvest the state at HF layer
   :data:`LAYER` of the last prompt token of a labelled toy dataset (sentences
   about animals vs. sentences about machines) over the HTTP API;
2. train a logistic-regression probe on them in numpy (inputs normalised by
   the training mean and scale) and save it in the probe format
   (``vllm_hidden_states.probes.save_probe``);
3. restart the server with ``--probes DIR`` and stream the probe's score for
   every generated token (``probes`` + ``hidden_states_stream`` on a
   streamed completion, with the official ``openai`` client);
4. steer along the probe direction (``steering``: ``add`` at the point the
   probe reads, sized to move its logit there by ``--shift``) and stream
   again: the scores move up;
5. write ``probe_loop.png`` (the two score curves) and ``probe_loop.json``
   (accuracies and mean scores) under ``--out``.

The model's weights are random, so what the probe "detects" is which word
list a sentence's tokens came from; the loop is the same on a real model
(``--model``).
"""

import argparse
import base64
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

LAYER = 2  # HF convention: the stream entering decoder layer 2 (resid_pre.2)
PROBE = "machines"
ANIMALS = ["cat", "dog", "horse", "bird", "fish", "mouse", "lion", "sheep", "cow", "fox"]
MACHINES = [
    "robot",
    "engine",
    "computer",
    "car",
    "train",
    "clock",
    "radio",
    "phone",
    "motor",
    "lamp",
]
TEMPLATES = [
    "the {} was here",
    "I saw a {} today",
    "there is a {} in the house",
    "my friend has a {}",
    "a small {} moved",
    "look at that {}",
]


def dataset() -> tuple[list[str], np.ndarray]:
    """Sentences and labels (1: a machine)."""
    texts, labels = [], []
    for template in TEMPLATES:
        for word in ANIMALS:
            texts.append(template.format(word))
            labels.append(0)
        for word in MACHINES:
            texts.append(template.format(word))
            labels.append(1)
    return texts, np.array(labels, dtype=np.float64)


# --------------------------------------------------------------------------
# The server, as `make serve` starts it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``make serve``'s command (``vllm_hidden_states.tools.serve``) in a
    child process, plus ``extra`` flags; stopped on exit."""

    def __init__(self, port: int, extra: list[str], log: Path, model: str | None = None):
        from vllm_hidden_states.tools.serve import build_command

        argv, env = build_command(model, port, extra, cuda=False)
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            argv, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout: float = 600.0) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the server exited ({self.process.returncode}); see {self.log.name}"
                )
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server did not start within {timeout:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()

    def __enter__(self) -> "Server":
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------
# 1. harvest, 2. train


def harvest(base_url: str, model: str, texts: list[str]) -> np.ndarray:
    """``[len(texts), hidden]``: the state at :data:`LAYER` of each text's
    last prompt token (``hidden_states_positions: "prompt"``, base64)."""
    rows = []
    with httpx.Client(base_url=base_url, timeout=300.0) as client:
        for text in texts:
            body = {
                "model": model,
                "prompt": text,
                "max_tokens": 1,
                "return_hidden_states": True,
                "hidden_states_layers": [LAYER],
                "hidden_states_positions": "prompt",
                "hidden_states_format": "base64",
            }
            r = client.post("/v1/completions", json=body)
            r.raise_for_status()
            obj = r.json()["choices"][0]["hidden_states"]
            states = np.frombuffer(base64.b64decode(obj["data"]), "<f4").reshape(obj["shape"])
            rows.append(states[0, -1])  # [layers, positions, hidden]: the last prompt token
    return np.stack(rows).astype(np.float64)


def train_logistic(
    x: np.ndarray, y: np.ndarray, steps: int = 500, lr: float = 0.5, l2: float = 1e-3
):
    """Logistic regression by gradient descent on normalised inputs; returns
    ``(weight [hidden], bias, mean [hidden], scale [hidden])``."""
    mean = x.mean(axis=0)
    scale = x.std(axis=0) + 1e-6
    z = (x - mean) / scale
    w = np.zeros(x.shape[1])
    b = 0.0
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-(z @ w + b)))
        grad = p - y
        w -= lr * (z.T @ grad / len(y) + l2 * w)
        b -= lr * grad.mean()
    return w, b, mean, scale


def accuracy(x, y, w, b, mean, scale) -> float:
    p = 1.0 / (1.0 + np.exp(-(((x - mean) / scale) @ w + b)))
    return float(((p > 0.5) == (y > 0.5)).mean())


# --------------------------------------------------------------------------
# 3. serve the probe, 4. steer along it


def steering_along(w: np.ndarray, scale: np.ndarray, shift: float) -> list[dict]:
    """The steering item that moves the probe's logit by ``shift`` at every
    position: the direction that raises the score in the raw stream is
    d(logit)/dx = w / scale, added as a unit vector at the point the probe
    reads with the strength that shifts the logit there by ``shift``."""
    direction = w / scale
    strength = shift / np.linalg.norm(direction)
    return [
        {
            "point": f"resid_pre.{LAYER}",
            "op": "add",
            "vector": (direction / np.linalg.norm(direction)).astype(np.float32).tolist(),
            "strength": float(strength),
            "positions": "all",
        }
    ]


def stream_scores(
    base_url: str, model: str, prompt: str, steering=None, max_tokens=24
) -> list[float]:
    """The probe's score of every generated token, read off the SSE chunks
    of a streamed completion (official ``openai`` client)."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=300.0)
    extra = {
        "probes": [PROBE],
        "hidden_states_positions": "generated",
        "hidden_states_stream": True,
    }
    if steering is not None:
        extra["steering"] = steering
    scores: list[float] = []
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body=extra,
    )
    for chunk in stream:
        for choice in chunk.choices:
            obj = (choice.model_extra or {}).get("probe_scores")
            if obj:
                scores += np.asarray(obj[PROBE]["data"], dtype=np.float64)[:, 0].tolist()
    return scores


def plot(path: Path, plain: list[float], steered: list[float], shift: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(plain, marker="o", label="as generated")
    ax.plot(
        steered, marker="o", label=f"steered along the probe (logit +{shift:g} at layer {LAYER})"
    )
    ax.set_xlabel("generated token")
    ax.set_ylabel(f"P({PROBE}) from the probe at layer {LAYER}")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default="probe_loop_out", help="where the probe, plot and summary go"
    )
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--model", default=None, help="a model to serve instead of the tiny one")
    parser.add_argument(
        "--shift",
        type=float,
        default=2.0,
        help="how far steering moves the probe's logit at its own point",
    )
    parser.add_argument(
        "--eager", action="store_true", help="serve with --enforce-eager (starts faster)"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = args.port or free_port()
    model = "tiny-qwen3" if args.model is None else args.model

    flags = ["--enforce-eager"] if args.eager else []
    texts, labels = dataset()
    with Server(port, flags, out / "server-harvest.log", args.model) as server:
        x = harvest(server.base_url, model, texts)
    print(f"harvested {x.shape[0]} states of width {x.shape[1]} at layer {LAYER}")

    order = np.random.default_rng(0).permutation(len(texts))
    train, test = order[: len(order) * 3 // 4], order[len(order) * 3 // 4 :]
    w, b, mean, scale = train_logistic(x[train], labels[train])
    acc_train = accuracy(x[train], labels[train], w, b, mean, scale)
    acc_test = accuracy(x[test], labels[test], w, b, mean, scale)
    print(f"probe accuracy: train {acc_train:.2f}, held out {acc_test:.2f}")

    from vllm_hidden_states.probes import save_probe

    probes_dir = out / "probes"
    save_probe(
        probes_dir / f"{PROBE}.safetensors", w, [b], str(LAYER), "sigmoid", mean=mean, scale=scale
    )

    steering = steering_along(w, scale, args.shift)
    prompt = "I saw a cat today and"
    with Server(
        port, [*flags, "--probes", str(probes_dir)], out / "server-probes.log", args.model
    ) as server:
        listed = httpx.get(server.base_url + "/v1/probes").json()["data"]
        print("served probes:", [(p["name"], p["point"], p["output"]) for p in listed])
        plain = stream_scores(server.base_url, model, prompt)
        steered = stream_scores(server.base_url, model, prompt, steering)
    print("scores per generated token:", " ".join(f"{s:.2f}" for s in plain))
    print("steered along the probe:  ", " ".join(f"{s:.2f}" for s in steered))

    plot(out / "probe_loop.png", plain, steered, args.shift)
    summary = {
        "layer": LAYER,
        "train_accuracy": acc_train,
        "held_out_accuracy": acc_test,
        "tokens": len(plain),
        "mean_score": float(np.mean(plain)),
        "mean_score_steered": float(np.mean(steered)),
        "scores": plain,
        "scores_steered": steered,
    }
    (out / "probe_loop.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {out / 'probe_loop.png'} and {out / 'probe_loop.json'}")
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
