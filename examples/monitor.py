# SPDX-License-Identifier: Apache-2.0
"""Monitor and act: a probe trained on harvested states, served as a monitor
that stops generations, on every request of the server, and a request's own
probe action that steers a generation away before the monitor fires.

    .venv/bin/python examples/monitor.py [--out DIR] [--threshold 0.99] [--steer-at 0.9]

On ``make serve``'s model (the tiny random-weight Qwen3, no downloads):

1. harvest and train the "machines" probe of ``examples/probe_loop.py``
   (a server as ``make serve`` starts it; a numpy logistic regression);
2. restart the server with ``--probes DIR --monitors monitors.yaml``: one
   monitor, ``stop`` when the probe's probability passes ``--threshold``;
3. generate three times with the official ``openai`` client, asking for the
   probe's scores on every generated token (the monitor itself is never
   seen by the client): as the model goes; steered along the probe
   direction from the start (the request's ``steering``, which raises the
   score); and with the request's own ``probe_actions`` entry
   ``{"probe": "machines", "above": --steer-at, "then": {"steer": [...]}}``
   that steers away from the probe (the second run's direction, negated,
   sized to move the logit down by ``--steer-shift``) from the position
   after the first one whose score passes the lower level ``--steer-at``.
   The monitor decides in the engine: a generation that crosses
   ``--threshold`` stops right after the crossing token, with
   ``stop_reason`` the monitor's name. The steer action is decided in the
   worker, in the step that scores the position (``make serve``'s server
   has ``--enable-steering``, every ``resid_pre`` steerable); the response
   reports its firing (``probe_actions``: position, score, ``then``
   "steer"), and the rest of that generation is steered: its scores drop
   and the monitor does not stop it;
4. write ``monitor.png`` (scores per token, the two levels, a dotted line
   where a generation stopped, a dashed one where the steer action fired)
   and ``monitor.json`` under ``--out``.

On the tiny model the steer run keeps the tokens of the first run (its
greedy choices do not move); the states it scores are the steered ones
(exact): after the firing the probe's logit is ``--steer-shift`` lower at
every position, and where the first run stops it runs to ``--max-tokens``.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from probe_loop import (
    LAYER,
    PROBE,
    Server,
    dataset,
    free_port,
    harvest,
    steering_along,
    train_logistic,
)

MONITOR = "machines-stop"
PROMPT = "I saw a cat today and"
AS_GENERATED = "as generated"
STEERED_ALONG = "steered along the probe"
STEERED_AWAY = "steered away by a probe action"


def generate(base_url: str, model: str, max_tokens: int, steering=None, actions=None) -> dict:
    """One monitored completion: its tokens, the probe's score of each
    generated position fed back, how it finished, and the firings of the
    request's own ``actions`` (the server monitor's are never returned)."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=300.0)
    extra: dict = {
        "probes": [PROBE],
        "hidden_states_positions": "generated",
        "return_token_ids": True,
        "ignore_eos": True,
    }
    if steering is not None:
        extra["steering"] = steering
    if actions is not None:
        extra["probe_actions"] = actions
    res = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0, extra_body=extra
    )
    choice = res.choices[0].model_extra
    scores = np.asarray(choice["probe_scores"][PROBE]["data"], dtype=np.float64)[:, 0]
    return {
        "prompt_tokens": len(choice["prompt_token_ids"]),
        "tokens": list(choice["token_ids"]),
        "scores": scores.tolist(),
        "finish_reason": res.choices[0].finish_reason,
        "stop_reason": choice.get("stop_reason"),
        "firings": list(choice.get("probe_actions") or []),
    }


def steer_away(steering: list[dict], steer_at: float) -> list[dict]:
    """A ``probe_actions`` list: once the probe's score passes ``steer_at``,
    add the negative of ``steering``'s vectors (the ``steering`` field's
    form, ``"op": "add"``, no ``positions``: a steer action runs from the
    position after the firing one to the end)."""
    then = [
        {
            "point": item["point"],
            "op": "add",
            "vector": [-v for v in item["vector"]],
            "strength": item["strength"],
        }
        for item in steering
    ]
    return [{"probe": PROBE, "above": steer_at, "then": {"steer": then}}]


