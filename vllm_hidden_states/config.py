# SPDX-License-Identifier: Apache-2.0
"""The shared contract: engine configuration and the layer convention.

Imported by every process (front-end, EngineCore, workers, API server); it
imports nothing from vLLM at module level.

The switch lives in ``VllmConfig.additional_config["hidden_states"]`` so that it
reaches every process (front-end, EngineCore, workers) inside the pickled config
and keys vLLM's torch.compile cache: turning capture on adds capture points to the
compiled graph, and a graph compiled without them cannot be reused with them.

Layer convention (the same as HF transformers ``output_hidden_states``), with
``L = num_hidden_layers``:

* ``0``: the embedding output;
* ``1..L-1``: the residual stream after decoder layer ``k``
  (the stream entering decoder layer ``k``, i.e. vLLM's ``hidden + residual``);
* ``L`` (``-1``): the final, post-norm hidden state, i.e. the LM-head input.

Negative indices count from the end over those ``L + 1`` entries, so ``-2`` is
``L - 1``: the residual stream entering the last decoder layer, which is what
Z-Image reads from Qwen3-4B.

Point convention (``hidden_states_points``; SAELens / TransformerLens names):
``blocks.{i}.hook_{kind}`` or ``{kind}.{i}``, ``i`` a decoder layer
``0..L-1`` (negative counts from the end), ``kind`` one of :data:`POINT_KINDS`:

* ``resid_pre.i``: the stream entering decoder layer ``i`` (HF layer ``i``);
* ``attn_out.i``: the attention block's contribution to the stream (after any
  post-attention norm: Gemma 2/3, OLMo 2);
* ``resid_mid.i = resid_pre.i + attn_out.i``;
* ``mlp_out.i``: the MLP (or MoE) block's contribution (after any
  post-feed-forward norm);
* ``resid_post.i = resid_mid.i + mlp_out.i`` (HF layer ``i + 1``, except
  ``resid_post.(L-1)``: the pre-norm stream, where HF's layer ``L`` is
  post-norm).

Every capturable thing has one integer *capture id* (:func:`point_id`): ids
``0..L`` are the HF layers, so everything downstream of the request (planner,
worker buffers, wire rows) carries layers and points alike; ids past ``L`` are
the points that are not an HF layer.
"""

import re
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args

if TYPE_CHECKING:
    from vllm.config import VllmConfig

ADDITIONAL_CONFIG_KEY = "hidden_states"

# Layers a request gets when it asks for hidden states without naming any: the
# final post-norm state. The one place this default is written.
DEFAULT_LAYERS: tuple[int, ...] = (-1,)

# ``hidden_states_positions`` values. "last": the final token of prompt +
# output; "all": every position; "prompt": every prompt position;
# "generated": every output position; or a :class:`Window`.
Positions = Literal["last", "all", "prompt", "generated"]
POSITIONS: tuple[Positions, ...] = get_args(Positions)


@dataclass(frozen=True)
class Window:
    """``hidden_states_positions: {"start": s, "end": e}``: positions
    ``s .. e - 1`` of prompt + output (``end`` None: to the final token).
    Captured like "all", but only the window's rows."""

    start: int
    end: int | None = None

    def as_json(self) -> dict[str, int | None]:
        return {"start": self.start, "end": self.end}


# Positions served by a post-sampling HIDDEN_STATES_EXTRACT prefill. "prompt" is
# captured during the request's own prefill instead: no extract, one pass.
EXTRACT_POSITIONS: tuple[str, ...] = ("last", "all")

# Body fields that ask for captured data on the OpenAI routes. The one list:
# chat/completions read them, and the routes that cannot carry captured data
# (/v1/responses, /v1/messages, /v1/chat/completions/batch) refuse them.
REQUEST_FIELDS: tuple[str, ...] = (
    "return_hidden_states",
    "hidden_states_layers",
    "hidden_states_points",
    "hidden_states_format",
    "hidden_states_positions",
    "hidden_states_stream",
    "hidden_states_heads",
    "sae_features",
)

# -- the request rules, one copy for both surfaces --------------------------
# SamplingParams (frontend/validate.py) and the OpenAI fields
# (server/openai_fields.py) call these; each surface turns the ValueError into
# its own error (VLLMValidationError / HTTP 400) naming the field.


def check_positions(value: Any) -> "Positions | Window":
    """``hidden_states_positions``: one of :data:`POSITIONS`, or a window
    ``{"start": s, "end": e}`` (integers, ``0 <= s < e``; ``end`` may be
    left out or null: to the final token). Whether the window fits the
    request is checked once its prompt is tokenized (:func:`window_problem`)."""
    if isinstance(value, dict):
        start: Any = value.get("start")
        end: Any = value.get("end")
        if (
            set(value) - {"start", "end"}
            or not _is_int(start)
            or start < 0
            or (end is not None and (not _is_int(end) or end <= start))
        ):
            raise ValueError(
                'hidden_states_positions as a window must be {"start": s, "end": e} '
                "with integers 0 <= s < e (end optional: to the final token), got "
                f"{value!r}"
            )
        return Window(start, end)
    if value not in POSITIONS:
        raise ValueError(
            f"hidden_states_positions must be one of {list(POSITIONS)} or a window "
            f'{{"start": s, "end": e}}, got {value!r}'
        )
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def window_of(positions: "Positions | Window", prompt_len: int) -> Window | None:
    """The window an "all"-like request captures: "generated" is
    ``{"start": prompt_len}``, "all" none (every position)."""
    if isinstance(positions, Window):
        return positions
    return Window(prompt_len) if positions == "generated" else None


