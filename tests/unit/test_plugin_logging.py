# SPDX-License-Identifier: Apache-2.0
"""The package logs through vLLM's logger (handlers, format and level)."""

import logging


def test_package_records_propagate_to_the_vllm_logger():
    from vllm_hidden_states.plugin import _share_vllm_logging

    _share_vllm_logging()
    seen: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record)

    handler = Collect()
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(handler)
    old_level = vllm_logger.level
    vllm_logger.setLevel(logging.INFO)
    try:
        logging.getLogger("vllm_hidden_states.store.example").info("stored %d rows", 3)
    finally:
        vllm_logger.removeHandler(handler)
        vllm_logger.setLevel(old_level)
    assert [r.getMessage() for r in seen] == ["stored 3 rows"]
