# SPDX-License-Identifier: Apache-2.0
"""Steering: the shared contract (engine configuration, request rules, wire form).

A request steers with a list of *interventions* (``SamplingParams.steering``;
the OpenAI ``steering`` field), each written into the residual stream inside
the model's forward (:mod:`vllm_hidden_states.worker.steering`). One
intervention is a dict:

* ``point``: a residual-stream point, as addressed for capture
  (:func:`vllm_hidden_states.points.parse_point`): ``resid_pre.i`` (HF layer
  ``i``), ``attn_out.i``, ``resid_mid.i``, ``mlp_out.i``, ``resid_post.i``;
  the engine steers the points ``--steering-points`` made steerable at start;
* ``op``: ``"add"`` (``x += strength * v``, the default), ``"ablate"``
  (``x -= (x . d) d`` with ``d = v / |v|``: the component along ``v`` is
  removed) or ``"clamp_sae_feature"`` (``x += (value - f(x)) * W_dec[f]``,
  ``f`` feature ``sae_feature`` of the engine's SAE (``--sae``), at the SAE's
  point: ``point`` may be left out);
* for add / ablate, the vector, one of ``vector`` (``hidden_size`` finite
  numbers), ``name`` (a vector of ``--steering-vectors DIR``, listed at GET
  /v1/steering_vectors) or ``sae_feature`` (the raw decoder row ``W_dec[f]``
  of the engine's SAE);
* ``strength`` (``add`` only; default 1.0); ``value`` (``clamp_sae_feature``
  only; default 0.0: the feature switched off);
* ``positions``: ``"all"`` (prompt and output, the default), ``"prompt"``,
  ``"generated"`` or a window ``{"start": s, "end": e}`` of prompt + output
  positions.

Order: interventions at one point apply in list order, steering before
capture (a request that also captures that point sees the steered stream).
At most one ``ablate`` per point per request (two projections do not compose
into one), and a ``clamp_sae_feature`` is the only intervention at its point
(it reads the stream through the SAE's encoder). Clamping needs a
``standard`` or ``jumprelu`` SAE without activation normalization, where
``f(x) = act((x - b_dec) . W_enc[:, f] + b_enc[f])`` depends on ``x``
through one dot product.

The front-end resolves the list once (:func:`check_steering`: the rules both
surfaces apply) into its *wire form*, a list of dicts with the keys of
:data:`WIRE_KEYS`, written back on ``SamplingParams.steering``: the vectors of
``vector`` as float32 values (lists of Python floats), the point as its capture
id, the positions as ``start``/``end`` over prompt + output. The worker reads
it from the request's ``SamplingParams``; an extract (the post-sampling
prefill of "last") carries it to replay the steering over the positions it
recomputes. :func:`steering_digest` salts the request's prefix-cache hashes
(vLLM's ``cache_salt``), so a steered request never shares KV blocks with a
request steered differently, or not at all.

This module imports nothing from vLLM at module level.
"""

import hashlib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_hidden_states.layers import ModelLayers, model_layers_for
from vllm_hidden_states.points import POSITIONS, Window, parse_point, point_id, window_of
from vllm_hidden_states.request_fields import check_positions, window_problem

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# ``additional_config["hidden_states"]["steering"]``.
STEERING_KEY = "steering"

STEERING_OPS: tuple[str, ...] = ("add", "ablate", "clamp_sae_feature")
# Points that can be steered: those of the residual stream and the blocks'
# contributions to it (not patterns or neurons).
STEERABLE_KINDS: tuple[str, ...] = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
# Network order of the kinds inside one decoder layer: interventions written
# at one module run in this order.
KIND_ORDER = {kind: i for i, kind in enumerate(STEERABLE_KINDS)}
DEFAULT_STEERING_POINTS: tuple[str, ...] = ("resid_pre",)
DEFAULT_MAX_INTERVENTIONS = 4

INTERVENTION_KEYS = (
    "point",
    "op",
    "vector",
    "name",
    "sae_feature",
    "strength",
    "value",
    "positions",
)
# The wire form: the request's keys, the point's capture id after it, and the
# positions as start/end over prompt + output.
WIRE_KEYS = (INTERVENTION_KEYS[0], "id", *INTERVENTION_KEYS[1:-1], "start", "end")

ENABLE_STEERING_HINT = (
    "start the engine with enable_steering=True (LLM / EngineArgs) or "
    "`vllm serve MODEL --enable-steering`"
)


