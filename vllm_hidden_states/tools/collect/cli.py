# SPDX-License-Identifier: Apache-2.0
"""The ``vllm-hidden-states collect`` command line: its flags (one to one with
:class:`~vllm_hidden_states.tools.collect.config.CollectConfig`), the run,
and its report (one JSON line on stdout; exit status 2 for a refused
setting or a held output directory).

    vllm-hidden-states collect DATASET OUT --model M [--layers=-2] [--points attn_out.3]
    vllm-hidden-states collect DATASET OUT --server-url http://host:8000 [--layers=-2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from vllm_hidden_states.store.parquet_shards import FORMATS, STORAGE_DTYPES
from vllm_hidden_states.tools.collect.config import POSITIONS, CollectConfig
from vllm_hidden_states.tools.collect.harvest import OutputLocked, collect
from vllm_hidden_states.tools.collect.server import REFUSED_FILE


def _points(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected comma-separated integers, e.g. -2 or 0,8,-1"
        ) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "dataset", help="JSONL ({id, text|messages}), Parquet, or text (one prompt a line)"
    )
    p.add_argument("out", help="output directory (shards + manifest.json); rerun to resume")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model for the offline engine")
    src.add_argument("--server-url", help="a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--served-model", help="server mode: the model name (default: the first)")
    p.add_argument(
        "--tokenizer",
        help="server mode: tokenizer for token ids (default: the "
        "server's model root, else the server's /tokenize)",
    )
    p.add_argument(
        "--layers",
        type=_layers,
        default=None,
        help="comma-separated (default -2, none with --points)",
    )
    p.add_argument(
        "--points",
        type=_points,
        default=[],
        help="capture points, comma-separated, e.g. attn_out.3,blocks.3.hook_mlp_out "
        "(offline: made capturable; server: started with --hidden-states-points)",
    )
    p.add_argument("--positions", choices=POSITIONS, default="prompt")
    p.add_argument(
        "--max-tokens", type=int, default=16, help="generated tokens with --positions all"
    )
    p.add_argument("--max-length", type=int, default=512, help="prompt tokens kept per document")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=2, help="server mode: batches in flight")
    p.add_argument("--dtype", choices=STORAGE_DTYPES, default="float32", help="storage dtype")
    p.add_argument("--format", dest="fmt", choices=FORMATS, default="parquet")
    p.add_argument("--rows-per-shard", type=int, default=65536)
    p.add_argument(
        "--max-pending-mb",
        type=int,
        default=256,
        help="writer buffer; the engine waits only when it is full",
    )
    p.add_argument("--limit", type=int, help="stop after this many dataset records")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--max-model-len", type=int, help="offline engine: vLLM max_model_len")
    p.add_argument("--engine-dtype", help="offline engine: vLLM dtype (auto, float32, bfloat16...)")
    p.add_argument("--enforce-eager", action="store_true", help="offline engine: no torch.compile")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="offline engine: extra vllm.LLM argument, e.g. gpu_memory_utilization=0.5",
    )


def run(args: argparse.Namespace) -> int:
    engine_kwargs: dict[str, Any] = {}
    if args.max_model_len:
        engine_kwargs["max_model_len"] = args.max_model_len
    if args.engine_dtype:
        engine_kwargs["dtype"] = args.engine_dtype
    if args.enforce_eager:
        engine_kwargs["enforce_eager"] = True
    for item in args.engine_arg:
        key, _, value = item.partition("=")
        try:
            engine_kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            engine_kwargs[key] = value
    cfg = CollectConfig(
        dataset=args.dataset,
        out=args.out,
        model=args.model,
        server_url=args.server_url,
        served_model=args.served_model,
        tokenizer=args.tokenizer,
        layers=args.layers if args.layers is not None else ([] if args.points else [-2]),
        points=args.points,
        positions=args.positions,
        max_tokens=args.max_tokens,
        max_length=args.max_length,
        batch_size=args.batch_size,
        concurrency=args.concurrency,
        dtype=args.dtype,
        fmt=args.fmt,
        rows_per_shard=args.rows_per_shard,
        max_pending_mb=args.max_pending_mb,
        limit=args.limit,
        progress=not args.no_progress,
        engine_kwargs=engine_kwargs,
    )
    try:
        result = collect(cfg)
    except (ValueError, OutputLocked) as e:
        print(f"vllm-hidden-states collect: {e}", file=sys.stderr)
        return 2
    if result.refused:
        print(
            f"vllm-hidden-states collect: {result.refused} document(s) refused by the "
            f"server and skipped, listed in {Path(result.out) / REFUSED_FILE}",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {
                "out": result.out,
                "docs": result.docs,
                "skipped": result.skipped,
                "empty": result.empty,
                "truncated": result.truncated,
                "refused": result.refused,
                "tokens": result.tokens,
                "seconds": round(result.seconds, 3),
                "tokens_per_s": round(result.tokens_per_s, 1),
                "engine_waited_on_writer_s": round(result.producer_wait_s, 3),
            }
        )
    )
    return 0
