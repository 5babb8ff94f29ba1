# SPDX-License-Identifier: Apache-2.0
"""HiddenStatesConfig: what one engine can capture."""

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from vllm_hidden_states.layers import ModelLayers, model_layers_for
from vllm_hidden_states.points import POINT_KINDS, layer_of_id, parse_point, point_id

if TYPE_CHECKING:
    from vllm.config import VllmConfig

ADDITIONAL_CONFIG_KEY = "hidden_states"

# Default of --hidden-states-max-rows: as many rows as a step computes
# (max_num_batched_tokens), so that an "all"/"prompt" capture never splits a
# prefill the scheduler would run in one step, as long as the capture buffers
# fit DEFAULT_BUFFER_MIB; never fewer than DEFAULT_MAX_ROWS (nor more than
# max_num_batched_tokens). E.g. a 32 x 4096 bf16 model, every layer
# capturable: 1024 rows (256 MiB); a 16 x 2048 one: 4096.
DEFAULT_MAX_ROWS = 512
DEFAULT_BUFFER_MIB = 256
# Bumped when what the compiled graph contains changes (2: capture points;
# 3: a count per capture point; 4: capture points as forward pre-hooks; 5:
# points past the residual stream, a scale argument; 6: on CPU the gathers
# read the armed index, a dynamic size), so a graph cached by an older
# version is never reused.
CAPTURE_VERSION = 6


def capturable_point_ids(
    given: list[str],
    num_layers: int,
    architecture: "str | ModelLayers | None",
) -> tuple[int, ...]:
    """The capture ids ``--hidden-states-points`` makes capturable: ``"all"``
    is every kind at every layer where it is exact, a kind alone every layer
    where it is exact (ValueError if none), an address that one point
    (ValueError where it is not exact: a kind the layer lacks, or a layer of
    a class not verified, :class:`ModelLayers`)."""
    model = model_layers_for(architecture, num_layers)
    ids: set[int] = set()
    for item in given:
        if item == "all":
            wanted = [(k, i) for i in range(num_layers) for k in model.kinds_at(i)]
        elif item in POINT_KINDS:
            wanted = [(item, i) for i in range(num_layers) if item in model.kinds_at(i)]
            if not wanted:
                raise ValueError(
                    f"--hidden-states-points {item!r}: no decoder layer of this model "
                    f"has it exactly ({model.why_not(item, num_layers - 1)})"
                )
        else:
            try:
                wanted = [parse_point(item, num_layers)]
            except ValueError as e:
                raise ValueError(
                    f"--hidden-states-points entry {e} (or 'all', or a kind alone: every "
                    "layer where it is exact)"
                ) from None
        for kind, layer in wanted:
            if kind not in model.kinds_at(layer):
                raise ValueError(f"--hidden-states-points {item!r}: {model.why_not(kind, layer)}")
            ids.add(point_id(kind, layer, num_layers))
    return tuple(sorted(ids))


def sae_capture_id(
    sae: dict[str, Any], num_layers: int, architecture: "str | ModelLayers | None"
) -> int | None:
    """The capture id an SAE (:func:`sae_entry`) reads: its HF layer, or the
    id of its point; None when the model has no such layer or point, or not
    exactly (:func:`sae_problems` says why at start)."""
    model = model_layers_for(architecture, num_layers)
    if sae.get("point") is None:
        layer = sae["layer"]
        if not -(num_layers + 1) <= layer <= num_layers:
            return None
        absolute = layer % (num_layers + 1)
        return absolute if model.layer_exact(absolute) else None
    try:
        kind, layer = parse_point(sae["point"], num_layers)
    except ValueError:
        return None
    if kind not in model.kinds_at(layer):
        return None
    return point_id(kind, layer, num_layers)