def steering_entry(
    points: str | list[str] | None,
    vectors_dir: str | None,
    max_interventions: int | None,
    sae_path: str | None = None,
) -> dict[str, Any]:
    """``additional_config["hidden_states"]["steering"]`` (it keys vLLM's
    compile cache with the rest of the entry: the steerable points are in the
    compiled graph). ``vectors``: ``{name: length}`` of the safetensors files
    in ``vectors_dir``, read from their headers (the workers load the data)."""
    if points is None:
        items = list(DEFAULT_STEERING_POINTS)
    else:
        items = list(points) if isinstance(points, (list, tuple)) else str(points).split(",")
        items = [str(x).strip() for x in items if str(x).strip()]
        if not items:
            raise ValueError(
                "--steering-points must be 'all', kinds such as 'resid_pre,attn_out' "
                f"(every layer) or addresses such as 'resid_pre.3', got {points!r}"
            )
    k = DEFAULT_MAX_INTERVENTIONS if max_interventions is None else max_interventions
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"--max-steering must be a positive integer, got {max_interventions!r}")
    entry: dict[str, Any] = {"points": items, "max_interventions": k, "vectors": {}}
    if sae_path:
        entry["clamp_problem"] = clamp_problem(sae_path)
    if vectors_dir:
        entry["vectors_dir"] = os.path.abspath(vectors_dir)
        entry["vectors"] = read_vector_names(entry["vectors_dir"])
    return entry


def clamp_problem(sae_path: str) -> str | None:
    """Why ``clamp_sae_feature`` cannot use the SAE at ``sae_path`` (its
    ``cfg.json``), or None: the feature must depend on the stream through one
    dot product (``standard`` / ``jumprelu``, no activation normalization)."""
    import json

    from vllm_hidden_states.sae import CFG_FILE

    cfg = json.loads((Path(sae_path) / CFG_FILE).read_text())
    architecture = cfg.get("architecture", "standard")
    norm = cfg.get("normalize_activations") or "none"
    if architecture not in ("standard", "jumprelu"):
        return (
            f"the engine's SAE is {architecture!r}: a feature of a top-k SAE depends "
            "on every other feature; clamp_sae_feature needs a standard or jumprelu SAE"
        )
    if norm != "none":
        return (
            f"the engine's SAE normalizes its input ({norm!r}); clamp_sae_feature "
            "needs normalize_activations 'none'"
        )
    return None


def read_vector_names(directory: str) -> dict[str, int]:
    """``{name: length}`` of every 1-D tensor in the ``*.safetensors`` files
    of ``directory``. A name is ``file stem`` when the file holds one
    tensor, else ``stem/tensor``. ValueError for a missing directory, a
    tensor that is not 1-D, or one with a non-finite value or only zeros
    (it would steer nothing, and an ablation needs a direction): the values
    are read once here, at start, so no request meets them later."""
    import numpy as np
    from safetensors import safe_open

    if not os.path.isdir(directory):
        raise ValueError(f"--steering-vectors {directory!r} is not a directory")
    names: dict[str, int] = {}
    for file in sorted(os.listdir(directory)):
        if not file.endswith(".safetensors"):
            continue
        stem = file[: -len(".safetensors")]
        with safe_open(os.path.join(directory, file), framework="numpy") as f:
            keys = list(f.keys())
            for key in keys:
                shape = f.get_slice(key).get_shape()
                name = stem if len(keys) == 1 else f"{stem}/{key}"
                if len(shape) != 1:
                    raise ValueError(
                        f"--steering-vectors: {file} tensor {key!r} has shape "
                        f"{list(shape)}; steering vectors are 1-D [hidden_size]"
                    )
                values = np.asarray(f.get_tensor(key), dtype=np.float64)
                if not np.isfinite(values).all() or not values.any():
                    raise ValueError(
                        f"--steering-vectors: {file} tensor {key!r} has "
                        f"{'non-finite values' if not np.isfinite(values).all() else 'only zeros'}"
                        "; a steering vector needs finite values, not all zero"
                    )
                names[name] = int(shape[0])
    return names