def window_problem(window: Window, prompt_len: int, max_len: int) -> str | None:
    """Why ``window`` cannot be served for a prompt of ``prompt_len`` tokens
    whose sequence can reach ``max_len`` positions (prompt + max_tokens),
    or None."""
    if window.start >= max_len:
        return (
            f"the window starts at position {window.start}, past the last position "
            f"this request can reach ({max_len - 1}: {prompt_len} prompt tokens + "
            f"max_tokens); positions count over prompt + output from 0"
        )
    if window.end is not None and window.end > max_len:
        return (
            f"the window ends at {window.end}, past the {max_len} positions this "
            f"request can reach ({prompt_len} prompt tokens + max_tokens); lower "
            "end or leave it out (to the final token)"
        )
    return None


def check_layers(value: Any, features_only: bool, points: bool = False) -> list[int]:
    """``hidden_states_layers``: a non-empty list of integers (HF convention),
    or None for the default (:data:`DEFAULT_LAYERS`; none when the request
    asks for SAE features only, ``features_only``, or names ``points``).
    Whether each layer exists is :meth:`HiddenStatesConfig.resolve_all`'s
    check."""
    if value is None:
        return [] if features_only or points else list(DEFAULT_LAYERS)
    if (
        not isinstance(value, (list, tuple))
        or not value
        or any(isinstance(k, bool) or not isinstance(k, int) for k in value)
    ):
        leave_out = "; leave it out to receive sae_features only" if features_only else ""
        raise ValueError(
            "hidden_states_layers must be a non-empty list of integers (HF "
            "convention: 0 = embeddings, -1 = final post-norm state), got "
            f"{value!r}{leave_out}"
        )
    return [int(k) for k in value]


# -- capture points (see the module doc) -------------------------------------

PointKind = Literal[
    "resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post", "attn_pattern", "mlp_post"
]
POINT_KINDS: tuple[PointKind, ...] = get_args(PointKind)
# Attention patterns: [heads, query positions, key positions] per layer, not
# a row of the residual stream (CapturedRows.patterns, not .hidden).
PATTERN_KIND: PointKind = "attn_pattern"
# MLP neurons: the down projection's input, [positions, intermediate_size]
# per layer (CapturedRows.neurons). Dense MLPs only.
NEURON_KIND: PointKind = "mlp_post"
# Longest sequence an attention-pattern request may reach: its answer is
# [heads, positions, keys] per point, square in the length.
MAX_PATTERN_POSITIONS = 4096
# Kinds whose every layer has a capture id of its own past L, in id order.
_OWN_ID_KINDS: tuple[PointKind, ...] = ("attn_out", "resid_mid", "mlp_out")

# Which layers and points of a model are exact is decided by the class of each
# decoder layer (vllm_hidden_states/layers.py: LAYER_CLASSES, each tested
# against HF), never by the architecture's name. A layer of a class not known
# there has no reader: its stream and points are refused, and only layer 0
# (the embedding output, entering the first decoder layer) and layer L (the
# model's own final post-norm output) are served.


_NOT_VERIFIED = (
    "a layer class whose residual-stream convention is not verified against HF "
    "transformers here, so its states are refused rather than guessed"
)


