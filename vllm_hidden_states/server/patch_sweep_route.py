# SPDX-License-Identifier: Apache-2.0
"""POST /v1/patch_sweep: an activation-patching sweep in one call.

The body names a clean and a corrupted prompt of one token length, a grid
(``points`` x ``positions``, plus ``heads`` for head points) and a
``metric``; the answer is the metric per cell and the two baselines. The
grid, its checks, each cell's patch and the metric have one home,
:mod:`vllm_hidden_states.sweep` (shared with the ``LLM`` helper); this
module is the HTTP edge: the body's form, the engine behind the server, the
runs (the clean capture, then every cell and the corrupted baseline
submitted together), and the answer, as one JSON object or, with
``"stream": true``, as server-sent events (a ``patch_sweep.row`` event per
finished row, then the ``patch_sweep`` answer, then ``[DONE]``). Every
refusal is an OpenAI error body naming the field, before any engine work.
The contract: docs/patching.md, "A sweep in one call".
"""

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError

from vllm.logger import init_logger
from vllm_hidden_states.server.errors import (
    caught,
    internal_error,
    invalid_request,
    json_object,
    read_json_body,
)
from vllm_hidden_states.server.hidden_states_route import _check_model, _run_in_tokenizer_pool
from vllm_hidden_states.server.limits import SWEEP_CELLS_FLAG, limits_of
from vllm_hidden_states.server.request_checks import engine_config, steering_config
from vllm_hidden_states.sweep import (
    SweepEngine,
    SweepError,
    SweepPlan,
    assemble,
    capture_params,
    cell_steering,
    clean_rows,
    metric_params,
    plan,
    read_metric,
)

logger = init_logger(__name__)
ROUTE = "POST /v1/patch_sweep"

router = APIRouter()

# Runs of one sweep in the engine at once: more than a step batches (the
# scheduler always has a full batch waiting), few enough that a 4096-cell
# sweep does not build every request at once, and requests of other clients
# queue behind this many, not behind the whole sweep.
IN_FLIGHT = 256


