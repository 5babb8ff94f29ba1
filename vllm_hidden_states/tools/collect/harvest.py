# SPDX-License-Identifier: Apache-2.0
"""``collect()``: one harvest of a dataset into an output directory, by the
offline engine or a server, holding the directory for the whole run (an
exclusive ``fcntl.flock`` on ``OUT/.collect.lock``: a second run into it is
refused at once, :class:`OutputLocked`). Rerunning after a kill skips the
finished documents (docs/datasets.md)."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

from vllm_hidden_states.store.parquet_shards import FORMATS, STORAGE_DTYPES
from vllm_hidden_states.tools.collect.config import CollectConfig, CollectResult
from vllm_hidden_states.tools.collect.offline import collect_offline
from vllm_hidden_states.tools.collect.server import collect_server

LOCK_FILE = ".collect.lock"


class OutputLocked(RuntimeError):
    """Another ``collect`` run holds the output directory."""


@contextmanager
def lock_output(out: str | Path):
    """Hold ``OUT/.collect.lock`` (``fcntl.flock``, exclusive) while the block
    runs; :class:`OutputLocked` at once if another process (or another open of
    it here) holds it. The file stays (removing it would race a waiting run);
    the lock goes with the process."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise OutputLocked(
                f"{out} is in use: another `vllm-hidden-states collect` (pid {holder}) "
                f"holds it ({path}); two runs into one directory would delete each "
                "other's shards. Wait for that run to end, or give another output "
                "directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock


def collect(cfg: CollectConfig, llm=None) -> CollectResult:
    """Harvest ``cfg.dataset`` into ``cfg.out``; ``llm``: an already built
    ``vllm.LLM`` (with ``enable_hidden_states`` and the layers capturable) to
    use instead of building one from ``cfg.model``. Holds ``cfg.out`` for the
    whole run (:func:`lock_output`)."""
    cfg.check()
    if cfg.dtype not in STORAGE_DTYPES:
        raise ValueError(f"--dtype {cfg.dtype!r}: use one of {', '.join(STORAGE_DTYPES)}")
    if cfg.fmt not in FORMATS:
        raise ValueError(f"--format {cfg.fmt!r}: use one of {', '.join(FORMATS)}")
    result = CollectResult(out=str(cfg.out))
    with lock_output(cfg.out):
        if cfg.server_url is not None:
            collect_server(cfg, result)
        else:
            collect_offline(cfg, llm, result)
    return result
