# SPDX-License-Identifier: Apache-2.0
"""Finished chat/completions choices written to the activation store.

The API server's response side (:mod:`vllm_hidden_states.server.openai_response`)
tracks each choice of a request that asked for SAE features (or, with
``--activation-store-hidden-states``, hidden states) in a :class:`StoredChoice`
and appends it here when the choice finishes, off the serving path: a failing
store is logged, never an error for the request. One
:class:`~.activation_store.ActivationStore` per API-server process, opened on
the first request from the ``--activation-store*`` flags and closed at exit.
"""

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllm_hidden_states.points import Window, parse_point

logger = logging.getLogger(__name__)

_store: Any = None  # ActivationStore, False when the server has none, None: not yet read
_store_hidden = False  # --activation-store-hidden-states


def open_store(args: Any) -> None:
    """Open the process's store from the app's ``--activation-store*`` args
    (``args`` None: the server has none); once per process. Never raises."""
    global _store, _store_hidden
    if _store is not None:
        return
    root = getattr(args, "activation_store", None)
    if not root:
        _store = False
        return
    try:
        import atexit

        from vllm_hidden_states.store.activation_store import ActivationStore

        _store = ActivationStore(
            root,
            retention_days=getattr(args, "activation_store_retention_days", None),
        )
        _store_hidden = bool(getattr(args, "activation_store_hidden_states", False))
        atexit.register(_store.close, 10.0)
        logger.info(
            "vllm-hidden-states: activation store at %s (hidden states: %s)",
            root,
            _store_hidden,
        )
    except Exception as e:  # noqa: BLE001 - serve without a store
        logger.warning("vllm-hidden-states: activation store %s unavailable: %s", root, e)
        _store = False


def is_open() -> bool:
    """Whether :func:`open_store` has run (whatever it found)."""
    return _store is not None


def opened() -> tuple[Any, bool]:
    """The process's store (None: none) and whether it keeps hidden states."""
    return _store or None, _store_hidden


class ChoiceAsk(Protocol):
    """What the store reads of a request's ask (``server.openai_request.HiddenStatesAsk``)."""

    positions: Any  # "last" | "all" | "prompt" | "generated" | Window
    keys: tuple[int | str, ...]  # the rows of hidden_states: layers, then points
    neurons: tuple[str, ...]

    def first_position(self, prompt_len: int) -> int: ...


def response_id(engine_request_id: str) -> str:
    """The response's ``id`` from the engine request id of one of its
    prompts: vLLM 0.32's completions serving runs prompt ``i`` of response
    ``cmpl-<id>`` as ``cmpl-<id>-<i>``; chat runs its one prompt under the
    response's own ``chatcmpl-<id>``."""
    if engine_request_id.startswith("cmpl-"):
        return engine_request_id.rsplit("-", 1)[0]
    return engine_request_id


