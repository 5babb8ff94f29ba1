# SPDX-License-Identifier: Apache-2.0
"""The ``steering`` field of a request: its form, its rules, its wire form.

:func:`check_steering` is the one rule set of both surfaces (the front-end's
``frontend/input_fields.py`` and HTTP's checks); it returns the list's wire form,
:class:`~vllm_hidden_states.contract.Intervention` structs (point as capture
id, vectors as float32 values, positions as start/end), which the worker reads
and an extract replays. :func:`steering_digest` salts the
request's prefix-cache hashes. The form and its rules: docs/architecture.md,
"Steering: the request form".
"""

import hashlib
import math
import re
from typing import Any

from vllm_hidden_states.contract import Intervention
from vllm_hidden_states.points import POSITIONS, Window, parse_point, point_id, window_of
from vllm_hidden_states.request_fields import check_positions, window_problem
from vllm_hidden_states.steering_config import (
    ABLATE_HEADS_MODES,
    HEAD_KEYS,
    HEAD_KINDS,
    HEAD_OPS,
    INTERVENTION_KEYS,
    MAX_SAE_EDITS,
    REWRITE_OPS,
    STEERABLE_KINDS,
    STEERING_OPS,
    TABLE_OPS,
    SteeringConfig,
)


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


def _parse_steerable(point: Any, i: int, n: int, op: str = "add") -> tuple[str, int]:
    try:
        kind, layer = parse_point(point, n)
    except ValueError as e:
        raise _fail(i, "point", str(e)) from None
    if op == "ablate_heads" and kind not in HEAD_KINDS:
        raise _fail(
            i,
            "point",
            f"ablate_heads writes attention heads' outputs: its point is attn_z.<i> "
            f"(blocks.<i>.attn.hook_z), got {point!r} ({kind})",
        )
    if kind in HEAD_KINDS and op not in HEAD_OPS:
        raise _fail(
            i,
            "point",
            f"{kind} cannot be steered by {op!r}: the heads' outputs are written by "
            f"{list(HEAD_OPS)} only; steerable kinds for {op!r}: {list(STEERABLE_KINDS)}",
        )
    if kind not in STEERABLE_KINDS and kind not in HEAD_KINDS:
        raise _fail(
            i,
            "point",
            f"{kind} cannot be steered; steerable kinds: {list(STEERABLE_KINDS)} "
            f"(and {list(HEAD_KINDS)} for {list(HEAD_OPS)})",
        )
    return kind, layer


def _needs_sae(cfg: SteeringConfig, i: int, key: str) -> None:
    if cfg.sae_d_sae is None:
        raise _fail(
            i, key, "needs an SAE on this engine; start it with --sae DIR (sae=DIR) as well"
        )


def _sae_point(item: dict[str, Any], cfg: SteeringConfig, i: int) -> str:
    """The point of a clamp or a splice: the SAE's (``point`` may be left
    out; given, it must be the SAE's)."""
    from vllm_hidden_states.points import point_of_id

    op = item.get("op")
    _needs_sae(cfg, i, "op")
    problem = cfg.sae_clamp_problem if op == "clamp_sae_feature" else cfg.sae_splice_problem
    if problem is not None:
        raise _fail(i, "op", problem)
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
                f"{op} writes at the SAE's point, {address!r}; got {given!r} (leave point out)",
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


def _patch_rows(
    item: dict[str, Any],
    cfg: SteeringConfig,
    hidden_size: int,
    i: int,
    width_name: str,
    heads: int = 0,
) -> tuple[bytes | None, str | None, int]:
    """``(rows as wire bytes, matrix name, row count)`` of a patch: exactly
    one of ``rows`` and ``name``; ``hidden_size`` the point's width
    (``width_name``: what it is; ``heads``: attn_z's, whose rows may come
    ``[n, heads, head_dim]``)."""
    from vllm_hidden_states.patch_rows import decode_rows, rows_bytes

    if item.get("stored") is not None:
        raise _fail(
            i,
            "stored",
            "a reference to stored rows is resolved by the API server (HTTP, with "
            "--activation-store); here give 'rows' or 'name'",
        )
    given = [k for k in ("rows", "name") if item.get(k) is not None]
    if len(given) != 1:
        raise _fail(
            i,
            "rows",
            "give exactly one of 'rows' (the replacement rows), 'name' (a [n, hidden_size] "
            "matrix of --steering-vectors) or, over HTTP, 'stored' (rows of an earlier "
            f"request in the activation store); got {given or 'none'}",
        )
    if given[0] == "rows":
        try:
            rows = decode_rows(item["rows"], hidden_size, width_name, heads)
        except ValueError as e:
            raise _fail(i, "rows", str(e)) from None
        return rows_bytes(rows), None, rows.shape[0]
    name = item["name"]
    if not isinstance(name, str) or name not in cfg.matrices:
        known = sorted(cfg.matrices) or "none (2-D tensors of --steering-vectors DIR)"
        raise _fail(i, "name", f"unknown matrix of patch rows {name!r}; known: {known}")
    n, width = cfg.matrices[name]
    if width != hidden_size:
        raise _fail(
            i,
            "name",
            f"matrix {name!r} is [{n}, {width}]; the point's width ({width_name}) is {hidden_size}",
        )
    return None, name, n