def vector_files(directory: str) -> dict[str, tuple[str, str]]:
    """``{name: (file path, tensor key)}`` of ``directory`` (the names of
    :func:`read_vector_names`)."""
    from safetensors import safe_open

    out: dict[str, tuple[str, str]] = {}
    for file in sorted(os.listdir(directory)):
        if not file.endswith(".safetensors"):
            continue
        path = os.path.join(directory, file)
        stem = file[: -len(".safetensors")]
        with safe_open(path, framework="numpy") as f:
            keys = list(f.keys())
        for key in keys:
            out[stem if len(keys) == 1 else f"{stem}/{key}"] = (path, key)
    return out


def steerable_ids(
    items: list[str], num_layers: int, architecture: "str | ModelLayers | None"
) -> tuple[int, ...]:
    """Capture ids of ``--steering-points`` (``"all"``: every steerable kind
    at every layer where it is exact; a kind alone: every layer where it is
    exact; addresses); ValueError naming what is allowed."""
    model = (
        architecture
        if isinstance(architecture, ModelLayers)
        else model_layers_for(architecture, num_layers)
    )

    def kinds_at(i: int) -> list[str]:
        return [k for k in model.kinds_at(i) if k in STEERABLE_KINDS]

    ids: set[int] = set()
    wanted: list[tuple[str, int]]
    for item in items:
        if item == "all":
            wanted = [(k, i) for i in range(num_layers) for k in kinds_at(i)]
        elif item in STEERABLE_KINDS:
            wanted = [(item, i) for i in range(num_layers) if item in kinds_at(i)]
            if not wanted:
                raise ValueError(
                    f"--steering-points {item!r}: no decoder layer of this model has it "
                    f"exactly ({model.why_not(item, num_layers - 1)})"
                )
        else:
            try:
                wanted = [parse_point(item, num_layers)]
            except ValueError as e:
                raise ValueError(
                    f"--steering-points entry {e} (or 'all', or one of the steerable "
                    f"kinds {list(STEERABLE_KINDS)} alone: every layer)"
                ) from None
        for kind, layer in wanted:
            if kind not in STEERABLE_KINDS:
                raise ValueError(
                    f"--steering-points {item!r}: {kind} cannot be steered; steerable "
                    f"kinds: {list(STEERABLE_KINDS)}"
                )
            if kind not in kinds_at(layer):
                raise ValueError(
                    f"--steering-points {item!r}: {kind} cannot be steered there: "
                    f"{model.why_not(kind, layer)}"
                )
            ids.add(point_id(kind, layer, num_layers))  # type: ignore[arg-type]
    return tuple(sorted(ids))


@dataclass(frozen=True)
class SteeringConfig:
    """What one engine can steer.

    Attributes:
        num_layers: ``L``.
        ids: steerable capture ids (:func:`vllm_hidden_states.points.point_id`).
        points_given: ``--steering-points`` as configured.
        max_interventions: interventions one request may carry.
        vectors: ``{name: length}`` of ``--steering-vectors``.
        vectors_dir: that directory (absolute), None without one.
        architecture: the model's architecture (its steerable kinds).
    """

    num_layers: int
    ids: tuple[int, ...]
    points_given: tuple[str, ...]
    max_interventions: int
    vectors: dict[str, int] = field(default_factory=dict)
    vectors_dir: str | None = None
    architecture: str | None = None
    # The engine's SAE (--sae): its feature count, the capture id it reads
    # (clamp_sae_feature's point), and why it cannot clamp (None: it can).
    sae_d_sae: int | None = None
    sae_id: int | None = None
    sae_clamp_problem: str | None = None

    @classmethod
    def from_vllm_config(cls, vllm_config: "VllmConfig") -> "SteeringConfig | None":
        """The engine's steering, or None when it is not enabled."""
        from vllm_hidden_states.hidden_states_config import ADDITIONAL_CONFIG_KEY, num_hidden_layers

        entry = ((vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY) or {}).get(
            STEERING_KEY
        )
        if entry is None:
            return None
        from vllm_hidden_states.hidden_states_config import sae_capture_id

        n = num_hidden_layers(vllm_config)
        architecture = (vllm_config.model_config.architectures or [None])[0]
        model = ModelLayers.of(vllm_config.model_config, n)
        sae = vllm_config.additional_config[ADDITIONAL_CONFIG_KEY].get("sae")
        return cls(
            n,
            steerable_ids(entry["points"], n, model),
            tuple(entry["points"]),
            int(entry["max_interventions"]),
            dict(entry.get("vectors") or {}),
            entry.get("vectors_dir"),
            architecture,
            None if sae is None else int(sae["d_sae"]),
            None if sae is None else sae_capture_id(sae, n, model),
            entry.get("clamp_problem"),
        )

    def describe_points(self) -> str:
        return ", ".join(
            f"{item} (every layer)" if item == "all" or item in STEERABLE_KINDS else item
            for item in self.points_given
        )

    def table_slots(self, max_num_seqs: int) -> int:
        """Rows of the worker's vector tables: slot 0 (zeros) and, per running
        request, one per stretch of positions with the same interventions at
        a point (at most ``2 * max_interventions - 1``)."""
        return 1 + max_num_seqs * (2 * self.max_interventions - 1)


