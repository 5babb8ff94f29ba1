# SPDX-License-Identifier: Apache-2.0
"""Server-wide probe monitors: ``vllm serve ... --monitors FILE``.

The file (JSON, or YAML by its ``.yaml`` / ``.yml`` suffix) holds a list of
named probe actions, or ``{"monitors": [...]}``::

    - {name: harm-stop, probe: harm, above: 0.8, for: 2, then: stop}
    - {name: topic-flag, probe: topic, below: -1.0, output: 1, then: flag}

It is read and checked against ``--probes DIR`` when the API server starts
(:func:`load_monitors`; a file that does not load stops the server, naming
it and why). :func:`put_monitors` then adds them to every chat/completions
request the server serves (``extra_args["probe_monitors"]``, overwriting
whatever a client sent there), where the engine decides them beside the
request's own ``probe_actions``. A client cannot turn them off, and gets
neither their scores nor their flags; a monitor's stop ends its output with
``stop_reason`` the monitor's name.
"""

import json
from pathlib import Path
from typing import Any

from vllm.logger import init_logger
from vllm_hidden_states.probe_actions import MONITORS_FIELD, check_monitors
from vllm_hidden_states.probes import read_probe_dir

logger = init_logger(__name__)

# The monitors of this API server process, in the request form (set once at
# start by load_monitors; empty: none).
_monitors: list[dict[str, Any]] = []


def load_monitors(args: Any) -> None:
    """Read ``args.monitors`` (None: no monitors), check every monitor
    against ``args.probes``, and keep them for :func:`put_monitors`.
    ValueError naming the file and why, which stops the server at start."""
    path = getattr(args, "monitors", None)
    _monitors.clear()
    if path is None:
        return
    where = f"--monitors {path}"
    probes_dir = getattr(args, "probes", None)
    if probes_dir is None:
        raise ValueError(f"{where}: monitors read probes; start the server with --probes DIR too")
    try:
        text = Path(path).expanduser().read_text()
    except OSError as e:
        raise ValueError(f"{where}: cannot read it ({e.strerror or e})") from None
    try:
        if Path(path).suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # the parser's own message says where
        raise ValueError(f"{where}: not valid {Path(path).suffix or 'JSON'} ({e})") from None
    if isinstance(data, dict) and set(data) == {"monitors"}:
        data = data["monitors"]
    probes = {p.name: p.entry() for p in read_probe_dir(probes_dir)}
    try:
        actions = check_monitors(data, probes)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    _monitors.extend(data)
    # Firings go to the activation store, if the server has one, from start.
    from vllm_hidden_states.frontend import firings
    from vllm_hidden_states.store import choice_writer

    choice_writer.open_store(args)
    names = getattr(args, "served_model_name", None) or [getattr(args, "model", "")]
    firings.model_id = str(names[0])
    logger.info(
        "probe monitors on every request: %s",
        ", ".join(f"{a.label} ({a.probe} {a.then})" for a in actions),
    )


def monitors_loaded() -> bool:
    """Whether this API server has monitors."""
    return bool(_monitors)


def put_monitors(params: Any) -> None:
    """Put this server's monitors on a request's ``SamplingParams``; take
    away any a client sent under their name (``vllm_xargs``)."""
    extra = dict(params.extra_args or {})
    if _monitors:
        extra[MONITORS_FIELD] = [dict(m) for m in _monitors]
    elif MONITORS_FIELD in extra:
        del extra[MONITORS_FIELD]
    else:
        return
    params.extra_args = extra or None