def probe_capture_ids(
    entries: list[dict[str, Any]], num_layers: int, model: ModelLayers
) -> dict[str, dict[str, Any]]:
    """``--probes`` entries by name, each with ``capture_id`` (the id its
    point reads; None, with ``why``, when this model cannot give it exactly)."""
    from vllm_hidden_states.probes import probe_capture_id

    out: dict[str, dict[str, Any]] = {}
    for entry in entries:
        item = dict(entry)
        try:
            item["capture_id"] = probe_capture_id(entry["point"], num_layers, model)
        except ValueError as e:
            item["capture_id"], item["why"] = None, str(e)
        out[entry["name"]] = item
    return out


@dataclass(frozen=True)
class HiddenStatesConfig:
    """Capturable layers and points of one engine.

    Attributes:
        num_layers: ``L``, the model's ``num_hidden_layers``.
        layers: capturable capture ids, sorted, distinct: HF layers in
            ``0..L`` and the ids of points past ``L`` (:func:`point_id`).
        given: the capturable layers as configured (``None`` = every layer),
            kept only to phrase error messages the way the operator wrote them.
        points_given: ``--hidden-states-points`` as configured (empty: none).
        architecture: the model's architecture (``architectures[0]``).
        model_layers: its decoder layers' classes, which decide what is
            exact at each layer (:class:`ModelLayers`); None (configs built
            by hand): predicted from ``architecture`` alone.
        max_rows: rows of hidden states one forward can capture (the
            capture buffers' first dimension); captures are split over steps
            so that no step asks more.
    """

    num_layers: int
    layers: tuple[int, ...]
    given: tuple[int, ...] | None = None
    max_rows: int = DEFAULT_MAX_ROWS
    # --sae: its :func:`sae_entry` and the capture id it reads (None: no SAE,
    # or one whose layer or point is not on this model: refused at start).
    sae: dict[str, Any] | None = None
    sae_layer: int | None = None
    points_given: tuple[str, ...] = ()
    architecture: str | None = None
    model_layers: ModelLayers | None = None
    # --probes: name -> its entry (vllm_hidden_states.probes.ProbeFile.entry)
    # plus "capture_id", the id it reads (None: not exactly on this model,
    # refused at start by probe_problems, with "why"). Empty: no probes.
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def model(self) -> ModelLayers:
        """:attr:`model_layers`, or a uniform model of :attr:`architecture`."""
        if self.model_layers is not None:
            return self.model_layers
        return model_layers_for(self.architecture, self.num_layers)

    @classmethod
    def from_vllm_config(cls, vllm_config: "VllmConfig") -> "HiddenStatesConfig | None":
        """The engine's config, or None when hidden states are not enabled."""
        extra = vllm_config.additional_config or {}
        entry = extra.get(ADDITIONAL_CONFIG_KEY)
        if entry is None:
            return None
        num_layers = num_hidden_layers(vllm_config)
        given = entry.get("layers")
        architecture = (vllm_config.model_config.architectures or [None])[0]
        model = ModelLayers.of(vllm_config.model_config, num_layers)
        # Raises for an unknown point or one not exact on this model: at
        # start, from validate_engine_config, before any process is made.
        points = capturable_point_ids(entry.get("points") or [], num_layers, model)
        # Every layer by default: every layer read exactly (the others are
        # refused per request, naming why).
        layers = set(model.exact_layers()) if given is None else set()
        for k in given or ():
            if not -(num_layers + 1) <= k <= num_layers:
                continue  # out of range: refused by the layers check already
            if not model.layer_exact(_absolute(k, num_layers)):
                raise ValueError(f"--hidden-states-layers {k}: {model.why_not_layer(k)}")
        layers |= {_absolute(k, num_layers) for k in given or ()} | set(points)
        max_rows = entry.get("max_rows") or default_max_rows(vllm_config, num_layers, layers)
        sae = entry.get("sae")
        sae_layer = None if sae is None else sae_capture_id(sae, num_layers, model)
        if sae_layer is not None and sae.get("point") is not None:
            layers.add(sae_layer)  # an SAE's point is capturable with it
        probes = probe_capture_ids(entry.get("probes") or [], num_layers, model)
        # A probe's point is capturable with it, as an SAE's.
        layers |= {p["capture_id"] for p in probes.values() if p["capture_id"] is not None}
        return cls(
            num_layers,
            tuple(sorted(layers)),
            None if given is None else tuple(given),
            max_rows,
            sae,
            sae_layer,
            tuple(entry.get("points") or ()),
            architecture,
            model,
            probes,
        )

    @property
    def inner_layers(self) -> tuple[int, ...]:
        """Capturable ids with a capture point in the model: HF layers
        ``k < L`` and points past ``L``; the final layer ``L`` is the model's
        own (post-norm) output. Ordered by the decoder layer that computes
        them (:func:`layer_of_id`), then id: pipeline stages send their rows
        on in this order."""
        n = self.num_layers
        inner = [k for k in self.layers if k != n]
        return tuple(sorted(inner, key=lambda k: (layer_of_id(k, n), k)))

    def buffer_bytes(self, hidden_size: int, dtype_bytes: int) -> int:
        """Memory of the capture buffers: one ``[max_rows, hidden_size]`` per
        inner layer, in the model dtype."""
        return len(self.inner_layers) * self.max_rows * hidden_size * dtype_bytes

    def describe_capturable(self) -> str:
        if self.given is None:
            n = self.num_layers
            exact = [k for k in range(n + 1) if k in self.layers]
            if len(exact) == n + 1:
                return f"all ({-(n + 1)}..{n})"
            return f"{', '.join(map(str, exact))} (every layer read exactly on this model)"
        return ", ".join(str(k) for k in self.given)

    def describe_points(self) -> str:
        """The capturable points, as the operator configured them."""
        if not self.points_given:
            return (
                "none beyond the layers (start the engine with --hidden-states-points "
                "all, kinds such as attn_out,mlp_out, or addresses)"
            )
        kinds = self.model.kinds()
        return ", ".join(
            (f"{', '.join(kinds)} (every layer)" if item == "all" else f"{item} (every layer)")
            if item == "all" or item in POINT_KINDS
            else item
            for item in self.points_given
        )

    def resolve_points(self, addresses: list[str]) -> list[int]:
        """Capture ids of a request's point addresses (in order), each point
        named once (``resid_post.i`` and ``resid_pre.(i+1)`` are two names of
        one capture id: both may be asked); ValueError naming what is allowed."""
        n = self.num_layers
        seen: dict[tuple[str, int], str] = {}
        ids = []
        for address in addresses:
            kind, layer = parse_point(address, n)
            if kind not in self.model.kinds_at(layer):
                raise ValueError(
                    f"hidden_states_points {address!r}: {self.model.why_not(kind, layer)}"
                )
            capture_id = point_id(kind, layer, n)
            if capture_id not in self.layers:
                raise ValueError(
                    f"hidden_states_points {address!r} is not capturable on this "
                    f"engine; capturable points: {self.describe_points()} (fixed at "
                    "engine start by --hidden-states-points)"
                )
            if (kind, layer) in seen:
                raise ValueError(
                    f"hidden_states_points names {kind}.{layer} twice "
                    f"({seen[kind, layer]!r} and {address!r}); name each point once"
                )
            seen[kind, layer] = address
            ids.append(capture_id)
        return ids

    def resolve(self, layer: int) -> int:
        """Absolute index of a requested layer; ValueError naming what is allowed."""
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(f"hidden_states_layers entries must be integers, got {layer!r}")
        n = self.num_layers
        if not -(n + 1) <= layer <= n:
            raise ValueError(
                f"layer {layer} is out of range for a {n}-layer model; valid "
                f"indices are {-(n + 1)}..{n} (0 = embeddings, {n} or -1 = final "
                f"post-norm state); capturable layers: {self.describe_capturable()}"
            )
        absolute = layer % (n + 1)
        if absolute not in self.layers and not self.model.layer_exact(absolute):
            raise ValueError(f"hidden_states_layers: {self.model.why_not_layer(layer)}")
        if absolute not in self.layers:
            raise ValueError(
                f"layer {layer} is not capturable on this engine; capturable "
                f"layers: {self.describe_capturable()} (the set is fixed at "
                f"engine start by hidden_states_layers)"
            )
        return absolute

    def resolve_all(self, layers, param: str = "hidden_states_layers") -> list[int]:
        """Absolute indices of a request's layers, each named once (``-1`` and
        ``L`` are one layer): the rule both the Python API and HTTP apply.
        ValueError naming what is allowed."""
        if (problem := layer_count_problem(len(layers), self.num_layers, param)) is not None:
            raise ValueError(problem)
        seen: dict[int, int] = {}
        for layer in layers:
            absolute = self.resolve(layer)
            if absolute in seen:
                raise ValueError(
                    f"{param} names layer {absolute} twice ({seen[absolute]} and "
                    f"{layer}); name each layer once"
                )
            seen[absolute] = layer
        return list(seen)


