# SPDX-License-Identifier: Apache-2.0
"""The GPU tier's engines and checks, shared by its engine test files.

Engines (``ENGINE_KINDS``), each compiled unless named eager, every capture
and steering point capturable, chunked prefill always in play (64-token
budget, 24-row capture buffers):

* ``default``: vLLM's CUDA defaults, nothing forced (runner, scheduling,
  torch.compile with CUDA graphs: what plain vLLM would pick);
* ``v1-sync``: Model Runner V1 (``VLLM_USE_V2_MODEL_RUNNER=0``) with async
  scheduling off, asked explicitly;
* ``eager``: ``enforce_eager``, vLLM's defaults otherwise.

``HS_GPU_ENGINES`` (comma-separated) picks which of them the engine tests run
on (default: all); the budgeted run (``tests/gpu/run.sh``) runs ``default``
in one step and the others in a later one.
"""

import os
from contextlib import contextmanager

from vllm import SamplingParams

from .conftest import assert_close_gpu, start_engine

PROMPT = "Once upon a time there was a small robot who loved to count the stars"
LONG_PROMPT = " ".join(["The engine schedules requests, runs the model and samples tokens."] * 10)
NGRAM_PROMPT = "the cat sat on the mat and the cat sat on the mat and the cat"
LAYERS = [0, 1, -2, -1]

ENGINE_ARGS = dict(
    dtype="float32",
    gpu_memory_utilization=0.3,
    max_num_batched_tokens=64,
    max_num_seqs=16,
    max_model_len=1024,
    enable_prefix_caching=True,
    seed=0,
)

# kind -> (enforce_eager, extra LLM kwargs, environment for its lifetime)
ENGINE_KINDS: dict[str, tuple[bool, dict, dict[str, str]]] = {
    "default": (False, {}, {}),
    "v1-sync": (False, {"async_scheduling": False}, {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
    "eager": (True, {}, {}),
}


def engine_kinds() -> list[str]:
    """The kinds ``HS_GPU_ENGINES`` names (all by default), in its order."""
    names = [n for n in os.environ.get("HS_GPU_ENGINES", ",".join(ENGINE_KINDS)).split(",") if n]
    unknown = [n for n in names if n not in ENGINE_KINDS]
    if unknown:
        raise ValueError(f"HS_GPU_ENGINES: unknown {unknown}; known: {', '.join(ENGINE_KINDS)}")
    return names


@contextmanager
def environment(env: dict[str, str]):
    """``env`` set for the block (an engine's lifetime: vLLM reads its
    variables when asked, e.g. ``vllm_config.use_v2_model_runner``)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def make_llm(model_dir, name: str, *, eager: bool = False, **kwargs):
    """An ``LLM`` with hidden states on ``model_dir``, every capture and
    steering point in the compiled graph and the CUDA graphs; its start time
    and resolved mode recorded under ``name``."""
    from vllm import LLM

    return start_engine(
        name,
        lambda: LLM(
            model=str(model_dir),
            enable_hidden_states=True,
            enforce_eager=eager,
            hidden_states_max_rows=24,
            hidden_states_points="all",
            enable_steering=True,
            steering_points="all",
            **{**ENGINE_ARGS, **kwargs},
        ),
    )


def params(**kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 12)
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("hidden_states_layers", LAYERS)
    return SamplingParams(return_hidden_states=True, **kwargs)


def sequence_of(out, index: int = 0) -> list[int]:
    return list(out.prompt_token_ids) + list(out.outputs[index].token_ids)


def check(hf, out, positions: str, layers=LAYERS, index: int = 0):
    """Every layer of choice ``index`` equals HF at the positions asked."""
    completion = out.outputs[index]
    assert completion.finish_reason in ("stop", "length"), completion.finish_reason
    ids = sequence_of(out, index)
    ref = hf.states(ids)
    want = {
        "last": slice(len(ids) - 1, None),
        "all": slice(None),
        "prompt": slice(None, len(out.prompt_token_ids)),
    }[positions]
    assert list(completion.hidden_states) == list(layers)
    for layer in layers:
        assert_close_gpu(
            completion.hidden_states[layer], ref[layer][want], f"{positions} layer {layer}"
        )
