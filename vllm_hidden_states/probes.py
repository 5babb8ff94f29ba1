# SPDX-License-Identifier: Apache-2.0
"""Linear probes served inline: the on-disk format, its checks, and scoring.

``--probes DIR`` loads every ``DIR/<name>.safetensors`` (the name is the file
stem). One file is one probe:

* tensors: ``weight`` ``[k, hidden_size]`` (or ``[hidden_size]``: ``k = 1``),
  ``bias`` ``[k]`` (or a scalar), and optionally ``mean`` and ``scale``
  ``[hidden_size]``, the input normalisation ``(x - mean) / scale``
  (either may be left out: 0 and 1);
* metadata (the safetensors header's ``__metadata__``, strings): ``point``,
  where it reads (a capture point address such as ``resid_post.3``,
  ``blocks.2.hook_resid_pre``, ``attn_out.1``, or an HF layer index such as
  ``"-1"``), and ``output``: ``none``, ``sigmoid`` or ``softmax`` (over the
  ``k`` outputs; default ``none``).

A score is ``f(normalise(x) @ weight.T + bias)``, float32, ``[positions, k]``
per probe, computed in the worker on the rows as they are captured
(:class:`ProbeSet`); only those ``k`` floats per position leave the device.
docs/architecture.md, "Probes: scored where the rows are".

This module imports neither vLLM nor torch at import time: the front-end
checks the files (:func:`read_probe_dir`) before any engine process starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from vllm_hidden_states.layers import ModelLayers

OUTPUTS: tuple[str, ...] = ("none", "sigmoid", "softmax")
TENSORS: tuple[str, ...] = ("weight", "bias", "mean", "scale")
SUFFIX = ".safetensors"
# A probe's name travels in requests and answers: keep it a plain token.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
FORMAT_HELP = (
    "a probe file holds tensors 'weight' [k, hidden_size] (or [hidden_size]) and "
    "'bias' [k], optionally 'mean' and 'scale' [hidden_size], and metadata "
    "{'point': a capture point such as 'resid_post.3' or an HF layer such as '-1', "
    f"'output': one of {list(OUTPUTS)}}}"
)


@dataclass(frozen=True)
class ProbeFile:
    """One probe as read and checked from disk (numpy, float32).

    Attributes:
        name: the file stem, as requests name it.
        path: the file, absolute.
        point: where it reads, as the file names it.
        output: one of :data:`OUTPUTS`.
        weight: float32 ``[k, width]``.
        bias: float32 ``[k]``.
        mean, scale: float32 ``[width]`` or None.
    """

    name: str
    path: str
    point: str
    output: str
    weight: np.ndarray
    bias: np.ndarray
    mean: np.ndarray | None = None
    scale: np.ndarray | None = None

    @property
    def k(self) -> int:
        return int(self.weight.shape[0])

    @property
    def width(self) -> int:
        return int(self.weight.shape[1])

    def entry(self) -> dict[str, Any]:
        """What every process knows of it without the weights
        (``additional_config["hidden_states"]["probes"]`` items)."""
        return {
            "name": self.name,
            "path": self.path,
            "point": self.point,
            "output": self.output,
            "k": self.k,
            "width": self.width,
            "normalised": self.mean is not None or self.scale is not None,
        }


def read_probe(path: str | Path) -> ProbeFile:
    """Read and check one probe file; ValueError naming the file, what was
    wrong and what is allowed."""
    from safetensors import safe_open

    path = Path(path).resolve()
    where = f"probe {path.name}"
    try:
        with safe_open(str(path), framework="np") as f:
            meta = f.metadata() or {}
            names = list(f.keys())
            arrays = {n: f.get_tensor(n) for n in names}
    except Exception as e:  # a truncated or foreign file: say which and why
        raise ValueError(f"{where}: not a readable safetensors file ({e}); {FORMAT_HELP}") from None
    unknown = sorted(set(names) - set(TENSORS))
    if unknown:
        raise ValueError(f"{where}: unknown tensors {unknown}; {FORMAT_HELP}")
    for required in ("weight", "bias"):
        if required not in arrays:
            raise ValueError(f"{where}: no {required!r} tensor; {FORMAT_HELP}")
    for n, a in arrays.items():
        if not np.issubdtype(a.dtype, np.floating):
            raise ValueError(
                f"{where}: tensor {n!r} is {a.dtype}; probe tensors are floating point"
            )
        # Checked as scored: a float64 value past float32's range is inf there.
        with np.errstate(over="ignore"):
            finite = np.isfinite(a.astype(np.float32)).all()
        if not finite:
            raise ValueError(
                f"{where}: tensor {n!r} holds non-finite values (NaN or inf, or past "
                "float32's range); every weight, bias, mean and scale must be finite"
            )
    weight = arrays["weight"].astype(np.float32)
    if weight.ndim == 1:
        weight = weight[None, :]
    if weight.ndim != 2 or 0 in weight.shape:
        raise ValueError(
            f"{where}: weight has shape {list(arrays['weight'].shape)}; it must be "
            "[k, hidden_size] or [hidden_size]"
        )
    k, width = weight.shape
    bias = arrays["bias"].astype(np.float32).reshape(-1)
    if bias.shape != (k,):
        raise ValueError(
            f"{where}: bias has shape {list(arrays['bias'].shape)}; with weight "
            f"{list(arrays['weight'].shape)} it must be [{k}]"
        )
    norm: dict[str, np.ndarray | None] = {}
    for n in ("mean", "scale"):
        a = arrays.get(n)
        if a is not None and a.reshape(-1).shape != (width,):
            raise ValueError(
                f"{where}: {n} has shape {list(a.shape)}; it must be [{width}] (the weight's width)"
            )
        norm[n] = None if a is None else a.astype(np.float32).reshape(-1)
    if norm["scale"] is not None and (norm["scale"] == 0).any():
        raise ValueError(f"{where}: scale has zeros; the input is divided by it")
    point = meta.get("point")
    if not point:
        raise ValueError(f"{where}: its metadata names no 'point' to read; {FORMAT_HELP}")
    output = meta.get("output") or "none"
    if output not in OUTPUTS:
        raise ValueError(f"{where}: output {output!r} is not one of {list(OUTPUTS)}")
    if output == "softmax" and k == 1:
        raise ValueError(
            f"{where}: softmax over one output is always 1; use 'sigmoid' for a "
            "one-output probe, or give weight [k >= 2, hidden_size]"
        )
    name = path.name.removesuffix(SUFFIX)
    if not _NAME.match(name):
        raise ValueError(
            f"{where}: the name {name!r} (the file stem) must be letters, digits, '_', '.' or '-'"
        )
    return ProbeFile(name, str(path), point, output, weight, bias, norm["mean"], norm["scale"])


def read_probe_dir(directory: str | Path) -> list[ProbeFile]:
    """Every probe of ``--probes DIR``, sorted by name; ValueError naming the
    directory or file and why."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise ValueError(f"--probes {directory}: not a directory; {FORMAT_HELP}")
    files = sorted(root.glob("*" + SUFFIX))
    if not files:
        raise ValueError(
            f"--probes {directory}: no *{SUFFIX} file; one file per probe, the name "
            f"is its stem; {FORMAT_HELP}"
        )
    return [read_probe(f) for f in files]