def _patch_span(
    item: dict[str, Any], n: int, prompt_len: int | None, reach: int, i: int
) -> tuple[int, int | None]:
    """``(start, end)`` of a patch's ``n`` rows: ``positions`` a window or
    ``"prompt"`` of exactly ``n`` positions (default: the first ``n``).
    ``prompt_len`` None: not known yet ("prompt" is checked later)."""
    positions = item.get("positions")
    if positions is None:
        positions = {"start": 0, "end": n}
    if positions == "prompt":
        if prompt_len is None:
            return 0, None
        if prompt_len != n:
            raise _fail(
                i, "rows", f"has {n} rows; positions 'prompt' has {prompt_len} (one row each)"
            )
        return 0, prompt_len
    if not (isinstance(positions, dict) and positions.get("end") is not None):
        raise _fail(
            i,
            "positions",
            "a patch replaces a known number of positions, one row each: give "
            f"{{'start': s, 'end': e}} or 'prompt'; got {positions!r}",
        )
    start, end = _span(positions, prompt_len or 0, reach, i)
    assert end is not None
    if end - start != n:
        raise _fail(
            i,
            "rows",
            f"has {n} rows; positions {start}..{end - 1} are {end - start} (one row each)",
        )
    return start, end


def _splice_edits(item: dict[str, Any], cfg: SteeringConfig, i: int) -> list[list[float]]:
    """An sae_splice's ``edits`` as ``[feature, mode, value]`` (mode 0 sets
    the feature to ``value``, 1 scales it by ``value``)."""
    edits = item.get("edits")
    if edits is None:
        return []
    form = '[{"feature": f, "set": v} or {"feature": f, "scale": s}, ...]'
    if not isinstance(edits, (list, tuple)) or len(edits) > MAX_SAE_EDITS:
        raise _fail(i, "edits", f"must be a list of at most {MAX_SAE_EDITS} edits {form}")
    out: list[list[float]] = []
    seen: set[int] = set()
    for j, edit in enumerate(edits):
        if not isinstance(edit, dict) or len(edit) != 2 or "feature" not in edit:
            raise _fail(i, f"edits[{j}]", f"must be one of {form}")
        feature = _sae_feature(edit["feature"], cfg, i)
        if feature in seen:
            raise _fail(i, f"edits[{j}]", f"feature {feature} is edited twice")
        seen.add(feature)
        mode = "set" if "set" in edit else "scale" if "scale" in edit else None
        if mode is None or not _finite_number(edit[mode]):
            raise _fail(i, f"edits[{j}]", f"must be one of {form} with a finite number")
        out.append([feature, 0 if mode == "set" else 1, float(edit[mode])])
    return out


