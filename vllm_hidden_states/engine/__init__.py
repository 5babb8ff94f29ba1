# SPDX-License-Identifier: Apache-2.0
"""EngineCore process: hidden-state work inside vLLM's scheduler.

* :mod:`.extracts`: HIDDEN_STATES_EXTRACT core requests become scheduler
  ``Request`` s (``EngineCore.add_hidden_states_extracts``, patch 0002).
* :mod:`.planner`: :class:`~.planner.CapturePlanner` on
  ``Scheduler.capture_planner`` (patch 0003): which rows the model runner
  captures each step (``SchedulerOutput.capture_plan``), the KV hand-over of
  "last" extracts, and moving captured tensors onto ``EngineCoreOutput``.
"""
