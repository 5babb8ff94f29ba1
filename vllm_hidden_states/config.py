# SPDX-License-Identifier: Apache-2.0
"""The shared contract: engine configuration and the layer convention.

Imported by every process (front-end, EngineCore, workers, API server); it
imports nothing from vLLM at module level.

The switch lives in ``VllmConfig.additional_config["hidden_states"]`` so that it
reaches every process (front-end, EngineCore, workers) inside the pickled config
and keys vLLM's torch.compile cache: turning capture on adds aux outputs to the
compiled graph, and a graph compiled without them cannot be reused with them.

Layer convention (the same as HF transformers ``output_hidden_states``), with
``L = num_hidden_layers``:

* ``0``: the embedding output;
* ``1..L-1``: the residual stream after decoder layer ``k``
  (vLLM's aux hidden state ``k``, i.e. ``hidden + residual``);
* ``L`` (``-1``): the final, post-norm hidden state, i.e. the LM-head input.

Negative indices count from the end over those ``L + 1`` entries, so ``-2`` is
``L - 1``: the residual stream entering the last decoder layer, which is what
Z-Image reads from Qwen3-4B.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

ADDITIONAL_CONFIG_KEY = "hidden_states"

# Layers a request gets when it asks for hidden states without naming any: the
# final post-norm state. The one place this default is written.
DEFAULT_LAYERS: tuple[int, ...] = (-1,)

# ``hidden_states_positions`` values. "last": the final token of prompt +
# output; "all": every position; "prompt": every prompt position.
POSITIONS: tuple[str, ...] = ("last", "all", "prompt")
# Positions served by a post-sampling HIDDEN_STATES_EXTRACT prefill. "prompt" is
# captured during the request's own prefill instead: no extract, one pass.
EXTRACT_POSITIONS: tuple[str, ...] = ("last", "all")

ENABLE_HINT = (
    "start the engine with enable_hidden_states=True (LLM / EngineArgs) "
    "or `vllm serve MODEL --enable-hidden-states`"
)


def additional_config_entry(layers: str | list[int] | None) -> dict[str, Any]:
    """The ``additional_config["hidden_states"]`` entry EngineArgs folds in.

    Args:
        layers: ``EngineArgs.hidden_states_layers`` as given (a list, or the
            ``--hidden-states-layers`` string); None = every layer ``0..L``.
    """
    parsed = parse_layers_arg(layers)
    return {"layers": parsed}


def parse_layers_arg(value: str | list[int] | None) -> list[int] | None:
    """Parse ``--hidden-states-layers`` (``"-1,-2,16"``, ``"all"``, or a list)."""
    if value is None:
        return None
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
    """Capturable layers of one engine.

    Attributes:
        num_layers: ``L``, the model's ``num_hidden_layers``.
        layers: capturable absolute indices in ``0..L``, sorted, distinct.
        given: the capturable set as configured (``None`` = every layer), kept
            only to phrase error messages the way the operator wrote them.
    """

    num_layers: int
    layers: tuple[int, ...]
    given: tuple[int, ...] | None = None

    @classmethod
    def from_vllm_config(cls, vllm_config: "VllmConfig") -> "HiddenStatesConfig | None":
        """The engine's config, or None when hidden states are not enabled."""
        extra = vllm_config.additional_config or {}
        entry = extra.get(ADDITIONAL_CONFIG_KEY)
        if entry is None:
            return None
        num_layers = num_hidden_layers(vllm_config)
        given = entry.get("layers")
        if given is None:
            return cls(num_layers, tuple(range(num_layers + 1)), None)
        layers = sorted({_absolute(k, num_layers) for k in given})
        return cls(num_layers, tuple(layers), tuple(given))

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """Layers taken from the model's aux hidden-state outputs (``k < L``).

        Layer ``L`` is the model's own (post-norm) output and needs no aux slot.
        """
        return tuple(k for k in self.layers if k < self.num_layers)

    def describe_capturable(self) -> str:
        if self.given is None:
            return f"all ({-(self.num_layers + 1)}..{self.num_layers})"
        return ", ".join(str(k) for k in self.given)

    def resolve(self, layer: int) -> int:
        """Absolute index of a requested layer; ValueError naming what is allowed."""
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(
                f"hidden_states_layers entries must be integers, got {layer!r}"
            )
        n = self.num_layers
        if not -(n + 1) <= layer <= n:
            raise ValueError(
                f"layer {layer} is out of range for a {n}-layer model; valid "
                f"indices are {-(n + 1)}..{n} (0 = embeddings, {n} or -1 = final "
                f"post-norm state); capturable layers: {self.describe_capturable()}"
            )
        absolute = layer % (n + 1)
        if absolute not in self.layers:
            raise ValueError(
                f"layer {layer} is not capturable on this engine; capturable "
                f"layers: {self.describe_capturable()} (the set is fixed at "
                f"engine start by hidden_states_layers)"
            )
        return absolute