def _fail(i: int, key: str, message: str) -> ValueError:
    return ValueError(f"steering[{i}].{key}: {message}")


def _finite_vector(value: Any, width: int, i: int) -> list[float]:
    """``value`` as ``width`` float32 values (Python floats)."""
    import numpy as np

    numbers = (
        value.dtype.kind in "fiu"
        if isinstance(value, np.ndarray)
        else isinstance(value, (list, tuple))
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
    )
    if not numbers:
        raise _fail(i, "vector", f"must be a list of {width} numbers (not strings or booleans)")
    try:
        array = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError):
        raise _fail(i, "vector", f"must be a list of {width} numbers") from None
    if array.ndim != 1 or array.shape[0] != width:
        raise _fail(
            i,
            "vector",
            f"must be {width} numbers (the point's width, hidden_size), got shape "
            f"{list(array.shape)}",
        )
    if not np.isfinite(array).all():
        raise _fail(i, "vector", "must be finite (no NaN or infinity)")
    return array.tolist()


def _span(positions: Any, prompt_len: int, reach: int, i: int) -> tuple[int, int | None]:
    """``(start, end)`` over prompt + output of an intervention's positions
    (``end`` None: to the end)."""
    if positions is None or positions == "all":
        return 0, None
    if positions == "last" or (isinstance(positions, str) and positions not in POSITIONS):
        raise _fail(
            i,
            "positions",
            "must be 'all', 'prompt', 'generated' or {'start': s, 'end': e} "
            f"(prompt + output positions), got {positions!r}",
        )
    try:
        checked = check_positions(positions)
    except ValueError as e:
        raise _fail(i, "positions", str(e)) from None
    if checked == "prompt":
        return 0, prompt_len
    window = window_of(checked, prompt_len)
    assert isinstance(window, Window)  # "generated" or a window
    if (problem := window_problem(window, prompt_len, reach)) is not None:
        raise _fail(i, "positions", problem)
    return window.start, window.end


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _parse_steerable(point: Any, i: int, n: int) -> tuple[str, int]:
    try:
        kind, layer = parse_point(point, n)
    except ValueError as e:
        raise _fail(i, "point", str(e)) from None
    if kind not in STEERABLE_KINDS:
        raise _fail(
            i, "point", f"{kind} cannot be steered; steerable kinds: {list(STEERABLE_KINDS)}"
        )
    return kind, layer


def _needs_sae(cfg: SteeringConfig, i: int, key: str) -> None:
    if cfg.sae_d_sae is None:
        raise _fail(
            i, key, "needs an SAE on this engine; start it with --sae DIR (sae=DIR) as well"
        )


def _sae_point(item: dict[str, Any], cfg: SteeringConfig, i: int) -> str:
    """The point of a clamp: the SAE's (``point`` may be left out; given, it
    must be the SAE's)."""
    from vllm_hidden_states.points import point_of_id

    _needs_sae(cfg, i, "op")
    if cfg.sae_clamp_problem is not None:
        raise _fail(i, "op", cfg.sae_clamp_problem)
    n = cfg.num_layers
    assert cfg.sae_id is not None  # an SAE's capture id is known at start
    if cfg.sae_id >= n and point_of_id(cfg.sae_id, n) is None:
        raise _fail(
            i, "op", "the engine's SAE reads the final post-norm layer, which is not steerable"
        )
    where = point_of_id(cfg.sae_id, n)
    address = f"resid_pre.{cfg.sae_id}" if where is None else f"{where[0]}.{where[1]}"
    given = item.get("point")
    if given is not None:
        kind, layer = _parse_steerable(given, i, n)
        if point_id(kind, layer, n) != cfg.sae_id:  # type: ignore[arg-type]
            raise _fail(
                i,
                "point",
                f"clamp_sae_feature writes at the SAE's point, {address!r}; got {given!r} "
                "(leave point out)",
            )
    return address