@dataclass(frozen=True)
class ModelLayers:
    """The decoder layers of one model as the package knows them.

    Attributes:
        classes: the qualified class of each decoder layer, predicted from the
            vLLM model class (None: not predicted).
        model_class: the vLLM model class the architecture resolves to (for
            messages), None when vLLM's registry does not know it.
        experts: whether the model's MLP blocks have routed experts where the
            layer class's mlp_out / mlp_post are untested with them (Granite
            4.0-H with ``num_local_experts > 0``).
    """

    classes: tuple[str | None, ...]
    model_class: str | None = None
    experts: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.classes)

    def known(self, i: int) -> "LayerClass | None":
        from vllm_hidden_states.layers import LAYER_CLASSES

        name = self.classes[i]
        return None if name is None else LAYER_CLASSES.get(name)

    def kinds_at(self, i: int) -> tuple[PointKind, ...]:
        """The point kinds exact at decoder layer ``i``."""
        known = self.known(i)
        if known is None:
            return ("resid_pre",) if i == 0 else ()
        if not known.points:
            return ("resid_pre",)
        lacks: set[str] = set()
        if known.kinds is not None:  # e.g. a single-block layer (Nemotron-H)
            lacks |= set(POINT_KINDS) - set(known.kinds)
        if not known.attention:
            lacks.add(PATTERN_KIND)
        if known.neurons is None:
            lacks.add(NEURON_KIND)
        if self.experts and known.layout == "granite_hybrid":
            lacks |= {"mlp_out", NEURON_KIND}
        return tuple(k for k in POINT_KINDS if k not in lacks)

    def kinds(self) -> tuple[PointKind, ...]:
        """The kinds exact at one layer at least."""
        have = {k for i in range(self.num_layers) for k in self.kinds_at(i)}
        return tuple(k for k in POINT_KINDS if k in have)

    def layer_exact(self, k: int) -> bool:
        """Whether HF layer ``k`` (absolute, ``0..L``) is read exactly: the
        embedding output, the final post-norm state, or the stream entering
        a decoder layer of a known class."""
        return k in (0, self.num_layers) or self.known(k) is not None

    def exact_layers(self) -> list[int]:
        return [k for k in range(self.num_layers + 1) if self.layer_exact(k)]

    def _describe_class(self, i: int) -> str:
        name = self.classes[i]
        if name is not None:
            return f"a {name.rsplit('.', 1)[-1]} ({name})"
        where = f"{self.model_class}'s" if self.model_class else "this model's"
        return f"one of {where} decoder layer classes"

    def exact_help(self) -> str:
        """What is exact on this model, and how to ask for it."""
        layers = self.exact_layers()
        n = self.num_layers
        named = ", ".join(
            "0 (the embedding output)"
            if k == 0
            else f"{n} = -1 (the final post-norm state)"
            if k == n
            else str(k)
            for k in layers
        )
        return (
            f"exact on this model: layers {named}; ask for those (e.g. "
            f"hidden_states_layers=[0, -1], --hidden-states-layers 0,-1)"
        )

    def why_not_layer(self, k: int) -> str:
        """Why HF layer ``k`` (negative: from the end) is refused (it is not
        :meth:`layer_exact`)."""
        i = k % (self.num_layers + 1)
        return (
            f"layer {k} is the residual stream entering decoder layer {i}, "
            f"{self._describe_class(i)}: {_NOT_VERIFIED}; {self.exact_help()}"
        )

    def why_not(self, kind: str, i: int) -> str:
        """Why point ``kind`` of decoder layer ``i`` is refused."""
        known = self.known(i)
        if known is None:
            return (
                f"{kind}.{i} is in decoder layer {i}, {self._describe_class(i)}: "
                f"{_NOT_VERIFIED}; {self.exact_help()}"
            )
        name = (self.classes[i] or "").rsplit(".", 1)[-1]
        if not known.points:
            return (
                f"{kind}.{i} is inside decoder layer {i}, a {name}: the points inside "
                f"its layers are not verified against HF transformers here, only the "
                f"stream entering each (resid_pre.{i}, the same as layer {i}); "
                f"{self.exact_help()}"
            )
        if known.kinds is not None and kind not in known.kinds:
            why = f"{kind}.{i}: decoder layer {i} ({name}) {known.lacks}; its points: " + (
                ", ".join(self.kinds_at(i))
            )
            if kind != PATTERN_KIND:
                return why
            attention = [j for j in range(self.num_layers) if PATTERN_KIND in self.kinds_at(j)]
            return f"{why}; it is not attention; attention layers: {attention}"
        if kind == PATTERN_KIND and known.layout == "olmo2":
            return (
                f"attn_pattern needs vLLM's own attention module in the decoder layer "
                f"(self_attn.attn); {name} runs on vLLM's Transformers backend"
            )
        if kind == PATTERN_KIND:
            attention = [j for j in range(self.num_layers) if PATTERN_KIND in self.kinds_at(j)]
            return (
                f"attn_pattern.{i}: decoder layer {i} ({name}) mixes tokens with "
                f"{known.mixer}, not attention; attention layers: {attention}"
            )
        if kind in (NEURON_KIND, "mlp_out") and self.experts:
            return (
                f"{kind}.{i}: {name}'s MLP block has routed experts here, untested "
                "with them (resid_mid and resid_post are exact)"
            )
        if kind == NEURON_KIND:
            return (
                f"mlp_post (MLP neurons) needs a dense MLP; {name}'s is a mixture "
                "of experts (mlp_out is its combined output)"
            )
        return f"{kind} is not a point of decoder layer {i} ({name})"

    @classmethod
    def of(cls, model_config: Any, num_layers: int) -> "ModelLayers":
        """The layers of a model, from its vLLM ``ModelConfig`` (or anything
        with ``architectures`` and ``hf_text_config``)."""
        from vllm_hidden_states.layers import model_class_of, predicted_layer_classes

        try:
            model_class = model_class_of(model_config)
        except Exception:
            model_class = None
        text_config = getattr(model_config, "hf_text_config", None)
        return cls(
            predicted_layer_classes(model_config, num_layers),
            model_class,
            int(getattr(text_config, "num_local_experts", 0) or 0) > 0,
        )


def model_layers_for(architecture: str | None, num_layers: int = 1) -> ModelLayers:
    """:class:`ModelLayers` of a uniform model of ``architecture`` (every
    layer of one class), from the name alone."""
    from types import SimpleNamespace

    return ModelLayers.of(SimpleNamespace(architectures=[architecture]), num_layers)


def point_kinds_for(architecture: "str | ModelLayers | None") -> tuple[PointKind, ...]:
    """The kinds exact at one layer at least of a model (or of a uniform
    model of an architecture)."""
    if isinstance(architecture, ModelLayers):
        return architecture.kinds()
    return model_layers_for(architecture, 2).kinds_at(1)


def missing_kind_reason(kind: str, model: "str | ModelLayers | None", layer: int = 1) -> str:
    """Why ``kind`` cannot be captured at decoder layer ``layer`` of a model."""
    if not isinstance(model, ModelLayers):
        model = model_layers_for(model, max(2, layer + 1))
    return model.why_not(kind, layer)


if TYPE_CHECKING:
    from vllm_hidden_states.layers import LayerClass

_ADDRESS = re.compile(r"^(?:blocks\.(-?\d+)\.hook_([a-z_]+)|([a-z_]+)\.(-?\d+))$")
# TransformerLens' own name of the pattern hook: blocks.{i}.attn.hook_pattern.
_TL_PATTERN = re.compile(r"^blocks\.(-?\d+)\.attn\.hook_pattern$")


def point_layout(architecture: str | None) -> str | None:
    """The layout shared by every decoder layer of a uniform model of
    ``architecture`` (None: none, or not known). Only a hint for logs: the
    worker reads each loaded layer by its own class (layers.py)."""
    known = model_layers_for(architecture, 2).known(1)
    return None if known is None else known.layout