def _absolute(layer: int, num_layers: int) -> int:
    if not -(num_layers + 1) <= int(layer) <= num_layers:
        raise ValueError(
            f"hidden_states_layers entry {layer} is out of range for a "
            f"{num_layers}-layer model; valid indices are "
            f"{-(num_layers + 1)}..{num_layers}"
        )
    return int(layer) % (num_layers + 1)


def num_hidden_layers(vllm_config: "VllmConfig") -> int:
    text_config = vllm_config.model_config.hf_text_config
    return int(text_config.num_hidden_layers)


def validate_engine_config(vllm_config: "VllmConfig") -> None:
    """Refuse, at start-up, set-ups where returned states would be wrong.

    Called once from ``EngineArgs.create_engine_config`` in the front-end.
    """
    cfg = HiddenStatesConfig.from_vllm_config(vllm_config)
    if cfg is None:
        return
    problems = []
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        problems.append(
            "pipeline parallelism (pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size}) is not supported yet"
        )
    if parallel.data_parallel_size > 1:
        problems.append(
            "data parallelism (data_parallel_size="
            f"{parallel.data_parallel_size}) is not supported yet: the extract "
            "must reach the engine that served the request"
        )
    spec = vllm_config.speculative_config
    if spec is not None:
        problems.append(
            f"speculative decoding (method {spec.method!r}) is not supported yet"
        )
    if vllm_config.model_config.runner_type != "generate":
        problems.append(
            f"runner {vllm_config.model_config.runner_type!r}: hidden states "
            "need a generate model"
        )
    import vllm.envs as envs

    if envs.VLLM_USE_V2_MODEL_RUNNER:
        problems.append(
            "Model Runner V2 capture is not implemented yet; unset "
            "VLLM_USE_V2_MODEL_RUNNER (the V1 runner is chosen automatically)"
        )
    if problems:
        raise ValueError(
            "--enable-hidden-states cannot be used with this configuration: "
            + "; ".join(problems)
        )


LAYERS_FLAG = "--hidden-states-layers"


def join_layers_value(args: list[str]) -> list[str]:
    """``["--hidden-states-layers", "-1,-2,16"]`` -> ``["--hidden-states-layers=-1,-2,16"]``.

    argparse reads a value that starts with ``-`` and is not a plain negative
    number as an option, so the natural spelling would fail to parse.
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
    """``--enable-hidden-states`` and ``--hidden-states-layers`` for EngineArgs."""
    import sys

    if not getattr(parser, "_hidden_states_join", False):
        parse_known_args = parser.parse_known_args

        def parse_known_args_joined(args=None, namespace=None):
            args = sys.argv[1:] if args is None else list(args)
            return parse_known_args(join_layers_value(args), namespace)

        parser.parse_known_args = parse_known_args_joined
        parser._hidden_states_join = True
    group = parser.add_argument_group(
        title="Hidden states (vllm-hidden-states)",
        description="Per-request hidden states on chat/completions and "
        "POST /v1/hidden_states.",
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
        "post-norm state), e.g. '-1,-2,16'. Default: every layer. Each "
        "intermediate layer costs one max_num_batched_tokens x hidden_size "
        "activation buffer.",
    )
