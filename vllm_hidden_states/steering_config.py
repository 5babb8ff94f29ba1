# SPDX-License-Identifier: Apache-2.0
"""SteeringConfig: what one engine can steer, read at start by every process.

``--enable-steering`` and its options become the ``steering`` part of the
``additional_config["hidden_states"]`` entry (:func:`steering_entry`), which
keys vLLM's compile cache: the steerable points are in the compiled graph. The
request form and its rules are ``steering_fields.py``; the in-graph op is
``worker/steering_op.py``. Imports nothing from vLLM at module level.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_hidden_states.layers import ModelLayers, model_layers_for
from vllm_hidden_states.points import parse_point, point_id

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# ``additional_config["hidden_states"]["steering"]``.
STEERING_KEY = "steering"

STEERING_OPS: tuple[str, ...] = (
    "add",
    "ablate",
    "clamp_sae_feature",
    "patch",
    "sae_splice",
    "ablate_heads",
)
# The ops that replace the stream (rather than add to it): each is the only
# intervention of its request at its point.
REWRITE_OPS: tuple[str, ...] = ("patch", "sae_splice", "ablate_heads")
# The ops whose rows live in the patch table (``n`` rows each on the wire).
TABLE_OPS: tuple[str, ...] = ("patch", "ablate_heads")
# Points that can be steered: those of the residual stream and the blocks'
# contributions to it (not patterns or neurons).
STEERABLE_KINDS: tuple[str, ...] = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
# The heads' outputs (attn_z): written by ``patch`` and ``ablate_heads``
# only (no add, ablate, clamp or splice there), where the layer attends.
HEAD_KINDS: tuple[str, ...] = ("attn_z",)
HEAD_OPS: tuple[str, ...] = ("patch", "ablate_heads")
# Every kind --steering-points may name.
WRITABLE_KINDS: tuple[str, ...] = (*STEERABLE_KINDS, *HEAD_KINDS)
# ablate_heads' modes: the heads' columns set to zero, or to a given mean.
ABLATE_HEADS_MODES: tuple[str, ...] = ("zero", "mean")
# Network order of the kinds inside one decoder layer: interventions written
# at one module run in this order.
KIND_ORDER = {kind: i for i, kind in enumerate(STEERABLE_KINDS)}
DEFAULT_STEERING_POINTS: tuple[str, ...] = ("resid_pre",)
DEFAULT_MAX_INTERVENTIONS = 4
# Rows of the worker's patch table (every patched position of the requests in
# flight, all points together), float32 [rows, hidden_size] on the device.
DEFAULT_MAX_PATCH_ROWS = 2048
# Feature edits one sae_splice may carry (the worker's edit tables are this wide).
MAX_SAE_EDITS = 16

INTERVENTION_KEYS = (
    "point",
    "op",
    "vector",
    "name",
    "sae_feature",
    "strength",
    "value",
    "rows",
    "stored",
    "edits",
    "keep_error",
    "heads",
    "mode",
    "mean",
    "positions",
)
# Keys of per-head interventions: lowered into full-width rows on the wire.
HEAD_KEYS = ("heads", "mode", "mean")
ENABLE_STEERING_HINT = (
    "start the engine with enable_steering=True (LLM / EngineArgs) or "
    "`vllm serve MODEL --enable-steering`"
)
# The refusal of ``steering`` on an engine without it, on every surface.
STEERING_OFF = f"steering is not enabled on this engine; {ENABLE_STEERING_HINT}"


def steering_entry(
    points: str | list[str] | None,
    vectors_dir: str | None,
    max_interventions: int | None,
    sae_path: str | None = None,
    max_patch_rows: int | None = None,
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
    rows = DEFAULT_MAX_PATCH_ROWS if max_patch_rows is None else max_patch_rows
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(
            f"--max-patch-rows must be an integer >= 0 (0: no patching), got {max_patch_rows!r}"
        )
    entry: dict[str, Any] = {
        "points": items,
        "max_interventions": k,
        "max_patch_rows": rows,
        "vectors": {},
        "matrices": {},
    }
    if sae_path:
        entry["clamp_problem"] = clamp_problem(sae_path)
        entry["splice_problem"] = splice_problem(sae_path)
    if vectors_dir:
        entry["vectors_dir"] = os.path.abspath(vectors_dir)
        entry["vectors"], entry["matrices"] = read_vector_names(entry["vectors_dir"])
    return entry


def splice_problem(sae_path: str) -> str | None:
    """Why ``sae_splice`` cannot use the SAE at ``sae_path``, or None: the
    reconstruction ``decode(encode(x))`` is of ``x`` itself only where the
    SAE reads ``x`` unnormalized (a normalizing SAE reconstructs the
    normalized stream, whose scale per token it does not keep)."""
    import json

    from vllm_hidden_states.sae import CFG_FILE

    cfg = json.loads((Path(sae_path) / CFG_FILE).read_text())
    norm = cfg.get("normalize_activations") or "none"
    if norm != "none":
        return (
            f"the engine's SAE normalizes its input ({norm!r}): decode(encode(x)) "
            "reconstructs the normalized stream, not x; sae_splice needs "
            "normalize_activations 'none'"
        )
    return None


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


def read_vector_names(directory: str) -> tuple[dict[str, int], dict[str, list[int]]]:
    """``({name: length}, {name: [rows, width]})``: the 1-D vectors and the
    2-D matrices (rows for ``patch``) in the ``*.safetensors`` files of
    ``directory``. A name is ``file stem`` when the file holds one tensor,
    else ``stem/tensor``. ValueError for a missing directory, a tensor of
    another rank, or one with a non-finite value, or a vector of only zeros
    (it would steer nothing, and an ablation needs a direction): the values
    are read once here, at start, so no request meets them later."""
    import numpy as np
    from safetensors import safe_open

    if not os.path.isdir(directory):
        raise ValueError(f"--steering-vectors {directory!r} is not a directory")
    names: dict[str, int] = {}
    matrices: dict[str, list[int]] = {}
    for file in sorted(os.listdir(directory)):
        if not file.endswith(".safetensors"):
            continue
        stem = file[: -len(".safetensors")]
        with safe_open(os.path.join(directory, file), framework="numpy") as f:
            keys = list(f.keys())
            for key in keys:
                shape = f.get_slice(key).get_shape()
                name = stem if len(keys) == 1 else f"{stem}/{key}"
                if len(shape) not in (1, 2):
                    raise ValueError(
                        f"--steering-vectors: {file} tensor {key!r} has shape "
                        f"{list(shape)}; steering vectors are 1-D [hidden_size], "
                        "patch rows 2-D [positions, hidden_size]"
                    )
                values = np.asarray(f.get_tensor(key), dtype=np.float64)
                if not np.isfinite(values).all():
                    raise ValueError(
                        f"--steering-vectors: {file} tensor {key!r} has non-finite "
                        "values; steering vectors and patch rows must be finite"
                    )
                if len(shape) == 2:
                    matrices[name] = [int(shape[0]), int(shape[1])]
                    continue
                if not values.any():
                    raise ValueError(
                        f"--steering-vectors: {file} tensor {key!r} has only zeros; "
                        "a steering vector needs finite values, not all zero"
                    )
                names[name] = int(shape[0])
    return names, matrices


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
    items: list[str],
    num_layers: int,
    architecture: "str | ModelLayers | None",
) -> tuple[int, ...]:
    """Capture ids of ``--steering-points`` (``"all"``: every writable kind
    at every layer where it is exact, attn_z included where the layer
    attends; a kind alone: every layer where it is exact; addresses);
    ValueError naming what is allowed. Under tensor parallelism attn_z is
    writable too: each rank writes its own heads' columns of the rows
    (worker/steering_tables.py)."""
    model = model_layers_for(architecture, num_layers)

    def kinds_at(i: int) -> list[str]:
        return [k for k in model.kinds_at(i) if k in WRITABLE_KINDS]

    ids: set[int] = set()
    wanted: list[tuple[str, int]]
    for item in items:
        if item == "all":
            wanted = [(k, i) for i in range(num_layers) for k in kinds_at(i)]
        elif item in WRITABLE_KINDS:
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
                    f"kinds {list(WRITABLE_KINDS)} alone: every layer)"
                ) from None
        for kind, layer in wanted:
            if kind not in WRITABLE_KINDS:
                raise ValueError(
                    f"--steering-points {item!r}: {kind} cannot be steered; steerable "
                    f"kinds: {list(STEERABLE_KINDS)}, and {list(HEAD_KINDS)} for "
                    f"{list(HEAD_OPS)}"
                )
            if kind not in kinds_at(layer):
                raise ValueError(
                    f"--steering-points {item!r}: {kind} cannot be steered there: "
                    f"{model.why_not(kind, layer)}"
                )
            ids.add(point_id(kind, layer, num_layers))  # type: ignore[arg-type]
    return tuple(sorted(ids))


def z_head_dim(model_config: Any) -> int:
    """The size of one head's output (attn_z) from the model's config: the
    value heads' size, v_head_dim, where the config has one (MiniCPM3's
    heads output 64 values, its queries and keys have 96 dimensions), else
    the model's head size (0: a config without heads)."""
    v_head_dim = getattr(model_config.hf_text_config, "v_head_dim", None)
    if isinstance(v_head_dim, int) and v_head_dim > 0:
        return v_head_dim
    head_size = getattr(model_config, "get_head_size", None)
    try:
        return int(head_size()) if head_size is not None else 0
    except Exception:  # a config without heads (attn_z is then never writable)
        return 0


