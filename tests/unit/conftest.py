# SPDX-License-Identifier: Apache-2.0
"""Shared helpers of the fast unit tier (no engine, no server, no model).

Only cheap imports here: torch and vLLM are imported by the test modules that
need them, so a module that does not pay for them.
"""

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO

import pytest


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one thread while a unit module runs: its tensors are a few
    rows, where intra-op threads cost more than they save (and their
    spin-waits take the second core from the rest of the tier). Only where a
    test module imported torch: this file imports nothing heavy."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def wire() -> Callable:
    """``wire(obj)``: ``obj`` as a client receives it (orjson out, orjson back in).

    Serialized with the server's own options, so numpy arrays in ``obj`` travel
    as the server writes them.
    """
    import orjson

    from vllm_hidden_states.server.encoding import ORJSON_OPTIONS

    def roundtrip(obj):
        return orjson.loads(orjson.dumps(obj, option=ORJSON_OPTIONS))

    return roundtrip


@pytest.fixture
def modules_loaded_by() -> Callable[[str], set[str]]:
    """``modules_loaded_by("pkg.mod")``: the top-level packages in ``sys.modules``
    after importing it in a fresh interpreter (this one may already hold torch
    and vLLM, imported by other tests)."""

    def loaded(module: str) -> set[str]:
        code = (
            f"import sys, {module}\n"
            "print('\\n'.join(sorted({m.split('.')[0] for m in sys.modules})))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        return set(out.stdout.split())

    return loaded


# Runs in a fresh interpreter: Triton reads TRITON_INTERPRET when a kernel is
# decorated, that is when its module is imported, so this process (where the
# kernels may already be imported for real) cannot interpret them. It imports
# the costly modules first (while this process runs other tests), then serves
# one request per line, [script, cases], and answers a line per case, then
# "done".
_INTERPRETER = r"""
import json, os, sys, traceback
os.environ["TRITON_INTERPRET"] = "1"
import torch, triton, vllm
for request in sys.stdin:
    script, cases = json.loads(request)
    namespace = {"__name__": "interpreted_check"}
    try:
        exec(compile(script, "<interpreted check>", "exec"), namespace)
        loaded = None
    except Exception:
        loaded = traceback.format_exc()
    for case in cases:
        try:
            result = loaded or "ok " + str(namespace["check"](*case))
        except Exception:
            result = traceback.format_exc()
        print("case " + json.dumps([case, result]), flush=True)
    print("done", flush=True)
"""


class _Interpreter:
    """The interpreter process, its answers as lines (``""``: it is gone) and
    its stderr (a file, not a pipe: nothing to drain)."""

    def __init__(self) -> None:
        self.errors = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(
            [sys.executable, "-c", _INTERPRETER],
            env={**os.environ, "OMP_NUM_THREADS": "1"},  # as one_torch_thread, here
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(self.process.stdout,), daemon=True).start()

    def _read(self, stdout: IO[str]) -> None:
        for line in stdout:
            self.lines.put(line)
        self.lines.put("")

    def exited(self) -> str:
        self.errors.seek(0)
        return f"the interpreter process exited: {self.errors.read()[-2000:]}"

    def run(self, script: str, cases: Sequence[Sequence[str]]) -> dict[tuple[str, ...], str]:
        assert self.process.stdin is not None
        assert self.process.poll() is None, self.exited()
        self.process.stdin.write(json.dumps([script, [list(c) for c in cases]]) + "\n")
        self.process.stdin.flush()
        results: dict[tuple[str, ...], str] = {}
        deadline = time.monotonic() + 600
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                raise AssertionError("the interpreter process answered nothing in 600 s") from None
            if line == "":
                raise AssertionError(self.exited())
            if line == "done\n":
                return results
            if line.startswith("case "):
                case, result = json.loads(line[len("case ") :])
                results[tuple(case)] = result

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.errors.close()


_interpreter: list[_Interpreter] = []  # started at most once per session


def pytest_collection_finish(session: pytest.Session) -> None:
    # Started as soon as the session's tests are known, so that its imports
    # overlap the tests that run before the first that needs it (not in an
    # xdist worker, which runs only some of the tests it collected).
    if hasattr(session.config, "workerinput"):
        return
    if any("triton_interpreted" in getattr(i, "fixturenames", ()) for i in session.items):
        _interpreter.append(_Interpreter())


def pytest_sessionfinish(session: pytest.Session) -> None:
    while _interpreter:
        _interpreter.pop().close()


@pytest.fixture(scope="session")
def triton_interpreted() -> Callable[[str, Sequence[Sequence[str]]], dict[tuple[str, ...], str]]:
    """``triton_interpreted(script, cases)``: ``check(*case)``, defined by
    ``script``, for each case, with Triton's interpreter on, in one Python
    process for the session (torch, Triton and vLLM imported once for every
    caller); per case ``"ok <what check returned>"`` or the traceback it
    raised. A process that dies or hangs fails the caller."""
    if not _interpreter:
        _interpreter.append(_Interpreter())
    return _interpreter[0].run
