# SPDX-License-Identifier: Apache-2.0
"""Sparse autoencoders in the SAELens on-disk format, and a top-k encoder.

A directory holds ``cfg.json`` and ``sae_weights.safetensors``; where it
reads (its hook name as a layer or a capture point) and how it encodes
(standard, JumpReLU, top-k; SAELens's ``encode``) are docs/architecture.md,
"The SAE format". :func:`encode_topk` returns the ``k`` largest activations
per row, strongest first.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
ARCHITECTURES = ("standard", "jumprelu", "topk")
NORMALIZATIONS = ("none", "constant_norm_rescale", "layer_norm")
_HOOK_RE = re.compile(r"^blocks\.(\d+)\.hook_resid_(pre|post)$")
_POINT_HOOK_RE = re.compile(r"^blocks\.(\d+)\.hook_(attn_out|mlp_out|resid_mid)$")


@dataclass
class SAE:
    """A loaded SAE. Tensors are torch tensors on ``device`` in ``dtype``.

    Attributes:
        name: the release name (directory name unless given).
        layer: model layer it reads, HF ``output_hidden_states`` indexing
            (None when the config does not say and none was given).
        architecture: one of :data:`ARCHITECTURES`.
        d_in, d_sae: input width (the model's hidden size) and feature count.
        W_enc: ``[d_in, d_sae]``; b_enc ``[d_sae]``; W_dec ``[d_sae, d_in]``;
            b_dec ``[d_in]``; threshold ``[d_sae]`` (jumprelu) or None.
        k: the topk architecture's k (None otherwise).
        apply_b_dec_to_input: subtract ``b_dec`` before encoding.
        normalize_activations: one of :data:`NORMALIZATIONS`.
        hook_name: the config's hook name, if any.
        cfg: the raw ``cfg.json``.
    """

    name: str
    layer: int | None
    architecture: str
    d_in: int
    d_sae: int
    W_enc: Any
    b_enc: Any
    W_dec: Any
    b_dec: Any
    threshold: Any = None
    k: int | None = None
    apply_b_dec_to_input: bool = True
    normalize_activations: str = "none"
    hook_name: str | None = None
    cfg: dict[str, Any] = field(default_factory=dict)

    def to(self, device=None, dtype=None) -> SAE:
        """Move (in place) every tensor to ``device`` / ``dtype``; returns self."""
        for attr in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold"):
            t = getattr(self, attr)
            if t is not None:
                setattr(self, attr, t.to(device=device, dtype=dtype))
        return self

    @property
    def device(self):
        return self.W_enc.device

    @property
    def dtype(self):
        return self.W_enc.dtype


def _cfg_value(cfg: dict[str, Any], key: str) -> Any:
    if key in cfg:
        return cfg[key]
    for sub in ("metadata", "meta"):
        if isinstance(cfg.get(sub), dict) and key in cfg[sub]:
            return cfg[sub][key]
    return None


def layer_of_hook(hook_name: str | None) -> int | None:
    """HF layer index of a TransformerLens residual hook name, else None."""
    if not hook_name:
        return None
    m = _HOOK_RE.match(hook_name)
    if m is None:
        return None
    block = int(m.group(1))
    return block if m.group(2) == "pre" else block + 1


def point_of_hook(hook_name: str | None) -> str | None:
    """The capture point (``"attn_out.3"``) of a TransformerLens hook name
    that is not a residual-stream layer, else None."""
    m = _POINT_HOOK_RE.match(hook_name or "")
    return None if m is None else f"{m.group(2)}.{m.group(1)}"


def load_sae(
    path: str | Path,
    *,
    layer: int | None = None,
    device: str = "cpu",
    dtype=None,
    name: str | None = None,
) -> SAE:
    """Load an SAE from a SAELens-format directory.

    Args:
        path: directory with ``cfg.json`` and ``sae_weights.safetensors``.
        layer: the model layer it reads; default from the config's hook
            (see the module docstring).
        device: torch device for the weights.
        dtype: torch dtype (default: the config's ``dtype``, else float32).
        name: the release name stored with its features (default: the
            directory name).

    Raises:
        FileNotFoundError / ValueError naming the file or key at fault and
        what is allowed.
    """
    import torch
    from safetensors.torch import load_file

    path = Path(path)
    cfg_path, w_path = path / CFG_FILE, path / WEIGHTS_FILE
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise FileNotFoundError(
                f"{p} not found; an SAE directory in the SAELens format holds "
                f"{CFG_FILE} and {WEIGHTS_FILE}"
            )
    cfg = json.loads(cfg_path.read_text())
    arch = cfg.get("architecture", "standard")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{cfg_path}: architecture {arch!r} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)}"
        )
    norm = cfg.get("normalize_activations") or "none"
    if norm not in NORMALIZATIONS:
        raise ValueError(
            f"{cfg_path}: normalize_activations {norm!r} is not supported; supported: "
            f"{', '.join(NORMALIZATIONS)} (fold a constant scaling factor into W_enc first)"
        )
    for key in ("d_in", "d_sae"):
        if not isinstance(cfg.get(key), int):
            raise ValueError(f"{cfg_path}: {key!r} must be an integer, got {cfg.get(key)!r}")
    d_in, d_sae = cfg["d_in"], cfg["d_sae"]

    weights = load_file(str(w_path))
    if "threshold" not in weights and "log_threshold" in weights:
        weights["threshold"] = weights.pop("log_threshold").exp()
    expected = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    if arch == "jumprelu":
        expected["threshold"] = (d_sae,)
    for key, shape in expected.items():
        if key not in weights:
            raise ValueError(
                f"{w_path}: missing tensor {key!r} ({arch} SAEs need "
                f"{', '.join(expected)}); found {', '.join(sorted(weights))}"
            )
        if tuple(weights[key].shape) != shape:
            raise ValueError(
                f"{w_path}: {key} has shape {tuple(weights[key].shape)}; expected "
                f"{shape} for d_in={d_in}, d_sae={d_sae}"
            )
    k = None
    if arch == "topk":
        k = cfg.get("k")
        if not isinstance(k, int) or not 1 <= k <= d_sae:
            raise ValueError(f"{cfg_path}: topk SAEs need an integer 'k' in 1..{d_sae}, got {k!r}")

    hook_name = _cfg_value(cfg, "hook_name")
    if layer is None:
        layer = layer_of_hook(hook_name)
    if dtype is None:
        dtype = getattr(
            torch, str(cfg.get("dtype") or "float32").removeprefix("torch."), torch.float32
        )
    sae = SAE(
        name=name or path.name,
        layer=layer,
        architecture=arch,
        d_in=d_in,
        d_sae=d_sae,
        W_enc=weights["W_enc"],
        b_enc=weights["b_enc"],
        W_dec=weights["W_dec"],
        b_dec=weights["b_dec"],
        threshold=weights.get("threshold") if arch == "jumprelu" else None,
        k=k,
        apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)),
        normalize_activations=norm,
        hook_name=hook_name,
        cfg=cfg,
    )
    return sae.to(device=device, dtype=dtype)


def encode(x, sae: SAE):
    """Dense feature activations ``[n, d_sae]`` of ``x`` ``[n, d_in]`` (torch,
    computed on the SAE's device in its dtype)."""
    import torch

    if x.ndim != 2 or x.shape[1] != sae.d_in:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected [n, {sae.d_in}] (d_in)")
    x = x.to(device=sae.device, dtype=sae.dtype)
    if sae.normalize_activations == "constant_norm_rescale":
        x = x * (sae.d_in**0.5) / x.norm(dim=-1, keepdim=True)
    elif sae.normalize_activations == "layer_norm":
        mu = x.mean(dim=-1, keepdim=True)
        x = x - mu
        x = x / (x.std(dim=-1, keepdim=True) + 1e-5)
    if sae.apply_b_dec_to_input:
        x = x - sae.b_dec
    pre = x @ sae.W_enc + sae.b_enc
    if sae.architecture == "jumprelu":
        return torch.relu(pre) * (pre > sae.threshold)
    if sae.architecture == "topk":
        top = pre.topk(sae.k, dim=-1)
        return torch.zeros_like(pre).scatter_(-1, top.indices, torch.relu(top.values))
    return torch.relu(pre)


def encode_topk(x, sae: SAE, k: int):
    """The ``k`` strongest features of each row of ``x``.

    Args:
        x: ``[n, d_in]`` torch tensor, any float dtype, any device (moved to
            the SAE's).
        sae: a loaded :class:`SAE`.
        k: features per row, ``1 <= k <= d_sae``.

    Returns:
        ``(ids, values)``: ``ids`` int32 ``[n, k]``, ``values`` float32
        ``[n, k]``, on the SAE's device, strongest first; slots beyond the
        row's active (> 0) features hold id -1 and value 0.
    """
    import torch

    if not 1 <= k <= sae.d_sae:
        raise ValueError(f"top_k must be in 1..{sae.d_sae} (the SAE's d_sae), got {k}")
    acts = encode(x, sae)
    top = acts.topk(k, dim=-1, sorted=True)
    values = top.values.float()
    active = values > 0
    ids = torch.where(active, top.indices, torch.full_like(top.indices, -1)).to(torch.int32)
    return ids, torch.where(active, values, torch.zeros_like(values))


def encode_topk_numpy(
    x: np.ndarray, weights: dict[str, np.ndarray], cfg: dict[str, Any], k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Reference of :func:`encode_topk` in float64 numpy, from raw SAELens
    weights and config (for tests). Same output convention."""
    x = np.asarray(x, dtype=np.float64)
    w = {key: np.asarray(v, dtype=np.float64) for key, v in weights.items()}
    norm = cfg.get("normalize_activations") or "none"
    if norm == "constant_norm_rescale":
        x = x * np.sqrt(x.shape[1]) / np.linalg.norm(x, axis=-1, keepdims=True)
    elif norm == "layer_norm":
        x = x - x.mean(axis=-1, keepdims=True)
        x = x / (x.std(axis=-1, ddof=1, keepdims=True) + 1e-5)
    if cfg.get("apply_b_dec_to_input", True):
        x = x - w["b_dec"]
    pre = x @ w["W_enc"] + w["b_enc"]
    arch = cfg.get("architecture", "standard")
    if arch == "jumprelu":
        thr = w["threshold"] if "threshold" in w else np.exp(w["log_threshold"])
        acts = np.maximum(pre, 0) * (pre > thr)
    elif arch == "topk":
        acts = np.zeros_like(pre)
        idx = np.argsort(-pre, axis=-1, kind="stable")[:, : cfg["k"]]
        np.put_along_axis(acts, idx, np.maximum(np.take_along_axis(pre, idx, -1), 0), -1)
    else:
        acts = np.maximum(pre, 0)
    order = np.argsort(-acts, axis=-1, kind="stable")[:, :k]
    values = np.take_along_axis(acts, order, -1)
    ids = np.where(values > 0, order, -1).astype(np.int32)
    return ids, np.where(values > 0, values, 0).astype(np.float32)


def save_sae(path: str | Path, weights: dict[str, Any], cfg: dict[str, Any]) -> Path:
    """Write ``weights`` (torch tensors) and ``cfg`` as a SAELens-format
    directory (tests and examples)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / WEIGHTS_FILE))
    (path / CFG_FILE).write_text(json.dumps(cfg))
    return path


def random_sae(
    d_in: int,
    d_sae: int = 64,
    hook_name: str = "blocks.0.hook_resid_pre",
    architecture: str = "standard",
    seed: int = 0,
    **cfg_extra: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Random float32 SAE weights (torch) and their SAELens ``cfg.json``, for
    examples and tests: ``W_enc [d_in, d_sae]``, ``b_enc [d_sae]``, ``W_dec
    [d_sae, d_in]``, ``b_dec [d_in]`` (+ ``threshold [d_sae]`` for jumprelu)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    weights = {
        "W_enc": torch.randn(d_in, d_sae, generator=g) / d_in**0.5,
        "b_enc": torch.randn(d_sae, generator=g) * 0.05,
        "W_dec": torch.randn(d_sae, d_in, generator=g) / d_sae**0.5,
        "b_dec": torch.randn(d_in, generator=g) * 0.05,
    }
    if architecture == "jumprelu":
        weights["threshold"] = torch.rand(d_sae, generator=g) * 0.2
    cfg = {
        "architecture": architecture,
        "d_in": d_in,
        "d_sae": d_sae,
        "dtype": "float32",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "metadata": {"hook_name": hook_name, "sae_release": "random-example"},
        **cfg_extra,
    }
    return weights, cfg


def build_random_sae(
    path: str | Path,
    d_in: int,
    layer: int,
    d_sae: int = 64,
    architecture: str = "standard",
    seed: int = 0,
) -> Path:
    """:func:`random_sae` reading HF layer ``layer`` (``blocks.<layer>.
    hook_resid_pre``, so ``layer >= 0``), saved under ``path``."""
    if layer < 0:
        raise ValueError(
            f"layer must be an absolute index >= 0 (the SAELens hook names "
            f"blocks.<layer>.hook_resid_pre), got {layer}"
        )
    weights, cfg = random_sae(d_in, d_sae, f"blocks.{layer}.hook_resid_pre", architecture, seed)
    return save_sae(path, weights, cfg)