def address_help(num_layers: int) -> str:
    return (
        f"a point is '<kind>.<i>' or 'blocks.<i>.hook_<kind>' with kind one of "
        f"{list(POINT_KINDS)} and i a decoder layer in "
        f"{-num_layers}..{num_layers - 1}"
    )


def parse_point(address: Any, num_layers: int) -> tuple[PointKind, int]:
    """``(kind, layer)`` of a point address, the layer absolute in
    ``0..L-1``; ValueError naming the allowed forms."""
    tl = _TL_PATTERN.match(address) if isinstance(address, str) else None
    match = _ADDRESS.match(address) if isinstance(address, str) else None
    if match is None and tl is None:
        raise ValueError(f"{address!r} is not a point address; {address_help(num_layers)}")
    kind: str
    if tl is not None:
        layer_text, kind = tl[1], PATTERN_KIND
    elif match is not None and match[1] is not None:
        layer_text, kind = match[1], match[2]
    else:
        assert match is not None
        layer_text, kind = match[4], match[3]
    if kind not in POINT_KINDS:
        raise ValueError(f"{address!r}: unknown kind {kind!r}; {address_help(num_layers)}")
    layer = int(layer_text)
    if not -num_layers <= layer < num_layers:
        raise ValueError(
            f"{address!r}: layer {layer} is out of range for a {num_layers}-layer "
            f"model; {address_help(num_layers)}"
        )
    return kind, layer % num_layers  # type: ignore[return-value]


def point_id(kind: PointKind, layer: int, num_layers: int) -> int:
    """The capture id of point ``kind.layer`` (``layer`` absolute): HF layer
    ``layer`` for resid_pre, ``layer + 1`` for resid_post below the last
    layer, else an id past ``L``."""
    n = num_layers
    if kind == "resid_pre":
        return layer
    if kind == "resid_post":
        return layer + 1 if layer < n - 1 else n + 1 + len(_OWN_ID_KINDS) * n
    if kind == PATTERN_KIND:
        return n + 2 + len(_OWN_ID_KINDS) * n + layer
    if kind == NEURON_KIND:
        return n + 2 + (len(_OWN_ID_KINDS) + 1) * n + layer
    return n + 1 + _OWN_ID_KINDS.index(kind) * n + layer


