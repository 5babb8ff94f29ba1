# SPDX-License-Identifier: Apache-2.0
"""``collect --model``: the offline engine in this process (``vllm.LLM`` with
``enable_hidden_states``, the capturable set the run's layers and points);
each batch of documents is one ``LLM.generate`` whose hidden states go to
the shard writer (:mod:`vllm_hidden_states.store.parquet_shards`)."""

from __future__ import annotations

import logging
import time

import numpy as np

from vllm_hidden_states.store.parquet_shards import DocStates, HarvestMeta, ShardWriter
from vllm_hidden_states.tools.collect.config import CollectConfig, CollectResult, progress_bar
from vllm_hidden_states.tools.collect.dataset import batches, read_dataset
from vllm_hidden_states.tools.collect.tokens import doc_ids

# Not vllm.logger.init_logger: the console script imports this module for
# every command, ``patch apply`` included, which must not import vLLM. The
# logger is the same object (loggers are per name); the plugin routes
# ``vllm_hidden_states.*`` records through vLLM's handlers once vLLM loads.
logger = logging.getLogger(__name__)


def collect_offline(cfg: CollectConfig, llm, result: CollectResult) -> None:
    from vllm import LLM

    if llm is None:
        kwargs = dict(cfg.engine_kwargs)
        import torch

        if not torch.cuda.is_available():
            # vLLM CPU reserves gpu_memory_utilization x the machine's RAM
            # (0.92 by default), which fails beside any other process; take
            # what `make serve` takes unless told otherwise.
            kwargs.setdefault("gpu_memory_utilization", 0.3)
        llm = LLM(
            model=cfg.model,
            enable_hidden_states=True,
            hidden_states_layers=list(cfg.layers) or [-1],
            hidden_states_points=list(cfg.points) or None,
            **kwargs,
        )
        try:
            _run_offline(cfg, llm, result)
        finally:
            llm.llm_engine.engine_core.shutdown()
    else:
        _run_offline(cfg, llm, result)


def _run_offline(cfg: CollectConfig, llm, result: CollectResult) -> None:
    import torch

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model_config = llm.llm_engine.model_config
    tokenizer = llm.get_tokenizer()
    meta = HarvestMeta(
        model=str(cfg.model),
        layers=tuple(cfg.layers),
        points=tuple(cfg.points),
        positions=cfg.positions,
        hidden_size=model_config.get_hidden_size(),
        dtype=cfg.dtype,
        fmt=cfg.fmt,
        model_dtype=str(model_config.dtype).removeprefix("torch."),
    )
    # The prompt must leave room for one generated token (and, with "all",
    # for the final token's extract).
    max_prompt = min(cfg.max_length, model_config.max_model_len - 2)
    params = SamplingParams(
        max_tokens=1 if cfg.positions == "prompt" else cfg.max_tokens,
        temperature=0.0,
        detokenize=False,
        return_hidden_states=True,
        hidden_states_layers=list(cfg.layers) or None,
        hidden_states_points=list(cfg.points) or None,
        hidden_states_positions=cfg.positions,
    )
    with ShardWriter(
        cfg.out, meta, rows_per_shard=cfg.rows_per_shard, max_pending_bytes=cfg.max_pending_mb << 20
    ) as writer:
        bar = progress_bar(cfg)
        t0 = time.monotonic()
        for batch in batches(
            read_dataset(cfg.dataset), writer.finished_doc_ids(), cfg.batch_size, cfg.limit, result
        ):
            prompts, kept = [], []
            for doc in batch:
                ids = doc_ids(tokenizer, doc)
                if not ids:
                    result.empty += 1
                    logger.warning("document %r encodes to no tokens; skipped", doc.doc_id)
                    continue
                if len(ids) > max_prompt:
                    result.truncated += 1
                    ids = ids[:max_prompt]
                prompts.append(TokensPrompt(prompt_token_ids=ids))
                kept.append(doc)
            outputs = llm.generate(prompts, params, use_tqdm=False) if prompts else []
            tokens = 0
            for doc, out in zip(kept, outputs):
                completion = out.outputs[0]
                token_ids = list(out.prompt_token_ids)
                if cfg.positions == "all":
                    token_ids += list(completion.token_ids)
                states = completion.hidden_states
                if states is None:
                    raise RuntimeError(
                        f"document {doc.doc_id!r}: the engine returned no hidden states"
                    )
                keys = [*cfg.layers, *cfg.points]
                vectors, bf16 = _to_numpy(torch.stack([states[key] for key in keys]))
                writer.submit(
                    DocStates(doc.doc_id, np.asarray(token_ids, dtype=np.int32), vectors, bf16)
                )
                tokens += len(token_ids)
                result.docs += 1
            result.tokens += tokens
            if bar is not None:
                bar.update(tokens)
                bar.set_postfix(
                    docs=result.docs,
                    skipped=result.skipped,
                    truncated=result.truncated,
                    refresh=False,
                )
        writer.close()
        result.seconds = time.monotonic() - t0
        result.producer_wait_s = writer.stats.producer_wait_s
        result.stats = vars(writer.stats).copy()
        if bar is not None:
            bar.close()


def _to_numpy(t) -> tuple[np.ndarray, bool]:
    """A CPU torch tensor as numpy; bfloat16 as uint16 bits (flag True)."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16), True
    return t.numpy(), False
