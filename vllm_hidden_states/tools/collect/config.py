# SPDX-License-Identifier: Apache-2.0
"""What a ``collect`` run does (:class:`CollectConfig`, the command-line flags
one to one) and what it did (:class:`CollectResult`), with the progress bar
both engines' runs show. The user's guide: docs/datasets.md."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

POSITIONS = ("prompt", "all")


@dataclass
class CollectConfig:
    """What ``collect`` does; the command-line flags map one to one.

    Attributes:
        dataset: dataset path. out: shard directory.
        model: model for the offline engine (or None with ``server_url``).
        server_url: base URL of a running server (``http://host:port``).
        served_model: the server's model name (default: its first model).
        layers: layer indices (HF ``output_hidden_states`` indexing).
        points: capture points (``"attn_out.3"``, ``"blocks.3.hook_mlp_out"``),
            stored after the layers (``point`` column).
        positions: ``"prompt"`` or ``"all"``.
        max_tokens: generated tokens per document with ``"all"``.
        max_length: prompt tokens kept per document (the first ones).
        batch_size: documents per engine call / HTTP request.
        concurrency: HTTP batches in flight (server mode).
        dtype: storage dtype; fmt: ``"parquet"`` or ``"safetensors"``.
        rows_per_shard, max_pending_mb: see :class:`ShardWriter`.
        limit: stop after this many documents of the dataset (None: all).
        progress: show a tqdm bar (tokens/s).
        engine_kwargs: extra ``vllm.LLM`` keyword arguments.
    """

    dataset: str
    out: str
    model: str | None = None
    server_url: str | None = None
    served_model: str | None = None
    tokenizer: str | None = None
    layers: list[int] = field(default_factory=lambda: [-2])
    points: list[str] = field(default_factory=list)
    positions: str = "prompt"
    max_tokens: int = 16
    max_length: int = 512
    batch_size: int = 32
    concurrency: int = 2
    dtype: str = "float32"
    fmt: str = "parquet"
    rows_per_shard: int = 65536
    max_pending_mb: int = 256
    limit: int | None = None
    progress: bool = True
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        if (self.model is None) == (self.server_url is None):
            raise ValueError("give exactly one of --model (offline engine) and --server-url")
        if self.positions not in POSITIONS:
            raise ValueError(f"--positions {self.positions!r}: use one of {', '.join(POSITIONS)}")
        if self.server_url is not None and self.positions != "prompt":
            raise ValueError(
                "--server-url collects prompt positions only (POST "
                "/v1/hidden_states); use --model for --positions all"
            )
        if len(set(self.layers)) != len(self.layers) or len(set(self.points)) != len(self.points):
            raise ValueError(
                f"--layers {self.layers} / --points {self.points}: name each layer and point once"
            )
        if not self.layers and not self.points:
            raise ValueError("name at least one layer (--layers) or point (--points)")
        from vllm_hidden_states.points import is_pattern_address, is_wide_address

        other = [p for p in self.points if is_wide_address(p) or is_pattern_address(p)]
        if other:
            raise ValueError(
                f"--points {other}: collect stores rows of the model's hidden size; "
                "mlp_post (intermediate_size wide), attn_z (heads * head_dim wide) and "
                "attention patterns are served "
                "on the completion routes and the Python API, not by collect yet"
            )
        for name in ("batch_size", "max_length", "max_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


@dataclass
class CollectResult:
    """What a run did. ``tokens_per_s``: tokens written per second of wall time
    (engine start excluded)."""

    out: str
    docs: int = 0
    tokens: int = 0
    skipped: int = 0  # finished by an earlier run (resume)
    empty: int = 0  # encode to no tokens
    truncated: int = 0  # stored as their first max_length tokens
    refused: int = 0  # refused by the server: skipped, in OUT/refused.json
    refused_docs: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    producer_wait_s: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def progress_bar(cfg: CollectConfig):
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(unit="tok", unit_scale=True, desc="collect", dynamic_ncols=True)