def _sae_feature(value: Any, cfg: SteeringConfig, i: int) -> int:
    _needs_sae(cfg, i, "sae_feature")
    d_sae = cfg.sae_d_sae
    assert d_sae is not None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < d_sae:
        raise _fail(i, "sae_feature", f"must be a feature id in 0..{d_sae - 1}, got {value!r}")
    return value


def _vector_source(
    item: dict[str, Any], cfg: SteeringConfig, hidden_size: int, i: int
) -> tuple[list[float] | None, str | None, int | None]:
    """``(vector, name, sae_feature)`` of an add / ablate: exactly one set."""
    given = [k for k in ("vector", "name", "sae_feature") if item.get(k) is not None]
    if len(given) != 1:
        raise _fail(
            i,
            "vector",
            "give exactly one of 'vector' (inline numbers), 'name' (--steering-vectors) "
            f"or 'sae_feature' (a decoder row of the engine's SAE); got {given or 'none'}",
        )
    if given[0] == "vector":
        return _finite_vector(item["vector"], hidden_size, i), None, None
    if given[0] == "sae_feature":
        return None, None, _sae_feature(item["sae_feature"], cfg, i)
    name = item["name"]
    if not isinstance(name, str) or name not in cfg.vectors:
        known = sorted(cfg.vectors) or "none (start with --steering-vectors DIR)"
        raise _fail(i, "name", f"unknown steering vector {name!r}; known: {known}")
    if cfg.vectors[name] != hidden_size:
        raise _fail(
            i,
            "name",
            f"vector {name!r} has {cfg.vectors[name]} values; this model's "
            f"hidden_size is {hidden_size}",
        )
    return None, name, None


