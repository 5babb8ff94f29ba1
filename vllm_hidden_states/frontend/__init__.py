# SPDX-License-Identifier: Apache-2.0
"""Front-end process (next to vLLM's InputProcessor and OutputProcessor, in
``LLM``/``LLMEngine``/``AsyncLLM``): validate what a request asked for, hold a
finished request's output, dispatch its HIDDEN_STATES_EXTRACT, release it.

* :mod:`.validate`: ``SamplingParams`` -> ``HiddenStatesSpec`` (InputProcessor).
* :mod:`.dispatcher`: hold / dispatch / release (OutputProcessor).
"""