class PatchSweepRequest(BaseModel):
    """Body of POST /v1/patch_sweep. Unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    clean: StrictStr | list[StrictInt]
    corrupted: StrictStr | list[StrictInt]
    points: list[StrictStr]
    metric: dict[str, Any]
    positions: Literal["all"] | list[StrictInt] = "all"
    heads: Literal["all"] | list[StrictInt] | None = None
    add_special_tokens: StrictBool = True
    stream: StrictBool = False


FIELD_HELP = {
    "model": "the served model name (string)",
    "clean": "the clean prompt: a string or a list of token ids",
    "corrupted": "the corrupted prompt, as many tokens as 'clean': a string or token ids",
    "points": "a non-empty list of steerable point addresses, e.g. ['resid_pre.0', 'attn_out.3']",
    "metric": '{"logit_diff": [answer, wrong]} or {"logprob": token} (token ids or '
    "one-token strings)",
    "positions": "'all' or a list of prompt positions (default 'all')",
    "heads": "'all' or a list of attention heads, for attn_z points (default 'all')",
    "add_special_tokens": "true or false: text prompts tokenized as /v1/completions does "
    "(default true)",
    "stream": "true or false: server-sent events per finished row, then the answer",
}


def parse_request(body: bytes) -> PatchSweepRequest:
    return json_object(body, PatchSweepRequest, _validation_message)


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    """The 400's text and field for the request's first validation error."""
    error = e.errors()[0]
    loc = error.get("loc") or ()
    field = str(loc[0]) if loc else None
    if error["type"] == "missing":
        return f"missing required field {field!r}: {FIELD_HELP.get(field or '', '')}", field
    if error["type"] == "extra_forbidden":
        return f"unknown field {field!r}; allowed fields: {', '.join(FIELD_HELP)}", field
    return f"invalid {field!r}: expected {FIELD_HELP.get(field or '', error['msg'])}", field


async def _plan(raw_request: Request, request: PatchSweepRequest) -> SweepPlan:
    """The sweep checked against the engine (tokenizing text off the loop)."""
    state = raw_request.app.state
    engine_client = state.engine_client
    model_config = engine_client.model_config
    tokenizer = engine_client.renderer.get_tokenizer()
    texts = {
        name: value
        for name, value in (("clean", request.clean), ("corrupted", request.corrupted))
        if isinstance(value, str)
    }
    metric_texts = [
        x
        for v in request.metric.values()
        for x in (v if isinstance(v, (list, tuple)) else [v])
        if isinstance(x, str)
    ]

    def encode_all():
        prompts = {
            k: tokenizer.encode(v, add_special_tokens=request.add_special_tokens)
            for k, v in texts.items()
        }
        tokens = {t: tokenizer.encode(t, add_special_tokens=False) for t in metric_texts}
        return prompts, tokens

    prompts, tokens = await _run_in_tokenizer_pool(state, encode_all)
    by_text = {request.clean if k == "clean" else request.corrupted: v for k, v in prompts.items()}
    return plan(
        clean=request.clean,
        corrupted=request.corrupted,
        points=request.points,
        metric=request.metric,
        positions=request.positions,
        heads=request.heads,
        engine=SweepEngine(
            hs_cfg=engine_config(engine_client),
            steer_cfg=steering_config(engine_client),
            vocab_size=int(model_config.get_vocab_size()),
            max_model_len=int(model_config.max_model_len),
            num_heads=int(model_config.hf_text_config.num_attention_heads),
            encode=lambda text: by_text[text],
            encode_token=lambda text: tokens[text],
            max_cells=limits_of(raw_request).max_sweep_cells,
            max_cells_hint=SWEEP_CELLS_FLAG,
        ),
    )


async def _final(engine_client: Any, ids: list[int], kwargs: dict, request_id: str, lora):
    from vllm.inputs.engine import tokens_input
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(**kwargs, output_kind=RequestOutputKind.FINAL_ONLY)
    final = None
    async for output in engine_client.generate(
        tokens_input(ids), params, request_id, lora_request=lora
    ):
        final = output
    if final is None:
        raise internal_error(f"the engine returned nothing for {request_id}")
    return final


async def _events(engine_client: Any, sweep: SweepPlan, lora) -> AsyncIterator[dict[str, Any]]:
    """The sweep's runs: a ``patch_sweep.row`` event per finished row, then
    the answer (``patch_sweep``). The clean run first (its rows are the
    patches), then the corrupted baseline and every cell together, at most
    :data:`IN_FLIGHT` in the engine at once."""
    from vllm.utils import random_uuid

    base = f"patchsweep-{random_uuid()}"
    started = time.monotonic()
    captured = await _final(
        engine_client, sweep.clean_ids, capture_params(sweep), f"{base}-clean", lora
    )
    rows = clean_rows(sweep, captured.outputs[0].hidden_states)
    clean = read_metric(sweep, captured, "the clean run")
    cells = sweep.cells()
    window = asyncio.Semaphore(IN_FLIGHT)
    finished: asyncio.Queue = asyncio.Queue()

    async def run(i: int) -> None:
        # i = -1: the corrupted baseline; else cell i. Its metric, or its
        # failure, goes to the queue.
        steering = None if i < 0 else cell_steering(sweep, cells[i], rows)
        what = "the corrupted run" if i < 0 else f"cell {i}"
        try:
            async with window:
                out = await _final(
                    engine_client,
                    sweep.corrupted_ids,
                    metric_params(sweep, steering),
                    f"{base}-{'corrupted' if i < 0 else i}",
                    lora,
                )
            await finished.put((i, read_metric(sweep, out, what)))
        except Exception as e:
            await finished.put((i, e))

    tasks = [asyncio.ensure_future(run(i)) for i in range(-1, len(cells))]
    values = [0.0] * len(cells)
    left = [len(sweep.positions)] * len(sweep.rows)
    corrupted = 0.0
    cells_done = 0
    try:
        for _ in tasks:
            i, value = await finished.get()
            if isinstance(value, Exception):
                raise value
            if i < 0:
                corrupted = value
                continue
            values[i] = value
            cells_done += 1
            row = cells[i].row
            left[row] -= 1
            if left[row] == 0:
                point, head = sweep.rows[row]
                start = row * len(sweep.positions)
                event: dict[str, Any] = {"object": "patch_sweep.row", "point": point}
                if head is not None:
                    event["head"] = head
                event.update(
                    values=values[start : start + len(sweep.positions)],
                    cells_done=cells_done,
                    cells_total=len(cells),
                )
                yield event
    finally:
        # Done, failed, or the client left: nothing of this sweep stays in the engine.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    logger.info("patch sweep %s: %d cells in %.1f s", base, len(cells), time.monotonic() - started)
    yield {"answer": assemble(sweep, values, clean, corrupted)}


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(event, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n\n"


async def _serve(body: bytes, raw_request: Request) -> Response:

    state = raw_request.app.state
    try:
        request = parse_request(body)
        lora = _check_model(state, request.model)
        try:
            sweep = await _plan(raw_request, request)
        except SweepError as e:
            raise invalid_request(str(e), e.param) from None
        engine_client = state.engine_client
        if request.stream:
            return StreamingResponse(
                _stream(engine_client, sweep, lora, request.model), media_type="text/event-stream"
            )
        answer = None
        async for event in _events(engine_client, sweep, lora):
            answer = event.get("answer")
        assert answer is not None
        content = {**answer.as_json(), "model": request.model}
        return Response(
            orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY),
            media_type="application/json",
        )
    except Exception as e:  # noqa: BLE001 - answered as OpenAI error JSON
        return caught(e, ROUTE).json_response()


async def _stream(engine_client: Any, sweep: SweepPlan, lora, model: str) -> AsyncIterator[bytes]:
    """The SSE body: the row events, the answer, ``[DONE]``; a failure after
    the head is sent is an error event (vLLM's streams do the same)."""

    try:
        async for event in _events(engine_client, sweep, lora):
            if "answer" in event:
                yield _sse({**event["answer"].as_json(), "model": model})
            else:
                yield _sse(event)
    except Exception as e:  # noqa: BLE001 - an error event, as vLLM's streams send
        yield _sse(caught(e, ROUTE + " (stream)").body())
    yield b"data: [DONE]\n\n"


@router.post("/v1/patch_sweep")
async def create_patch_sweep(raw_request: Request):
    """POST /v1/patch_sweep (see the module docstring)."""
    from vllm.entrypoints.serve.utils.api_utils import with_cancellation

    body = await read_json_body(raw_request, ROUTE)
    if not isinstance(body, bytes):
        return body
    # with_cancellation cancels _serve (and so every run of the sweep) when
    # the client leaves; a stream's runs end with its body's generator.
    return await with_cancellation(_serve)(body, raw_request)