def z_shapes_of(model_config: Any, num_layers: int) -> tuple[tuple[int, int], ...]:
    """``(heads, head_dim)`` of each decoder layer's heads' outputs (attn_z,
    ``heads * head_dim`` wide) from the model's config: a layer's own entry
    of ``per_layer_config`` where the config has one (Gemma 4's full and
    sliding layers differ), else the model's query heads and
    :func:`z_head_dim`."""
    text = model_config.hf_text_config
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    head_dim = z_head_dim(model_config)
    per_layer = getattr(text, "per_layer_config", None)
    out = []
    for i in range(num_layers):
        own = per_layer[i] if per_layer else None
        # (HF 5's per-layer view of any config: its head_dim, unless it has
        # value heads of their own size, MiniCPM3's)
        own_v = getattr(own, "v_head_dim", None)
        own_dim = own_v if isinstance(own_v, int) and own_v > 0 else getattr(own, "head_dim", 0)
        out.append((int(getattr(own, "num_attention_heads", 0) or heads), int(own_dim or head_dim)))
    return tuple(out)


@dataclass(frozen=True)
class SteeringConfig:
    """What one engine can steer.

    Attributes:
        num_layers: ``L``.
        ids: steerable capture ids (:func:`vllm_hidden_states.points.point_id`).
        points_given: ``--steering-points`` as configured.
        max_interventions: interventions one request may carry.
        vectors: ``{name: length}`` of ``--steering-vectors``.
        matrices: ``{name: [rows, width]}``: its 2-D tensors (patch rows).
        max_patch_rows: rows of the worker's patch table (0: no patching).
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
    # Its decoder layers' classes: why a point is not steerable where its
    # layer lacks it (None: configs built by hand).
    model_layers: ModelLayers | None = None
    matrices: dict[str, list[int]] = field(default_factory=dict)
    max_patch_rows: int = DEFAULT_MAX_PATCH_ROWS
    # Why the engine's SAE cannot be spliced (None: it can, or no SAE).
    sae_splice_problem: str | None = None
    # (heads, head_dim) of each decoder layer's attn_z (z_shapes_of; empty:
    # configs built by hand without attn_z).
    z_shapes: tuple[tuple[int, int], ...] = ()

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
            model,
            dict(entry.get("matrices") or {}),
            int(entry.get("max_patch_rows", DEFAULT_MAX_PATCH_ROWS)),
            entry.get("splice_problem"),
            z_shapes_of(vllm_config.model_config, n),
        )

    def describe_points(self) -> str:
        return ", ".join(
            f"{item} (every layer)" if item == "all" or item in WRITABLE_KINDS else item
            for item in self.points_given
        )

    def table_slots(self, max_num_seqs: int) -> int:
        """Rows of the worker's vector tables: slot 0 (zeros) and, per running
        request, one per stretch of positions with the same interventions at
        a point (at most ``2 * max_interventions - 1``)."""
        return 1 + max_num_seqs * (2 * self.max_interventions - 1)