def steer_firing(run: dict) -> dict | None:
    """The run's steer firing, with ``index``: its generated token's index."""
    for firing in run["firings"]:
        if firing["then"] == "steer":
            return {**firing, "index": firing["position"] - run["prompt_tokens"]}
    return None


def plot(path: Path, runs: dict[str, dict], threshold: float, steer_at: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 3.5))
    for label, run in runs.items():
        (line,) = ax.plot(run["scores"], marker="o", label=label)
        if run["stop_reason"] == MONITOR:
            ax.axvline(len(run["scores"]) - 1, color=line.get_color(), linestyle=":")
        steer = steer_firing(run)
        if steer is not None:
            ax.axvline(steer["index"], color=line.get_color(), linestyle="--", label="steer fired")
    ax.axhline(threshold, color="black", linewidth=1, label=f"{MONITOR}: stop above")
    ax.axhline(steer_at, color="gray", linewidth=1, linestyle="--", label="steer away above")
    ax.set_xlabel("generated token")
    ax.set_ylabel(f"P({PROBE}) at layer {LAYER}")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="monitor_out", help="where the files go")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--model", default=None, help="a model to serve instead of the tiny one")
    parser.add_argument("--threshold", type=float, default=0.99, help="the monitor's stop level")
    parser.add_argument(
        "--steer-at", type=float, default=0.9, help="the probe action's steer-away level"
    )
    parser.add_argument("--shift", type=float, default=4.0, help="steering: logit shift")
    parser.add_argument(
        "--steer-shift", type=float, default=8.0, help="the steer action: logit shift down"
    )
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--eager", action="store_true", help="--enforce-eager (starts faster)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = args.port or free_port()
    model = "tiny-qwen3" if args.model is None else args.model
    flags = ["--enforce-eager"] if args.eager else []

    texts, labels = dataset()
    with Server(port, flags, out / "server-harvest.log", args.model) as server:
        x = harvest(server.base_url, model, texts)
    w, b, mean, scale = train_logistic(x, labels)
    from vllm_hidden_states.probes import save_probe

    probes_dir = out / "probes"
    save_probe(
        probes_dir / f"{PROBE}.safetensors", w, [b], str(LAYER), "sigmoid", mean=mean, scale=scale
    )
    monitors = out / "monitors.json"
    monitors.write_text(
        json.dumps([{"name": MONITOR, "probe": PROBE, "above": args.threshold, "then": "stop"}])
    )
    steering = steering_along(w, scale, args.shift)
    serve = [*flags, "--probes", str(probes_dir), "--monitors", str(monitors)]
    with Server(port, serve, out / "server-monitor.log", args.model) as server:
        actions = steer_away(steering_along(w, scale, args.steer_shift), args.steer_at)
        runs = {
            AS_GENERATED: generate(server.base_url, model, args.max_tokens),
            STEERED_ALONG: generate(server.base_url, model, args.max_tokens, steering),
            STEERED_AWAY: generate(server.base_url, model, args.max_tokens, actions=actions),
        }
    for label, run in runs.items():
        how = (
            f"stopped by {run['stop_reason']} after {len(run['tokens'])} tokens"
            if run["stop_reason"] == MONITOR
            else f"{run['finish_reason']} after {len(run['tokens'])} tokens"
        )
        steer = steer_firing(run)
        if steer is not None:
            how += (
                f"; steer fired at generated token {steer['index']} (position"
                f" {steer['position']}, score {steer['score']:.3f})"
            )
        print(f"{label}: {how}; scores " + " ".join(f"{s:.2f}" for s in run["scores"]))
    plot(out / "monitor.png", runs, args.threshold, args.steer_at)
    summary = {
        "threshold": args.threshold,
        "steer_at": args.steer_at,
        "shift": args.shift,
        "steer_shift": args.steer_shift,
        "max_tokens": args.max_tokens,
        "runs": runs,
    }
    (out / "monitor.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {out / 'monitor.png'} and {out / 'monitor.json'}")
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
