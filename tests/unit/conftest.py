# SPDX-License-Identifier: Apache-2.0
"""Shared helpers of the fast unit tier (no engine, no server, no model).

Only cheap imports here: torch and vLLM are imported by the test modules that
need them, so a module that does not pay for them.
"""

import subprocess
import sys
from collections.abc import Callable

import pytest


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