def check_steering(
    value: Any,
    cfg: SteeringConfig,
    hidden_size: int,
    prompt_len: int | None,
    reach: int,
) -> list[Intervention]:
    """The wire form of a request's ``steering`` (see module doc); ValueError
    naming the intervention, the key and what is allowed. ``reach``: the
    longest prompt + output the request can have (windows must start
    before it); ``prompt_len`` None: not tokenized yet (HTTP's early check:
    the form only)."""
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
    wire: list[Intervention] = []
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
        if op in ("clamp_sae_feature", "sae_splice"):
            point = _sae_point(item, cfg, i)
        kind, layer = _parse_steerable(point, i, n, op)
        capture_id = point_id(kind, layer, n)  # type: ignore[arg-type]
        model = cfg.model_layers
        if capture_id not in cfg.ids and model is not None and kind not in model.kinds_at(layer):
            raise _fail(i, "point", model.why_not(kind, layer))
        if capture_id not in cfg.ids:
            raise _fail(
                i,
                "point",
                f"{point!r} is not steerable on this engine; steerable points: "
                f"{cfg.describe_points()} (fixed at start by --steering-points)",
            )
        if op in REWRITE_OPS:
            wire.append(
                _rewrite_wire(
                    item, op, kind, layer, capture_id, cfg, hidden_size, prompt_len, reach, i
                )
            )
            continue
        for key in ("rows", "stored", "edits", "keep_error", *HEAD_KEYS):
            if item.get(key) is not None:
                owner = (
                    "patch"
                    if key in ("rows", "stored")
                    else "patch and ablate_heads at attn_z"
                    if key == "heads"
                    else "ablate_heads"
                    if key in HEAD_KEYS
                    else "sae_splice"
                )
                raise _fail(i, key, f"{key} belongs to {owner}")
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
        start, end = _span(item.get("positions"), prompt_len or 0, reach, i)
        wire.append(
            Intervention(
                point=f"{kind}.{layer}",
                id=capture_id,
                op=op,
                start=start,
                end=end,
                vector=vector,
                name=name,
                sae_feature=feature,
                strength=float(strength),
                value=None if value is None else float(value),
            )
        )
    patched = sum(item.n for item in wire if item.op in TABLE_OPS)
    if patched > cfg.max_patch_rows:
        raise ValueError(
            f"steering patches {patched} positions; this engine's patch table holds "
            f"{cfg.max_patch_rows} rows for every request in flight (--max-patch-rows)"
        )
    for i, item in enumerate(wire):
        if item.op in REWRITE_OPS:
            others = [j for j, x in enumerate(wire) if x.id == item.id and j != i]
            if others:
                raise _fail(
                    i,
                    "op",
                    f"{item.op} at {item.point!r} replaces the stream there; "
                    f"steering[{others[0]}] also writes it: a {item.op} is the only "
                    "intervention of its request at its point",
                )
        if item.op == "clamp_sae_feature":
            others = [j for j, x in enumerate(wire) if x.id == item.id and j != i]
            if others:
                raise _fail(
                    i,
                    "op",
                    f"clamp_sae_feature at {item.point!r} reads the stream there; "
                    f"steering[{others[0]}] also writes it: a clamp is the only "
                    "intervention at its point",
                )
    return wire


def _rewrite_wire(
    item: dict[str, Any],
    op: str,
    kind: str,
    layer: int,
    capture_id: int,
    cfg: SteeringConfig,
    hidden_size: int,
    prompt_len: int | None,
    reach: int,
    i: int,
) -> Intervention:
    """The wire form of a ``patch``, an ``ablate_heads`` or an ``sae_splice``
    (per-head forms lowered to full-width rows: :func:`_head_wire`)."""
    allowed = {
        "patch": ("point", "op", "rows", "name", "stored", "heads", "positions"),
        "ablate_heads": ("point", "op", "heads", "mode", "mean", "positions"),
        "sae_splice": ("point", "op", "edits", "keep_error", "positions"),
    }[op]
    for key in INTERVENTION_KEYS:
        if key not in allowed and item.get(key) is not None:
            raise _fail(i, key, f"{op} takes {list(allowed)} only")
    if item.get("heads") is not None and kind not in HEAD_KINDS:
        raise _fail(
            i,
            "heads",
            f"heads selects attention heads of an attn_z point (the heads' outputs, the "
            f"attention output projection's input); {item.get('point')!r} is {kind}",
        )
    rows = name = edits = None
    keep_error = False
    n = 0
    if op in TABLE_OPS and cfg.max_patch_rows == 0:
        raise _fail(i, "op", "patching is off on this engine (--max-patch-rows 0)")
    if op in TABLE_OPS and kind in HEAD_KINDS:
        rows, name, n = _head_wire(item, op, layer, cfg, i)
        start, end = (
            _patch_span(item, n, prompt_len, reach, i)
            if op == "patch"
            else _span(item.get("positions"), prompt_len or 0, reach, i)
        )
    elif op == "patch":
        rows, name, n = _patch_rows(item, cfg, hidden_size, i, "hidden_size")
        start, end = _patch_span(item, n, prompt_len, reach, i)
    else:
        edits = _splice_edits(item, cfg, i)
        keep_error = item.get("keep_error", False)
        if not isinstance(keep_error, bool):
            raise _fail(i, "keep_error", f"must be true or false, got {keep_error!r}")
        start, end = _span(item.get("positions"), prompt_len or 0, reach, i)
    return Intervention(
        point=f"{kind}.{layer}",
        id=capture_id,
        op=op,
        start=start,
        end=end,
        name=name,
        n=n,
        rows=rows,
        edits=edits,
        keep_error=keep_error,
    )


