# SPDX-License-Identifier: Apache-2.0
"""``make serve``: the OpenAI server with hidden states, on a model that needs
no download.

    python -m vllm_hidden_states.tools.serve [--model DIR_OR_ID] [--port 8000] [serve args...]

Without ``--model`` it builds (once) the tiny random-weight Qwen3 of
``tools/tiny_models.py`` under ``$VLLM_HIDDEN_STATES_MODELS`` (default
``.models/`` in a source checkout) and serves it as ``tiny-qwen3``, replacing
itself with ``vllm serve MODEL --enable-hidden-states --enable-steering ...``
(plus, unless given: float32, a 2048-token context, one named steering vector
``example``, and on machines without CUDA a KV cache that fits a small host).
"""

import argparse
import os
import sys
from pathlib import Path

TINY_NAME = "tiny-qwen3"


def models_dir() -> Path:
    """Where the default model is built: ``$VLLM_HIDDEN_STATES_MODELS``, else
    ``.models/`` in a source checkout, else ``~/.cache/vllm-hidden-states/models``."""
    env = os.environ.get("VLLM_HIDDEN_STATES_MODELS")
    if env:
        return Path(env)
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file():
        return checkout / ".models"
    return Path.home() / ".cache" / "vllm-hidden-states" / "models"


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _given(extra: list[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in extra)


def build_command(
    model: str | None,
    port: int,
    extra: list[str],
    cuda: bool,
    host: str = "127.0.0.1",
) -> tuple[list[str], dict[str, str]]:
    """The ``vllm serve`` argv and the environment defaults to run it with."""
    env: dict[str, str] = {}
    defaults: list[tuple[str, str | None]] = [
        ("--enable-hidden-states", None),
        ("--enable-steering", None),
    ]
    if model is None:
        from vllm_hidden_states.tools.tiny_models import build_tiny_model

        model = str(build_tiny_model(models_dir() / TINY_NAME, arch="qwen3"))
        defaults += [
            ("--dtype", "float32"),
            ("--max-model-len", "2048"),
            ("--served-model-name", TINY_NAME),
            ("--steering-vectors", str(example_vectors(Path(model)))),
        ]
    if not cuda:
        defaults += [("--max-model-len", "2048"), ("--gpu-memory-utilization", "0.3")]
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model]
    argv += ["--host", host, "--port", str(port)]
    seen: set[str] = set()
    for flag, value in defaults:
        if flag in seen or _given(extra, flag):
            continue
        seen.add(flag)
        argv += [flag] if value is None else [flag, value]
    return argv + extra, env


def example_vectors(model_dir: Path) -> Path:
    """A ``--steering-vectors`` directory for the tiny model, made once:
    ``example.safetensors``, one random ``[hidden_size]`` vector (seed 0)."""
    import json

    directory = model_dir.parent / f"{model_dir.name}-steering-vectors"
    path = directory / "example.safetensors"
    if not path.exists():
        import numpy as np
        from safetensors.numpy import save_file

        hidden_size = json.loads((model_dir / "config.json").read_text())["hidden_size"]
        directory.mkdir(parents=True, exist_ok=True)
        vector = np.random.default_rng(0).standard_normal(hidden_size).astype(np.float32)
        save_file({"v": vector}, str(path))
    return directory


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Serve a model with per-request hidden states (vllm serve "
        "--enable-hidden-states); the tiny built-in model by default.",
    )
    parser.add_argument("--model", default=None, help="model directory or HF id")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: loopback only; 0.0.0.0 opens it)",
    )
    parser.add_argument("--port", type=int, default=8000)
    known, extra = parser.parse_known_args(args)
    argv, env = build_command(known.model, known.port, extra, _has_cuda(), host=known.host)
    for key, value in env.items():
        os.environ.setdefault(key, value)
    print("+ " + " ".join(argv[1:]), flush=True)
    # Replace this process, so signals (Ctrl-C, make's SIGTERM) reach vLLM.
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