@dataclass
class StoredChoice:
    """One choice's token ids, SAE features and states, as the result
    iterator delivered them, stored under the response's id and the
    choice's index in it."""

    request_id: str  # the response's id
    choice_index: int  # the choice's index in the response
    sae_name: str  # the engine's SAE (its directory name): the store's sae_release
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    features: list[dict[str, Any]] = field(default_factory=list)
    states: list[dict[int | str, Any]] = field(default_factory=list)
    scores: list[dict[int | str, Any]] = field(default_factory=list)  # probe scores, by name

    @classmethod
    def first(cls, res: Any, choice_index: int, sae_name: str) -> "StoredChoice":
        """Made on the choice's first output (a vLLM ``RequestOutput``)."""
        return cls(
            response_id(res.request_id), choice_index, sae_name, list(res.prompt_token_ids or ())
        )

    def track(self, output: Any) -> None:
        """Add one ``CompletionOutput``: the server streams DELTA outputs and
        otherwise yields one final output (FINAL_ONLY), so appending is right
        for both."""
        self.output_ids += output.token_ids
        if output.sae_features is not None:
            self.features.append(output.sae_features)
        if output.hidden_states is not None:
            self.states.append(output.hidden_states)
        if getattr(output, "probe_scores", None) is not None:
            self.scores.append(output.probe_scores)

    def append_to(
        self, store: Any, ask: ChoiceAsk, model: str, num_layers: int, hidden_states: bool
    ) -> None:
        """Append the finished choice's features (and, with ``hidden_states``,
        its states) to ``store``; ``num_layers`` names points absolutely.
        Never raises."""
        try:
            self._append(store, ask, model, num_layers, hidden_states)
        except Exception as e:  # noqa: BLE001 - never fail the request
            logger.warning("activation store: request %s not stored: %s", self.request_id, e)

    def _append(
        self, store: Any, ask: ChoiceAsk, model: str, num_layers: int, hidden_states: bool
    ) -> None:
        import numpy as np
        import torch

        tokens = np.asarray(self.prompt_ids + self.output_ids, dtype=np.int64)
        n_prompt = len(self.prompt_ids)
        if ask.positions == "last":
            positions = np.arange(len(tokens) - 1, len(tokens))
        elif ask.positions == "prompt":
            positions = np.arange(n_prompt)
        else:
            end = ask.positions.end if isinstance(ask.positions, Window) else None
            stop = len(tokens) if end is None else min(end, len(tokens))
            positions = np.arange(min(ask.first_position(n_prompt), stop), stop)
        if self.features:
            parts = self.features
            ids = torch.cat([p["ids"] for p in parts])[-len(positions) :]
            values = torch.cat([p["values"] for p in parts])[-len(positions) :]
            if ids.shape[0] == len(positions):
                from vllm_hidden_states.store.activation_store import SaeSource

                point = parts[0].get("point")
                store.append_sae_features(
                    self.request_id,
                    model_id=model,
                    sae=SaeSource(
                        release=self.sae_name,
                        layer=(
                            parts[0]["layer"]
                            if point is None
                            else parse_point(point, num_layers)[1]
                        ),
                        point=point,
                    ),
                    token_ids=tokens[positions],
                    feature_ids=ids.numpy(),
                    values=values.numpy(),
                    prompt_len=n_prompt,
                    positions=positions,
                    choice_index=self.choice_index,
                )
        if self.scores:
            joined = _joined(self.scores, tuple(self.scores[0]))
            n = next(iter(joined.values())).shape[0]
            store.append_probe_scores(
                self.request_id,
                model_id=model,
                token_ids=tokens[positions[-n:]],
                scores={name: rows.numpy() for name, rows in joined.items()},
                prompt_len=n_prompt,
                positions=positions[-n:],
                choice_index=self.choice_index,
            )
        if hidden_states and self.states and ask.keys:
            states = _canonical(_joined(self.states, (*ask.keys, *ask.neurons)), num_layers)
            n = next(iter(states.values())).shape[0]
            store.append_hidden_states(
                self.request_id,
                model_id=model,
                token_ids=tokens[positions[-n:]],
                states={k: v[-n:] for k, v in states.items()},
                prompt_len=n_prompt,
                positions=positions[-n:],
                choice_index=self.choice_index,
            )


def _joined(chunks: list[dict[int | str, Any]], keys: tuple) -> dict[int | str, Any]:
    """The choice's state deltas as one ``{key: [positions, width]}``."""
    import torch

    if len(chunks) == 1:
        return chunks[0]
    return {k: torch.cat([c[k] for c in chunks]) for k in keys}


def _canonical(states: dict[int | str, Any], num_layers: int) -> dict[int | str, Any]:
    """Point addresses as ``"kind.i"`` with ``i`` absolute, for the store,
    whose rows are flat: attn_z's ``[positions, heads, head_dim]`` is stored
    ``[positions, heads * head_dim]`` (head h at columns h * head_dim on)."""
    out: dict[int | str, Any] = {}
    for key, rows in states.items():
        if isinstance(key, str):
            kind, layer = parse_point(key, num_layers)
            key = f"{kind}.{layer}"
        out[key] = rows.flatten(1) if rows.ndim > 2 else rows
    return out