def probe_capture_id(point: str, num_layers: int, model: ModelLayers) -> int:
    """The capture id a probe's ``point`` reads: an HF layer (``"-1"``, ``"3"``)
    or a residual-width point (not ``attn_pattern`` / ``mlp_post`` /
    ``attn_z``). ValueError
    saying why this model cannot give it exactly."""
    from vllm_hidden_states.points import PATTERN_KIND, WIDE_KINDS, parse_point, point_id

    n = num_layers
    if re.fullmatch(r"-?\d+", point.strip()):
        layer = int(point)
        if not -(n + 1) <= layer <= n:
            raise ValueError(
                f"layer {layer} is out of range for a {n}-layer model (valid: {-(n + 1)}..{n})"
            )
        absolute = layer % (n + 1)
        if not model.layer_exact(absolute):
            raise ValueError(model.why_not_layer(layer))
        return absolute
    kind, i = parse_point(point, n)
    if kind == PATTERN_KIND or kind in WIDE_KINDS:
        raise ValueError(
            f"{point!r} is not a residual-stream row; probes read resid_pre, "
            "attn_out, resid_mid, mlp_out, resid_post or an HF layer"
        )
    if kind not in model.kinds_at(i):
        raise ValueError(model.why_not(kind, i))
    return point_id(kind, i, n)