def layer_count_problem(count: int, num_layers: int, param: str) -> str | None:
    """Why ``count`` layers are too many for an ``num_layers``-layer model
    (each of its ``L + 1`` layers may be named once), or None. Checked before
    any entry is resolved, so a huge list is refused at once."""
    limit = num_layers + 1
    if count <= limit:
        return None
    return (
        f"{param} has {count} entries; this {num_layers}-layer model has "
        f"{limit} layers (0..{num_layers}, or -{limit}..-1), and a request may "
        "name each at most once"
    )


_Built = TypeVar("_Built")
_BUILT: dict[tuple[int, type], Any] = {}


def built_once(cls: type[_Built], vllm_config: "VllmConfig") -> _Built | None:
    """``cls.from_vllm_config(vllm_config)``, built once per engine config.

    For the per-request front-end path: an engine's config is fixed once it
    has started, and building it parses every capturable point again (about
    0.2 ms per request on a 2-core box with every point capturable). The entry
    goes when ``vllm_config`` does.
    """
    key = (id(vllm_config), cls)
    if key in _BUILT:
        return _BUILT[key]
    built = cls.from_vllm_config(vllm_config)  # type: ignore[attr-defined]
    try:
        weakref.finalize(vllm_config, _BUILT.pop, key, None)
    except TypeError:  # a stand-in config that takes no weak reference: not kept
        return built
    _BUILT[key] = built
    return built