def _head_wire(
    item: dict[str, Any], op: str, layer: int, cfg: SteeringConfig, i: int
) -> tuple[bytes | None, str | None, int]:
    """``(rows as wire bytes, matrix name, table rows)`` of a patch or an
    ablate_heads at ``attn_z.<layer>``: rows ``heads * head_dim`` wide,
    NaN in the columns of the heads not written (the worker keeps the
    point's own values there; a request's rows are finite, so NaN means
    only that). A patch without ``heads`` is rows of every head, ``[n,
    heads, head_dim]`` as captured or flat; ablate_heads is one row,
    written at every position of its span."""
    import numpy as np

    from vllm_hidden_states.patch_rows import decode_head_rows, decode_head_values, rows_bytes

    shapes = cfg.z_shapes
    if layer >= len(shapes) or not shapes[layer][0] or not shapes[layer][1]:
        raise _fail(i, "point", "this engine does not know the heads' shape at this layer")
    num_heads, head_dim = shapes[layer]
    if op == "patch" and item.get("heads") is None:
        return _patch_rows(item, cfg, num_heads * head_dim, i, "heads * head_dim", num_heads)
    heads = _heads_of(item.get("heads"), num_heads, i)
    if op == "patch":
        if item.get("rows") is None:
            raise _fail(
                i,
                "rows",
                f"a per-head patch (heads given) takes inline rows [n, {len(heads)}, "
                f"{head_dim}] (positions, heads given, head_dim); a named matrix or a "
                f"patch of stored rows patches every head: leave heads out",
            )
        try:
            values = decode_head_rows(item["rows"], len(heads), head_dim)
        except ValueError as e:
            raise _fail(i, "rows", str(e)) from None
    else:
        mode = item.get("mode", "zero")
        if mode not in ABLATE_HEADS_MODES:
            raise _fail(i, "mode", f"must be one of {list(ABLATE_HEADS_MODES)}, got {mode!r}")
        mean = item.get("mean")
        if mode == "zero" and mean is not None:
            raise _fail(i, "mean", "mean belongs to mode 'mean' (mode 'zero' writes zeros)")
        if mode == "mean" and mean is None:
            raise _fail(
                i,
                "mean",
                f"mode 'mean' needs mean: [{len(heads)}, {head_dim}] (one row per head "
                "given, written at every position)",
            )
        try:
            row = (
                np.zeros((len(heads), head_dim), np.float32)
                if mean is None
                else decode_head_values(mean, len(heads), head_dim)
            )
        except ValueError as e:
            raise _fail(i, "mean", str(e)) from None
        values = row[None]
    full = np.full((values.shape[0], num_heads, head_dim), np.nan, np.float32)
    full[:, heads, :] = values
    return rows_bytes(full.reshape(values.shape[0], num_heads * head_dim)), None, values.shape[0]


def _heads_of(value: Any, num_heads: int, i: int) -> list[int]:
    """Distinct head indices in ``0 .. num_heads - 1``."""
    import numpy as np

    allowed = f"a non-empty list of distinct query head indices in 0..{num_heads - 1}"
    if value is None:
        raise _fail(i, "heads", f"ablate_heads needs heads: {allowed}")
    if (
        not isinstance(value, (list, tuple))
        or not value
        or not all(isinstance(h, (int, np.integer)) and not isinstance(h, bool) for h in value)
    ):
        raise _fail(i, "heads", f"must be {allowed}; got {value!r}")
    heads = [int(h) for h in value]
    for h in heads:
        if not 0 <= h < num_heads:
            raise _fail(
                i, "heads", f"head {h} is out of range: this layer has {num_heads} query heads; "
                f"give {allowed}"
            )  # fmt: skip
    repeated = sorted({h for h in heads if heads.count(h) > 1})
    if repeated:
        raise _fail(i, "heads", f"head {repeated[0]} is given twice; give {allowed}")
    return heads


def read_after_steering(
    wire: list[Intervention],
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
        int(item.point.split(".")[1]): i
        for i, item in enumerate(wire)
        if item.point.startswith("resid_pre.")
        and not (item.op in ("clamp_sae_feature", "sae_splice") and post is not None)
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


def steering_digest(wire: list[Intervention]) -> str:
    """A digest of a resolved steering list (points, ops, vectors, strengths,
    positions, patch rows, gates): equal for equal steering, the suffix of
    the request's ``cache_salt``."""
    import msgspec

    return hashlib.sha256(msgspec.msgpack.encode(wire)).hexdigest()[:32]


def salted(cache_salt: str | None, wire: list[Intervention]) -> str:
    """The cache salt of a steered request: its own salt, if any, and the
    steering digest."""
    return f"{cache_salt or ''}|steering:{steering_digest(wire)}"