def save_probe(
    path: str | Path,
    weight: Any,
    bias: Any,
    point: str,
    output: str = "none",
    mean: Any = None,
    scale: Any = None,
) -> Path:
    """Write one probe file (arrays or tensors; stored float32)."""
    from safetensors.numpy import save_file

    tensors = {"weight": weight, "bias": bias, "mean": mean, "scale": scale}
    arrays = {
        k: np.ascontiguousarray(np.asarray(v, dtype=np.float32))
        for k, v in tensors.items()
        if v is not None
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(arrays, str(path), metadata={"point": str(point), "output": output})
    return path


def score_numpy(x: Any, probe: ProbeFile) -> np.ndarray:
    """Reference of :class:`ProbeSet`'s scores in float64 numpy (tests):
    ``f(normalise(x) @ weight.T + bias)``, ``[n, k]``."""
    x = np.asarray(x, dtype=np.float64)
    if probe.mean is not None:
        x = x - probe.mean
    if probe.scale is not None:
        x = x / probe.scale
    z = x @ probe.weight.astype(np.float64).T + probe.bias
    if probe.output == "sigmoid":
        return 1.0 / (1.0 + np.exp(-z))
    if probe.output == "softmax":
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    return z


class ProbeSet:
    """The engine's probes on one device, scoring captured rows.

    Built once per worker (``HiddenStatesCapture.__init__``). ``score`` runs
    right after the forward on the device rows of each probe's capture id and
    returns float32 ``[rows, sum of k]``: the requested probes' outputs side
    by side, in request order (the front-end splits them by ``k``).
    """

    def __init__(self, entries: list[dict[str, Any]], device: torch.device) -> None:
        import torch

        self.capture_id: dict[str, int] = {}
        # name -> (weight.T / scale [width, k], bias [k], mean [width] or None)
        self._tensors: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        self._output: dict[str, str] = {}
        for entry in entries:
            probe = read_probe(entry["path"])
            # (x - mean) / scale @ W.T = (x - mean) @ (W / scale).T: the scale
            # goes into the weight once (float64, rounded once), so a step
            # pays one subtraction and one addmm. The mean is not folded into
            # the bias: that would cancel two large sums where the stream has
            # large offsets (the subtraction keeps fp32 exactness there).
            weight: np.ndarray = probe.weight.astype(np.float64)
            if probe.scale is not None:
                weight = weight / probe.scale
            weight_t = np.ascontiguousarray(weight.T, dtype=np.float32)
            mean = None if probe.mean is None else torch.from_numpy(probe.mean).to(device)
            self._tensors[entry["name"]] = (
                torch.from_numpy(weight_t).to(device),
                torch.from_numpy(probe.bias).to(device),
                mean,
            )
            self._output[entry["name"]] = probe.output
            self.capture_id[entry["name"]] = entry["capture_id"]

    def __len__(self) -> int:
        return len(self._tensors)

    def score(self, names: tuple[str, ...], rows_of: Any) -> torch.Tensor:
        """float32 ``[rows, sum of k]`` of probes ``names``; ``rows_of(id)``
        gives the device rows ``[rows, hidden]`` of a capture id (model dtype)."""
        import torch

        parts = []
        for name in names:
            weight_t, bias, mean = self._tensors[name]
            x = rows_of(self.capture_id[name]).float()
            if mean is not None:
                x = x - mean  # a new tensor: the captured rows are not written
            z = torch.addmm(bias, x, weight_t)
            output = self._output[name]
            if output == "sigmoid":
                z = z.sigmoid_()
            elif output == "softmax":
                z = torch.softmax(z, dim=-1)
            parts.append(z)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