def point_of_id(capture_id: int, num_layers: int) -> tuple[PointKind, int] | None:
    """``(kind, layer)`` of a capture id past ``L``; None for an HF layer
    ``0..L`` (resid_pre of it, or the final post-norm state)."""
    n = num_layers
    if capture_id <= n:
        return None
    offset = capture_id - (n + 1)
    if offset == len(_OWN_ID_KINDS) * n:
        return "resid_post", n - 1
    if offset > len(_OWN_ID_KINDS) * n:
        rest = offset - len(_OWN_ID_KINDS) * n - 1
        return (PATTERN_KIND, rest) if rest < n else (NEURON_KIND, rest - n)
    return _OWN_ID_KINDS[offset // n], offset % n


def is_pattern_id(capture_id: int, num_layers: int) -> bool:
    """Whether a capture id is an attention pattern (not a residual row)."""
    point = point_of_id(capture_id, num_layers)
    return point is not None and point[0] == PATTERN_KIND


def is_neuron_id(capture_id: int, num_layers: int) -> bool:
    """Whether a capture id is an MLP-neuron point (``intermediate_size`` wide)."""
    point = point_of_id(capture_id, num_layers)
    return point is not None and point[0] == NEURON_KIND


def is_neuron_address(address: str) -> bool:
    """Whether a (well-formed) point address names MLP neurons (mlp_post)."""
    match = _ADDRESS.match(address)
    return match is not None and NEURON_KIND in (match[2], match[3])


def is_pattern_address(address: str) -> bool:
    """Whether a (well-formed) point address names an attention pattern,
    without knowing the model (the server splits a request's points)."""
    if _TL_PATTERN.match(address):
        return True
    match = _ADDRESS.match(address)
    return match is not None and PATTERN_KIND in (match[2], match[3])


def layer_of_id(capture_id: int, num_layers: int) -> int:
    """The decoder layer whose forward computes a capture id (for pipeline
    stages): ``k`` for HF layer ``k < L`` (entering layer ``k``), the layer
    of a point past ``L``, ``L`` for the final post-norm state."""
    point = point_of_id(capture_id, num_layers)
    return capture_id if point is None else point[1]


def id_name(capture_id: int, num_layers: int) -> str:
    """A capture id as users name it: the HF layer, or ``kind.i``."""
    point = point_of_id(capture_id, num_layers)
    return str(capture_id) if point is None else f"{point[0]}.{point[1]}"


def check_points(value: Any) -> list[str]:
    """``hidden_states_points``: None (none) or a non-empty list of address
    strings; whether each exists is :meth:`HiddenStatesConfig.resolve_points`'s
    check."""
    if value is None:
        return []
    if (
        not isinstance(value, (list, tuple))
        or not value
        or any(not isinstance(a, str) for a in value)
    ):
        raise ValueError(
            "hidden_states_points must be a non-empty list of point addresses such "
            f"as ['attn_out.3', 'blocks.5.hook_mlp_out'], got {value!r}"
        )
    return list(value)


def parse_points_arg(value: str | list[str] | None) -> list[str] | None:
    """Parse ``--hidden-states-points``: ``"all"``, kinds (every layer) and
    addresses, comma separated (or a list); None = no points beyond the
    layers. Checked against the model at start (:meth:`HiddenStatesConfig.
    from_vllm_config`)."""
    if value is None:
        return None
    items = list(value) if isinstance(value, (list, tuple)) else str(value).split(",")
    items = [str(x).strip() for x in items if str(x).strip()]
    if not items or any(not isinstance(x, str) for x in items):
        raise ValueError(
            "--hidden-states-points (hidden_states_points) must be 'all', kinds "
            f"such as 'attn_out,mlp_out' (every layer) or addresses such as "
            f"'attn_out.3', got {value!r}"
        )
    return items


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
    model = (
        architecture
        if isinstance(architecture, ModelLayers)
        else model_layers_for(architecture, num_layers)
    )
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


SAE_HINT = "start it with sae=DIR (LLM / EngineArgs) or `vllm serve MODEL --sae DIR`"


def check_sae_features(value: Any, d_sae: int | None = None) -> int:
    """``k`` of ``sae_features={"top_k": k}``: an integer ``1 <= k <= d_sae``
    (the bound is checked when ``d_sae`` is given)."""
    k = value.get("top_k") if isinstance(value, dict) else None
    bound = (
        f"1..{d_sae} (the SAE's d_sae)" if d_sae is not None else ">= 1 (at most the SAE's d_sae)"
    )
    if (
        not isinstance(value, dict)
        or set(value) != {"top_k"}
        or isinstance(k, bool)
        or not isinstance(k, int)
        or k < 1
        or (d_sae is not None and k > d_sae)
    ):
        raise ValueError(
            f'sae_features must be {{"top_k": k}} with an integer k in {bound}, got {value!r}'
        )
    return k


ENABLE_HINT = (
    "start the engine with enable_hidden_states=True (LLM / EngineArgs) "
    "or `vllm serve MODEL --enable-hidden-states`"
)


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


def additional_config_entry(
    layers: str | list[int] | None,
    max_rows: int | None = None,
    *,
    points: str | list[str] | None = None,
    sae: str | None = None,
    sae_layer: int | None = None,
    steering: bool = False,
    steering_points: str | list[str] | None = None,
    steering_vectors: str | None = None,
    max_steering: int | None = None,
) -> dict[str, Any]:
    """The ``additional_config["hidden_states"]`` entry EngineArgs folds in.

    It keys vLLM's torch.compile cache, so it holds everything that changes
    the compiled graph: the capturable layers, the buffer rows, the version.

    Args:
        layers: ``EngineArgs.hidden_states_layers`` as given (a list, or the
            ``--hidden-states-layers`` string); None = every layer ``0..L``.
        max_rows: ``EngineArgs.hidden_states_max_rows``; None = the default.
        points: ``EngineArgs.hidden_states_points`` (``--hidden-states-points``:
            "all", kinds, addresses); None = none beyond the layers.
        sae, sae_layer: ``EngineArgs.sae`` (an SAELens directory) and
            ``sae_layer`` (None: from the SAE's config); see :func:`sae_entry`.
        steering, steering_points, steering_vectors, max_steering:
            ``EngineArgs.enable_steering`` and its options; see
            :func:`vllm_hidden_states.steering.steering_entry`.
    """
    if max_rows is not None and (isinstance(max_rows, bool) or int(max_rows) < 1):
        raise ValueError(f"--hidden-states-max-rows must be a positive integer, got {max_rows!r}")
    entry: dict[str, Any] = {
        "layers": parse_layers_arg(layers),
        "points": parse_points_arg(points),
        "max_rows": None if max_rows is None else int(max_rows),
        "capture": CAPTURE_VERSION,
    }
    if sae:
        entry["sae"] = sae_entry(sae, sae_layer)
    if steering:
        from vllm_hidden_states.steering import STEERING_KEY, steering_entry

        entry[STEERING_KEY] = steering_entry(
            steering_points,
            steering_vectors,
            max_steering,
            entry["sae"]["path"] if "sae" in entry else None,
        )
    elif steering_points is not None or steering_vectors is not None or max_steering is not None:
        raise ValueError(
            "--steering-points, --steering-vectors and --max-steering need "
            "--enable-steering (enable_steering=True)"
        )
    return entry


def sae_entry(path: str, layer: int | None = None) -> dict[str, Any]:
    """``additional_config["hidden_states"]["sae"]``: what every process needs
    to know of ``--sae DIR`` without loading weights, read once at start from
    its ``cfg.json``: ``path`` (absolute), ``layer`` (HF convention as given
    or from the config's hook name) or ``point`` (a capture point address
    from the hook name, e.g. ``blocks.3.hook_attn_out`` -> ``"attn_out.3"``;
    None when it reads a layer), ``d_in``, ``d_sae``, ``name`` (the directory
    name, the store's ``sae_release``).

    Raises ValueError naming the problem and what is allowed.
    """
    import json
    from pathlib import Path

    from vllm_hidden_states.sae import (
        CFG_FILE,
        WEIGHTS_FILE,
        _cfg_value,
        layer_of_hook,
        point_of_hook,
    )

    root = Path(path).expanduser().resolve()
    for name in (CFG_FILE, WEIGHTS_FILE):
        if not (root / name).is_file():
            raise ValueError(
                f"--sae {path}: {root / name} not found; an SAE directory in the "
                f"SAELens format holds {CFG_FILE} and {WEIGHTS_FILE}"
            )
    cfg = json.loads((root / CFG_FILE).read_text())
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
        raise ValueError(f"--sae-layer must be an integer (HF convention), got {layer!r}")
    point = None
    layer_given = layer
    if layer is None:
        layer = layer_of_hook(_cfg_value(cfg, "hook_name"))
        point = point_of_hook(_cfg_value(cfg, "hook_name"))
    if layer is None and point is None:
        raise ValueError(
            f"--sae {path}: its config names no hook this engine captures "
            f"(hook_name {_cfg_value(cfg, 'hook_name')!r}; understood: "
            "blocks.<i>.hook_resid_pre / hook_resid_post / hook_resid_mid / "
            "hook_attn_out / hook_mlp_out); give the layer with --sae-layer N "
            "(sae_layer=N)"
        )
    for key in ("d_in", "d_sae"):
        if isinstance(cfg.get(key), bool) or not isinstance(cfg.get(key), int):
            raise ValueError(f"--sae {path}: {CFG_FILE} {key!r} must be an integer")
    return {
        "path": str(root),
        "layer": None if layer is None else int(layer),
        "point": point,
        # The hook the layer or point was read from (None with --sae-layer):
        # steering beside it needs to know resid_post.i from resid_pre.(i+1).
        "hook_name": _cfg_value(cfg, "hook_name") if layer_given is None else None,
        "d_in": cfg["d_in"],
        "d_sae": cfg["d_sae"],
        "name": root.name,
    }


def sae_capture_id(
    sae: dict[str, Any], num_layers: int, architecture: "str | ModelLayers | None"
) -> int | None:
    """The capture id an SAE (:func:`sae_entry`) reads: its HF layer, or the
    id of its point; None when the model has no such layer or point, or not
    exactly (:func:`sae_problems` says why at start)."""
    model = (
        architecture
        if isinstance(architecture, ModelLayers)
        else model_layers_for(architecture, num_layers)
    )
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


def parse_layers_arg(value: str | list[int] | None) -> list[int] | None:
    """Parse ``--hidden-states-layers`` (``"-1,-2,16"``, ``"all"``, or a list)."""
    if value is None:
        return None
    items: list[Any]
    if isinstance(value, (list, tuple)):
        items = list(value)
    else:
        text = str(value).strip()
        if text in ("", "all"):
            return None
        items = [x for x in text.replace(" ", "").split(",") if x]
    try:
        layers = [_as_int(x) for x in items]
    except (TypeError, ValueError):
        layers = []
    if not layers:
        raise ValueError(
            f"--hidden-states-layers (hidden_states_layers) must be 'all' or "
            f"integers such as '-1,-2,16', got {value!r}"
        )
    return layers


def _as_int(value: Any) -> int:
    if isinstance(value, bool) or isinstance(value, float):
        raise TypeError(value)
    return int(value)


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


# Set to 0 to run an engine with hidden states without async scheduling
# (vLLM's default on CUDA, which it keeps otherwise).
ASYNC_SCHEDULING_ENV = "VLLM_HIDDEN_STATES_ASYNC_SCHEDULING"


def async_scheduling_for(requested: bool | None) -> bool | None:
    """``SchedulerConfig.async_scheduling`` for an engine with hidden states,
    given what was asked (None: vLLM's default, on for CUDA).

    Called from ``EngineArgs.create_engine_config`` (patch 0005) before vLLM
    resolves its default. Capture follows async scheduling (a step is planned
    before the previous one's output is processed; output placeholders count
    as positions), so vLLM's choice stands. ``VLLM_HIDDEN_STATES_ASYNC_SCHEDULING=0``
    switches it off (one log line); it cannot be combined with an explicit
    ``--async-scheduling``.
    """
    import os

    from vllm.logger import init_logger

    if os.environ.get(ASYNC_SCHEDULING_ENV) != "0":
        return requested
    if requested:
        raise ValueError(
            f"--async-scheduling contradicts {ASYNC_SCHEDULING_ENV}=0: drop one "
            f"(unset {ASYNC_SCHEDULING_ENV} to keep vLLM's async scheduling, or drop "
            "--async-scheduling to run without it)"
        )
    init_logger(__name__).info(
        "vllm-hidden-states: async scheduling off (%s=0)", ASYNC_SCHEDULING_ENV
    )
    return False


def v2_model_runner_unsupported(vllm_config: "VllmConfig") -> list[str]:
    """What Model Runner V2 cannot do for this engine's hidden states, for
    ``VllmConfig._get_v2_model_runner_unsupported_features`` (patch 0005):
    vLLM then runs the V1 runner, or refuses ``VLLM_USE_V2_MODEL_RUNNER=1``.

    Capture and steering run on both runners (patches 0008 and 0010), except
    pipeline parallelism, whose stage-to-stage hand-over of captured rows is
    built and tested on the V1 runner only.
    """
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        return ["per-request hidden states with pipeline parallelism (vllm-hidden-states)"]
    return []


def validate_engine_config(vllm_config: "VllmConfig") -> None:
    """Refuse, at start-up, set-ups where returned states would be wrong.

    Called once from ``EngineArgs.create_engine_config`` in the front-end.

    Data parallelism (dense models) is allowed: each extract goes to the
    engine that served its request (``frontend/routing.py``). Pipeline
    parallelism is allowed without speculative decoding: each stage captures
    its own layers and sends its rows on to the last one
    (``worker/capture.py``). MoE data
    parallelism, where engines step in lockstep waves, is refused until it
    can be tested (vLLM's CPU platform cannot run it; an extract arriving
    after a wave ended would have to restart the wave, as
    ``DPEngineCoreProc.add_request`` does). Tensor parallelism needs nothing:
    every TP rank computes the full residual stream.
    """
    cfg = HiddenStatesConfig.from_vllm_config(vllm_config)
    if cfg is None:
        return
    problems = []
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1 and vllm_config.speculative_config is not None:
        # Each stage captures its own layers and sends its rows on with the
        # intermediate tensors (worker/capture.py); untested with drafters.
        problems.append(
            "pipeline parallelism (pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size}) with speculative decoding is "
            "not supported yet"
        )
    if parallel.data_parallel_size > 1 and vllm_config.model_config.is_moe:
        problems.append(
            "data parallelism with a MoE model (data_parallel_size="
            f"{parallel.data_parallel_size}, lockstep DP waves) is untested with "
            "hidden states: vLLM's CPU platform fails MoE data parallel at the "
            "first forward (NotImplementedError in all_gatherv)"
        )
    ray = [
        f"{name}={value!r}"
        for name, value in (
            ("distributed_executor_backend", parallel.distributed_executor_backend),
            ("data_parallel_backend", parallel.data_parallel_backend),
        )
        if value == "ray"
    ]
    if ray:
        problems.append(
            f"the Ray backend ({', '.join(ray)}) is untested with hidden states: "
            "vLLM's CPU platform cannot run it (\"current platform cpu does not "
            'support ray"); use the default mp backend'
        )
    spec = vllm_config.speculative_config
    if spec is not None and spec.method not in SPECULATIVE_METHODS:
        problems.append(
            f"speculative decoding method {spec.method!r} is not supported yet "
            f"(tested with hidden states: {', '.join(SPECULATIVE_METHODS)})"
        )
    if vllm_config.model_config.runner_type != "generate":
        problems.append(
            f"runner {vllm_config.model_config.runner_type!r}: hidden states need a generate model"
        )
    sharded = [
        k for k in cfg.layers if is_pattern_id(k, cfg.num_layers) or is_neuron_id(k, cfg.num_layers)
    ]
    if sharded and (parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1):
        problems.append(
            "attention patterns and MLP neurons (attn_pattern, mlp_post in "
            "--hidden-states-points) are not supported with tensor or pipeline "
            "parallelism yet (each rank holds only its heads / neurons / layers); "
            "name the other kinds instead of 'all', e.g. --hidden-states-points "
            "attn_out,resid_mid,mlp_out,resid_post"
        )
    problems += sae_problems(cfg, vllm_config.model_config.get_hidden_size())
    problems += steering_problems(vllm_config)
    if problems:
        raise ValueError(
            "--enable-hidden-states cannot be used with this configuration: " + "; ".join(problems)
        )


def steering_problems(vllm_config: "VllmConfig") -> list[str]:
    """Why ``--enable-steering`` cannot serve this engine (empty: it can)."""
    from vllm_hidden_states.steering import SteeringConfig

    try:
        steering = SteeringConfig.from_vllm_config(vllm_config)
    except ValueError as e:
        return [str(e)]
    if steering is None:
        return []
    hidden_size = vllm_config.model_config.get_hidden_size()
    wrong = {name: n for name, n in steering.vectors.items() if n != hidden_size}
    problems = []
    if wrong:
        problems.append(
            f"--steering-vectors: {sorted(wrong)} have lengths {sorted(set(wrong.values()))}; "
            f"this model's hidden_size is {hidden_size}"
        )
    if vllm_config.speculative_config is not None:
        problems.append(
            "steering with speculative decoding is not supported (the drafter "
            "would propose tokens of the unsteered model); drop --speculative-config"
        )
    return problems


def sae_problems(cfg: HiddenStatesConfig, hidden_size: int) -> list[str]:
    """Why ``--sae`` cannot serve this engine (empty: it can)."""
    if cfg.sae is None:
        return []
    sae, n = cfg.sae, cfg.num_layers
    problems = []
    if sae["d_in"] != hidden_size:
        problems.append(
            f"--sae {sae['path']}: its d_in is {sae['d_in']} but the model's "
            f"hidden size is {hidden_size}; the SAE must be trained on this model"
        )
    if cfg.sae_layer is None and sae.get("point") is not None:
        try:
            kind, layer = parse_point(sae["point"], n)
            why = cfg.model.why_not(kind, layer)
        except ValueError as e:
            why = str(e)
        problems.append(f"--sae reads point {sae['point']}: {why}")
    elif cfg.sae_layer is None and -(n + 1) <= sae["layer"] <= n:
        problems.append(
            f"--sae reads layer {sae['layer']}: {cfg.model.why_not_layer(sae['layer'])}"
        )
    elif cfg.sae_layer is None:
        problems.append(
            f"--sae layer {sae['layer']} is out of range for a {n}-layer model; "
            f"valid indices are {-(n + 1)}..{n} (HF convention; set --sae-layer)"
        )
    elif cfg.sae_layer not in cfg.layers:
        problems.append(
            f"--sae reads layer {sae['layer']}, which is not capturable; "
            f"capturable layers: {cfg.describe_capturable()} (add it to "
            "--hidden-states-layers)"
        )
    return problems


# Speculative methods tested alongside hidden states. Extracts and prompt
# captures are prefills, never drafted for; captures do not use the models'
# aux outputs, so drafters that do (EAGLE3) would not conflict, but they are
# untested here (no GPU and no tiny drafter), so they are refused.
SPECULATIVE_METHODS: tuple[str, ...] = ("ngram",)

LAYERS_FLAG = "--hidden-states-layers"


def join_layers_value(args: list[str]) -> list[str]:
    """``["--hidden-states-layers", "-1,-2,16"]`` -> ``["--hidden-states-layers=-1,-2,16"]``.

    argparse reads a value that starts with ``-`` and is not a plain negative
    number as an option, so the natural spelling would fail to parse. Called
    from ``FlexibleArgumentParser.parse_args`` (patch 0005).
    """
    out: list[str] = []
    i = 0
    while i < len(args):
        if args[i] == LAYERS_FLAG and i + 1 < len(args) and args[i + 1].startswith("-"):
            out.append(f"{LAYERS_FLAG}={args[i + 1]}")
            i += 2
        else:
            out.append(args[i])
            i += 1
    return out


def add_cli_args(parser) -> None:
    """The package's flags on vLLM's EngineArgs parser (patch 0005). The
    natural ``--hidden-states-layers -1,-2,16`` is joined into one value by
    :func:`join_layers_value`, called from ``FlexibleArgumentParser.parse_args``
    (patch 0005) before argparse sees it."""
    group = parser.add_argument_group(
        title="Hidden states (vllm-hidden-states)",
        description="Per-request hidden states on chat/completions and POST /v1/hidden_states.",
    )
    group.add_argument(
        "--enable-hidden-states",
        action="store_true",
        default=False,
        help="Let requests ask for hidden states (return_hidden_states).",
    )
    group.add_argument(
        LAYERS_FLAG,
        type=str,
        default=None,
        help="Capturable layers, HF convention (0 = embeddings, -1 = final "
        "post-norm state), e.g. '-1,-2,16'. Default: every layer. Each layer "
        "but the last costs one capture buffer of --hidden-states-max-rows x "
        "hidden_size in the model dtype.",
    )
    group.add_argument(
        "--hidden-states-points",
        type=str,
        default=None,
        help="Capturable points beyond the layers: 'all', kinds (every layer) "
        "such as 'attn_out,resid_mid,mlp_out,resid_post', or addresses such "
        "as 'attn_out.3,blocks.5.hook_mlp_out'. Default: none (the residual "
        "stream of --hidden-states-layers). Each point but resid_pre.i / "
        "resid_post.i below the last layer costs one capture buffer of "
        "--hidden-states-max-rows x hidden_size in the model dtype.",
    )
    group.add_argument(
        "--hidden-states-max-rows",
        type=int,
        default=None,
        help="Rows of hidden states one forward can capture (the capture "
        "buffers' length). Default: max_num_batched_tokens, as long as the "
        f"buffers fit {DEFAULT_BUFFER_MIB} MiB, but at least {DEFAULT_MAX_ROWS} "
        "(never more than max_num_batched_tokens). Longer captures are split "
        "over steps.",
    )
    group.add_argument(
        "--sae",
        type=str,
        default=None,
        help="SAE directory in the SAELens format (cfg.json + "
        "sae_weights.safetensors): requests may ask for its top-k features "
        '("sae_features": {"top_k": k}). Implies --enable-hidden-states.',
    )
    group.add_argument(
        "--sae-layer",
        type=int,
        default=None,
        help="Layer the SAE reads (HF convention, e.g. 6 or -2). Default: "
        "from the SAE config's hook name (blocks.<i>.hook_resid_pre = i, "
        "hook_resid_post = i + 1).",
    )
    group.add_argument(
        "--enable-steering",
        action="store_true",
        default=False,
        help="Let requests steer: per-request interventions (add, ablate) "
        "written into the residual stream in-graph (the 'steering' field). "
        "Implies --enable-hidden-states.",
    )
    group.add_argument(
        "--steering-points",
        type=str,
        default=None,
        help="Steerable points: 'all', kinds (every layer) such as "
        "'resid_pre,attn_out', or addresses such as 'resid_pre.3,mlp_out.5'. "
        "Default: resid_pre (every layer). Each costs one steering op per "
        "forward.",
    )
    group.add_argument(
        "--steering-vectors",
        type=str,
        default=None,
        help="Directory of named steering vectors (*.safetensors of 1-D "
        "[hidden_size] tensors; name = file stem, or stem/tensor for files "
        "with several), loaded at start and listed at GET /v1/steering_vectors.",
    )
    group.add_argument(
        "--max-steering",
        type=int,
        default=None,
        help="Interventions one request may carry. Default: 4.",
    )
    # Activation store (API server only; read by server.openai_fields).
    group.add_argument(
        "--activation-store",
        type=str,
        default=None,
        help="Directory of the activation store: every request that asked "
        "for sae_features appends its rows to Parquet there, off the "
        "serving path (a failing store is logged, the request served).",
    )
    group.add_argument(
        "--activation-store-hidden-states",
        action="store_true",
        default=False,
        help="Also store the hidden states of requests that asked for them "
        "(large: one float32 vector per position and layer).",
    )
    group.add_argument(
        "--activation-store-retention-days",
        type=int,
        default=None,
        help="Delete store partitions older than this many days. Default: "
        "VLLM_HIDDEN_STATES_STORE_RETENTION_DAYS, else 14.",
    )
    # Server admission limits (read by vllm_hidden_states.server.admission;
    # the API server only, EngineArgs ignores them).
    group.add_argument(
        "--hidden-states-max-response-mb",
        type=float,
        default=None,
        help="Largest response a hidden-states request may produce, in MB "
        "(2**20 bytes), priced before any work. Default: the environment "
        "variable VLLM_HIDDEN_STATES_MAX_RESPONSE_MB, else 256.",
    )
    group.add_argument(
        "--hidden-states-max-batch",
        type=int,
        default=None,
        help="Most hidden-state results one request may ask for (inputs on "
        "/v1/hidden_states, prompts x n on completions, n on chat). "
        "Default: 256.",
    )
    group.add_argument(
        "--hidden-states-max-input-chars",
        type=int,
        default=None,
        help="Most characters of input text (prompt, messages, input) one "
        "hidden-states request may send. Default: 2000000.",
    )
    # Request bounds on every route (read by vllm_hidden_states.server.bounds).
    from vllm_hidden_states.server.bounds import add_cli_args as add_bounds_args

    add_bounds_args(group)