def check_steering(
    value: Any,
    cfg: SteeringConfig,
    hidden_size: int,
    prompt_len: int,
    reach: int,
) -> list[dict[str, Any]]:
    """The wire form of a request's ``steering`` (see module doc); ValueError
    naming the intervention, the key and what is allowed. ``reach``: the
    longest prompt + output the request can have (windows must start
    before it)."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(
            "steering must be a non-empty list of interventions such as "
            '[{"point": "resid_pre.3", "op": "add", "name": "honesty", "strength": 4}]'
        )
    if len(value) > cfg.max_interventions:
        raise ValueError(
            f"steering has {len(value)} interventions; this engine allows at most "
            f"{cfg.max_interventions} per request (--max-steering)"
        )
    n = cfg.num_layers
    wire: list[dict[str, Any]] = []
    ablated: dict[int, int] = {}
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ValueError(f"steering[{i}] must be an object with keys {list(INTERVENTION_KEYS)}")
        unknown = sorted(set(item) - set(INTERVENTION_KEYS))
        if unknown:
            raise _fail(
                i, unknown[0], f"unknown key; an intervention has {list(INTERVENTION_KEYS)}"
            )
        op = item.get("op", "add")
        if op not in STEERING_OPS:
            raise _fail(i, "op", f"must be one of {list(STEERING_OPS)}, got {op!r}")
        point = item.get("point")
        if op == "clamp_sae_feature":
            point = _sae_point(item, cfg, i)
        kind, layer = _parse_steerable(point, i, n)
        capture_id = point_id(kind, layer, n)  # type: ignore[arg-type]
        if capture_id not in cfg.ids:
            raise _fail(
                i,
                "point",
                f"{point!r} is not steerable on this engine; steerable points: "
                f"{cfg.describe_points()} (fixed at start by --steering-points)",
            )
        vector = name = feature = None
        strength, value = item.get("strength"), item.get("value")
        if op == "clamp_sae_feature":
            for key in ("vector", "name", "strength"):
                if item.get(key) is not None:
                    raise _fail(i, key, "clamp_sae_feature takes sae_feature and value only")
            feature = _sae_feature(item.get("sae_feature"), cfg, i)
            if value is None:
                value = 0.0
            elif not _finite_number(value):
                raise _fail(i, "value", f"must be a finite number, got {value!r}")
            strength = 1.0
        else:
            if value is not None:
                raise _fail(i, "value", "value belongs to clamp_sae_feature only")
            vector, name, feature = _vector_source(item, cfg, hidden_size, i)
        if op == "ablate":
            if strength is not None:
                raise _fail(i, "strength", "ablate takes no strength (it removes the component)")
            if capture_id in ablated:
                raise _fail(
                    i,
                    "op",
                    f"steering[{ablated[capture_id]}] already ablates at {point!r}; one "
                    "ablate per point per request",
                )
            if vector is not None and not any(vector):
                raise _fail(i, "vector", "ablate needs a non-zero direction")
            ablated[capture_id] = i
            strength = 1.0
        elif strength is None:
            strength = 1.0
        elif not _finite_number(strength):
            raise _fail(i, "strength", f"must be a finite number, got {strength!r}")
        start, end = _span(item.get("positions"), prompt_len, reach, i)
        wire.append(
            {
                "point": f"{kind}.{layer}",
                "id": capture_id,
                "op": op,
                "vector": vector,
                "name": name,
                "sae_feature": feature,
                "strength": float(strength),
                "value": None if value is None else float(value),
                "start": start,
                "end": end,
            }
        )
    for i, item in enumerate(wire):
        if item["op"] == "clamp_sae_feature":
            others = [j for j, x in enumerate(wire) if x["id"] == item["id"] and j != i]
            if others:
                raise _fail(
                    i,
                    "op",
                    f"clamp_sae_feature at {item['point']!r} reads the stream there; "
                    f"steering[{others[0]}] also writes it: a clamp is the only "
                    "intervention at its point",
                )
    return wire


def read_after_steering(
    wire: list[dict[str, Any]],
    points: list[Any] | None,
    num_layers: int,
    sae_hook: str | None = None,
    sae_features: bool = False,
) -> str | None:
    """Why what a request reads cannot be read as asked beside its steering,
    or None: ``resid_post.i`` (below the last layer) is captured where the
    stream enters layer ``i + 1``, after any intervention at
    ``resid_pre.(i+1)``, where TransformerLens reads ``hook_resid_post``
    before it. ``wire``: :func:`check_steering`'s result; ``points``: the
    request's ``hidden_states_points`` (validated); ``sae_hook``: the hook
    name of the engine's SAE, if any; ``sae_features``: whether the request
    asks its features. A clamp sits at the SAE's hook: one at
    ``hook_resid_post.i`` comes before what reads resid_post.i."""
    post = SAE_RESID_POST.match(sae_hook or "")
    steered = {
        int(item["point"].split(".")[1]): i
        for i, item in enumerate(wire)
        if item["point"].startswith("resid_pre.")
        and not (item["op"] == "clamp_sae_feature" and post is not None)
    }
    reads: list[tuple[str, int, str]] = []  # (kind, layer, who reads it)
    for address in points or ():
        try:
            point = parse_point(address, num_layers)
        except ValueError:
            continue
        reads.append((point[0], point[1], f"hidden_states_points asks {address!r}"))
    if sae_features and post is not None:
        reads.append(("resid_post", int(post[1]), f"sae_features reads the SAE at {sae_hook!r}"))
    for kind, layer, reader in reads:
        i = steered.get(layer + 1)
        if kind == "resid_post" and layer + 1 < num_layers and i is not None:
            other = (
                f", or ask resid_mid.{layer} and mlp_out.{layer} (their sum is "
                f"resid_post.{layer} before it)"
                if reader.startswith("hidden_states_points")
                else ""
            )
            return (
                f"steering[{i}] writes resid_pre.{layer + 1} and {reader}: both are "
                f"the stream between layers {layer} and {layer + 1}, which this engine "
                "reads once, after that intervention, so it would be read steered where "
                "it comes before the intervention in the network. Steer at "
                f"resid_post.{layer} instead (the same intervention, read steered under "
                f"both names){other}"
            )
    return None


# An SAE's hook name that reads resid_post.i (layer i + 1 of HF's indexing).
SAE_RESID_POST = re.compile(r"^blocks\.(\d+)\.hook_resid_post$")


def steering_digest(wire: list[dict[str, Any]]) -> str:
    """A digest of a resolved steering list (points, ops, vectors, strengths,
    positions): equal for equal steering, the suffix of the request's
    ``cache_salt``."""
    import orjson

    return hashlib.sha256(orjson.dumps(wire, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


def salted(cache_salt: str | None, wire: list[dict[str, Any]]) -> str:
    """The cache salt of a steered request: its own salt, if any, and the
    steering digest."""
    return f"{cache_salt or ''}|steering:{steering_digest(wire)}"