def _absolute(layer: int, num_layers: int) -> int:
    if not -(num_layers + 1) <= int(layer) <= num_layers:
        raise ValueError(
            f"hidden_states_layers entry {layer} is out of range for a "
            f"{num_layers}-layer model; valid indices are "
            f"{-(num_layers + 1)}..{num_layers}"
        )
    return int(layer) % (num_layers + 1)


def default_max_rows(vllm_config: "VllmConfig", num_layers: int, capturable: set[int]) -> int:
    """``--hidden-states-max-rows`` left unset: see :data:`DEFAULT_BUFFER_MIB`.
    ``capturable``: the engine's capture ids (one buffer each but ``L``)."""
    step_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    model_config = vllm_config.model_config
    num_buffers = len(capturable - {num_layers})
    row_bytes = num_buffers * model_config.get_hidden_size() * model_config.dtype.itemsize
    fits = DEFAULT_BUFFER_MIB * 2**20 // row_bytes if row_bytes else step_tokens
    return min(step_tokens, max(DEFAULT_MAX_ROWS, fits))


def captures_all_inline(vllm_config: "VllmConfig") -> bool:
    """Whether "all" is captured during the request's own forwards (prompt rows
    in its prefill, each generated position in the decode step that feeds it),
    leaving only the final token to its extract.

    Not with speculative decoding: a decode step's accepted draft positions are
    only known after it, so "all" recomputes everything in its extract there.
    """
    return vllm_config.speculative_config is None


def num_hidden_layers(vllm_config: "VllmConfig") -> int:
    text_config = vllm_config.model_config.hf_text_config
    return int(text_config.num_hidden_layers)
