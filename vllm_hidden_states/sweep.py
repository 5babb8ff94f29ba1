# SPDX-License-Identifier: Apache-2.0
"""A patching sweep in one call: the grid, its rules, its metric, its answer.

One home for what POST /v1/patch_sweep (:mod:`.server.patch_sweep_route`)
and the Python helper :func:`patch_sweep` (an ``LLM``) share: the request's
prompts, metric, points, positions and heads checked against the engine
(:func:`plan`), the cells it expands to, each cell's ``patch`` intervention
and sampling parameters, the metric read from a cell's output, and the
answer (:class:`SweepResult`). Both surfaces run the same plan: one clean
request captures every point's rows at every prompt position (and the clean
metric), then every cell runs the corrupted prompt with the clean row
patched in at its point and position, all cells submitted together so the
scheduler batches them, and the corrupted baseline beside them.

The metric is read exactly and cheaply with vLLM's ``logprob_token_ids``
(``SamplingParams``): the sampler gathers the raw log-probabilities (the
model's own ``log_softmax``, before any sampling processors) of exactly the
metric's tokens at the next-token position of the prompt, whatever their
rank: no full-vocabulary logprobs, no top-k that may miss them, no second
request per token. The contract: docs/patching.md, "A sweep in one call".
Imports nothing from vLLM at module level.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_hidden_states.points import is_pattern_address, is_z_address, parse_point, point_id
from vllm_hidden_states.steering_config import STEERABLE_KINDS

# The most cells one sweep may run, by default (POST /v1/patch_sweep:
# --patch-sweep-max-cells; the helper: max_cells).
DEFAULT_MAX_CELLS = 4096
MAX_CELLS_FLAG = "--patch-sweep-max-cells"


METRIC_FORMS = (
    '{"logit_diff": [answer, wrong]} (log p(answer) - log p(wrong)) or {"logprob": token} '
    "(log p(token)), each token a token id or a string that encodes to exactly one token"
)


class SweepError(ValueError):
    """A sweep the engine cannot run: what was wrong, what is allowed, and the
    request field at fault (``param``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Metric:
    """``logit_diff``: ``log p(tokens[0]) - log p(tokens[1])``; ``logprob``:
    ``log p(tokens[0])``; of the next token after the prompt."""

    kind: str
    tokens: tuple[int, ...]

    def value(self, logprobs: Mapping[int, Any]) -> float:
        """The metric from ``{token id: Logprob or float}`` (a cell's first
        output position); KeyError when a token is missing."""

        def lp(token: int) -> float:
            x = logprobs[token]
            return float(getattr(x, "logprob", x))

        if self.kind == "logit_diff":
            return lp(self.tokens[0]) - lp(self.tokens[1])
        return lp(self.tokens[0])

    def as_json(self) -> dict[str, Any]:
        return {self.kind: list(self.tokens) if self.kind == "logit_diff" else self.tokens[0]}


@dataclass(frozen=True)
class Cell:
    """One patched run: ``row`` of the answer (a point, or a point's head),
    and the prompt position patched."""

    row: int
    point: str
    position: int
    head: int | None = None


@dataclass(frozen=True)
class SweepPlan:
    """A checked sweep: what :func:`plan` returns and both surfaces run.

    ``rows``: the answer's rows in order, ``(point, head)``, head None for a
    plain point; the plain points' rows first (in the order given), then
    each head point's heads."""

    clean_ids: list[int]
    corrupted_ids: list[int]
    metric: Metric
    points: list[str]  # plain points (grid rows)
    head_points: list[str]  # attn_z points (head_grid rows)
    heads: list[int]  # the heads axis (empty without head points)
    positions: list[int]
    rows: list[tuple[str, int | None]] = field(default_factory=list)
    num_heads: int = 0  # the model's attention heads (a head's columns of attn_z)

    @property
    def capture_points(self) -> list[str]:
        return [*self.points, *self.head_points]

    @property
    def num_cells(self) -> int:
        return len(self.rows) * len(self.positions)

    def cells(self) -> list[Cell]:
        return [
            Cell(r, point, p, head)
            for r, (point, head) in enumerate(self.rows)
            for p in self.positions
        ]


@dataclass
class SweepResult:
    """A sweep's answer. ``grid[i, j]``: the metric of the corrupted prompt
    with ``points[i]`` at ``positions[j]`` patched from the clean run;
    ``head_grid[i, h, j]``: the same for ``head_points[i]``'s head
    ``heads[h]`` (None without head points); ``clean`` and ``corrupted``:
    the unpatched runs' metric."""

    points: list[str]
    positions: list[int]
    grid: np.ndarray  # float64 [points, positions]
    clean: float
    corrupted: float
    metric: Metric
    num_tokens: int
    head_points: list[str] = field(default_factory=list)
    heads: list[int] = field(default_factory=list)
    head_grid: np.ndarray | None = None

    @property
    def recovery(self) -> np.ndarray:
        """``(grid - corrupted) / (clean - corrupted)``."""
        return (self.grid - self.corrupted) / (self.clean - self.corrupted)

    def as_json(self) -> dict[str, Any]:
        """The answer of POST /v1/patch_sweep (less ``model``)."""
        out: dict[str, Any] = {
            "object": "patch_sweep",
            "metric": self.metric.as_json(),
            "num_tokens": self.num_tokens,
            "positions": self.positions,
            "points": self.points,
            "grid": self.grid.tolist(),
            "clean": self.clean,
            "corrupted": self.corrupted,
        }
        if self.head_points:
            assert self.head_grid is not None
            out.update(
                head_points=self.head_points, heads=self.heads, head_grid=self.head_grid.tolist()
            )
        return out


# -- checks -------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def prompt_ids(
    value: Any, param: str, encode: Callable[[str], list[int]], vocab_size: int
) -> list[int]:
    """A prompt as token ids: a string (``encode``d) or a non-empty list of
    token ids in ``0..vocab_size-1``."""
    if isinstance(value, str):
        ids = list(encode(value))
        if not ids:
            raise SweepError(f"'{param}' encodes to no tokens; give non-empty text", param)
        return ids
    if isinstance(value, (list, tuple)) and value and all(_is_int(x) for x in value):
        bad = [int(x) for x in value if not 0 <= int(x) < vocab_size]
        if bad:
            raise SweepError(
                f"'{param}' has token ids {bad[:8]} outside this model's vocabulary "
                f"(0..{vocab_size - 1})",
                param,
            )
        return [int(x) for x in value]
    raise SweepError(f"'{param}' must be a string or a non-empty list of token ids", param)


def check_lengths(clean: list[int], corrupted: list[int], max_model_len: int) -> None:
    if len(clean) != len(corrupted):
        raise SweepError(
            f"'clean' has {len(clean)} tokens and 'corrupted' {len(corrupted)}; a patching "
            "sweep needs prompts of the same token length (each clean row is patched at "
            "its own position of the corrupted prompt)",
            "corrupted",
        )
    if len(clean) > max_model_len - 1:
        raise SweepError(
            f"the prompts have {len(clean)} tokens; this model (max_model_len="
            f"{max_model_len}) takes at most {max_model_len - 1} before the next token",
            "clean",
        )


def parse_metric(value: Any, encode: Callable[[str], list[int]], vocab_size: int) -> Metric:
    """``{"logit_diff": [a, b]}`` or ``{"logprob": t}``; tokens as ids or
    strings that encode (without special tokens) to exactly one token."""
    if not isinstance(value, dict) or len(value) != 1:
        raise SweepError(f"'metric' must be one of {METRIC_FORMS}", "metric")
    (kind, arg), = value.items()  # fmt: skip
    if kind == "logit_diff":
        if not isinstance(arg, (list, tuple)) or len(arg) != 2:
            raise SweepError(
                f"'metric.logit_diff' must be two tokens [answer, wrong]; {METRIC_FORMS}",
                "metric",
            )
        tokens = tuple(_token(x, f"metric.logit_diff[{i}]", encode, vocab_size)
                       for i, x in enumerate(arg))  # fmt: skip
        if tokens[0] == tokens[1]:
            raise SweepError(
                f"'metric.logit_diff' names token {tokens[0]} twice; give two different tokens",
                "metric",
            )
        return Metric(kind, tokens)
    if kind == "logprob":
        return Metric(kind, (_token(arg, "metric.logprob", encode, vocab_size),))
    raise SweepError(f"'metric' has unknown kind {kind!r}; {METRIC_FORMS}", "metric")


def _token(value: Any, where: str, encode: Callable[[str], list[int]], vocab_size: int) -> int:
    if _is_int(value):
        if not 0 <= int(value) < vocab_size:
            raise SweepError(
                f"'{where}': token id {int(value)} is outside this model's vocabulary "
                f"(0..{vocab_size - 1})",
                "metric",
            )
        return int(value)
    if isinstance(value, str):
        ids = list(encode(value))
        if len(ids) != 1:
            raise SweepError(
                f"'{where}': {value!r} encodes to {len(ids)} tokens {ids[:8]}; a metric "
                "token is a token id or a string of exactly one token (its first token "
                "is not taken silently)",
                "metric",
            )
        return ids[0]
    raise SweepError(f"'{where}' must be a token id or a one-token string", "metric")


def parse_positions(value: Any, num_tokens: int) -> list[int]:
    """``"all"`` (every prompt position) or a non-empty list of distinct
    positions in ``0..num_tokens-1``."""
    return _indices(
        value,
        num_tokens,
        "positions",
        "'positions' must be 'all' or a non-empty list of prompt positions "
        f"(integers in 0..{num_tokens - 1})",
        f"the prompts have {num_tokens} tokens, positions 0..{num_tokens - 1}",
        "position",
    )


def parse_heads(value: Any, num_heads: int) -> list[int]:
    """``"all"`` (default) or a non-empty list of distinct heads in
    ``0..num_heads-1``."""
    return _indices(
        value,
        num_heads,
        "heads",
        f"'heads' must be 'all' or a non-empty list of heads (0..{num_heads - 1})",
        f"this model has {num_heads} attention heads (0..{num_heads - 1})",
        "head",
    )


def _indices(value: Any, n: int, field: str, form: str, allowed: str, noun: str) -> list[int]:
    """``"all"`` / None (``0..n-1``) or a non-empty list of distinct ints in
    ``0..n-1``; SweepError on ``field`` saying ``form`` or ``allowed``."""
    if value is None or value == "all":
        return list(range(n))
    if not isinstance(value, (list, tuple)) or not value or not all(_is_int(x) for x in value):
        raise SweepError(form, field)
    out = [int(x) for x in value]
    bad = [x for x in out if not 0 <= x < n]
    if bad:
        raise SweepError(f"'{field}' {bad[:8]} out of range: {allowed}", field)
    if len(set(out)) != len(out):
        raise SweepError(f"'{field}' names a {noun} twice; name each once", field)
    return out


def check_points(points: Any, hs_cfg: Any, steer_cfg: Any) -> tuple[list[str], list[str]]:
    """``(plain points, head points)`` of ``points`` (addresses, in order):
    each steerable (a ``patch`` target) and capturable (its clean rows are
    read) on this engine, named once."""
    if not isinstance(points, (list, tuple)) or not points:
        raise SweepError(
            "'points' must be a non-empty list of point addresses such as "
            "['resid_pre.0', 'attn_out.3'] (the rows of the grid)",
            "points",
        )
    if steer_cfg is None or hs_cfg is None:
        raise SweepError(
            "a patching sweep needs steering on this engine (start it with --enable-steering "
            "and --steering-points naming the points to patch)",
            "points",
        )
    if steer_cfg.max_patch_rows == 0:
        raise SweepError("patching is off on this engine (--max-patch-rows 0)", "points")
    n = steer_cfg.num_layers
    plain: list[str] = []
    heads: list[str] = []
    for i, address in enumerate(points):
        where = f"points[{i}]"
        try:
            kind, layer = parse_point(address, n)
        except ValueError as e:
            raise SweepError(f"'{where}': {e}", "points") from None
        # A head point (attn_z.L) sweeps a heads axis: its cell (point, head
        # h, position p) patches the clean run's head h at p only.
        (heads if is_z_address(address) else plain).append(address)
        if not is_z_address(address) and (
            kind not in STEERABLE_KINDS or is_pattern_address(address)
        ):
            raise SweepError(
                f"'{where}' {address!r}: {kind} cannot be patched; patchable kinds: "
                f"{list(STEERABLE_KINDS)}",
                "points",
            )
        if point_id(kind, layer, n) not in steer_cfg.ids:  # type: ignore[arg-type]
            raise SweepError(
                f"'{where}' {address!r} cannot be patched on this engine; steerable points: "
                f"{steer_cfg.describe_points()} (fixed at start by --steering-points)",
                "points",
            )
    try:
        hs_cfg.resolve_points(list(points))
    except ValueError as e:
        raise SweepError(
            f"'points': {e} (a sweep captures each point's clean rows)", "points"
        ) from None
    return plain, heads


@dataclass(frozen=True)
class SweepEngine:
    """What :func:`plan` reads of the engine that runs the sweep.

    Attributes:
        hs_cfg: its HiddenStatesConfig (the points it captures).
        steer_cfg: its SteeringConfig (the points it writes).
        vocab_size: token ids are below it.
        max_model_len: the prompts' length bound, tokens.
        num_heads: attention heads per layer (the heads axis).
        encode: a prompt's text to ids, as a completion would tokenize it.
        encode_token: a metric token's text to ids (no special tokens).
        max_cells: the cell limit.
        max_cells_hint: how the limit is set, for the error message.
    """

    hs_cfg: Any
    steer_cfg: Any
    vocab_size: int
    max_model_len: int
    num_heads: int
    encode: Callable[[str], list[int]]
    encode_token: Callable[[str], list[int]]
    max_cells: int
    max_cells_hint: str = MAX_CELLS_FLAG


def plan(
    *,
    clean: Any,
    corrupted: Any,
    points: Any,
    metric: Any,
    positions: Any = "all",
    heads: Any = None,
    engine: SweepEngine,
) -> SweepPlan:
    """The sweep checked against ``engine``, before any engine work; a
    :class:`SweepError` naming the field and what is allowed."""
    encode, vocab_size, num_heads = engine.encode, engine.vocab_size, engine.num_heads
    max_cells, max_cells_hint = engine.max_cells, engine.max_cells_hint
    clean_ids = prompt_ids(clean, "clean", encode, vocab_size)
    corrupted_ids = prompt_ids(corrupted, "corrupted", encode, vocab_size)
    check_lengths(clean_ids, corrupted_ids, engine.max_model_len)
    the_metric = parse_metric(metric, engine.encode_token, vocab_size)
    plain, head_points = check_points(points, engine.hs_cfg, engine.steer_cfg)
    the_positions = parse_positions(positions, len(clean_ids))
    if heads is not None and not head_points:
        raise SweepError(
            "'heads' applies to head points (attn_z.L) only; this sweep has none", "heads"
        )
    the_heads = parse_heads(heads, num_heads) if head_points else []
    rows: list[tuple[str, int | None]] = [(p, None) for p in plain]
    rows += [(p, h) for p in head_points for h in the_heads]
    out = SweepPlan(
        clean_ids,
        corrupted_ids,
        the_metric,
        plain,
        head_points,
        the_heads,
        the_positions,
        rows,
        num_heads,
    )
    if out.num_cells > max_cells:
        raise SweepError(
            f"this sweep has {out.num_cells} cells ({len(rows)} rows x "
            f"{len(the_positions)} positions), over the limit of {max_cells} per sweep "
            f"({max_cells_hint}); sweep fewer points, heads or positions, or split it",
            "points",
        )
    return out


# -- the runs -----------------------------------------------------------------


def capture_params(sweep: SweepPlan) -> dict[str, Any]:
    """``SamplingParams`` keywords of the clean run: every point's rows at
    every prompt position, captured in its own prefill, and the metric."""
    return dict(
        max_tokens=1,
        temperature=0.0,
        detokenize=False,
        logprob_token_ids=list(sweep.metric.tokens),
        return_hidden_states=True,
        hidden_states_points=sweep.capture_points,
        hidden_states_positions="prompt",
    )


def metric_params(sweep: SweepPlan, steering: list[dict] | None = None) -> dict[str, Any]:
    """``SamplingParams`` keywords of a corrupted run (a cell: ``steering``
    its patch): one token, the metric's tokens' raw logprobs."""
    out: dict[str, Any] = dict(
        max_tokens=1,
        temperature=0.0,
        detokenize=False,
        logprob_token_ids=list(sweep.metric.tokens),
    )
    if steering is not None:
        out["steering"] = steering
    return out


def clean_rows(sweep: SweepPlan, states: Mapping[Any, Any]) -> dict[str, np.ndarray]:
    """The clean run's rows per point, float32 ``[positions, width]``
    (a head point's ``[positions, heads, head_dim]``)."""
    out = {}
    for point in sweep.capture_points:
        rows = states[point]
        if hasattr(rows, "detach"):
            rows = rows.detach().cpu().float().numpy()
        out[point] = np.ascontiguousarray(rows, dtype=np.float32)
    return out


def cell_steering(sweep: SweepPlan, cell: Cell, rows: Mapping[str, np.ndarray]) -> list[dict]:
    """A cell's one intervention: the clean row at its point and position
    (of its head, for a head point) patched into the corrupted run."""
    p = cell.position
    if cell.head is None:
        return [{"op": "patch", "point": cell.point, "rows": rows[cell.point][p : p + 1],
                 "positions": {"start": p, "end": p + 1}}]  # fmt: skip
    # A head point: its head's row, [1, 1, head_dim].
    h = cell.head
    row = rows[cell.point][p : p + 1, h : h + 1]
    return [{"op": "patch", "point": cell.point, "heads": [h], "rows": row,
             "positions": {"start": p, "end": p + 1}}]  # fmt: skip


def read_metric(sweep: SweepPlan, output: Any, what: str) -> float:
    """The metric of a finished run (a vLLM ``RequestOutput``)."""
    logprobs = output.outputs[0].logprobs
    if not logprobs:
        raise RuntimeError(f"{what}: the engine returned no logprobs")
    try:
        return sweep.metric.value(logprobs[0])
    except KeyError as e:
        raise RuntimeError(f"{what}: the engine returned no logprob of token {e}") from None


def assemble(
    sweep: SweepPlan, values: Sequence[float], clean: float, corrupted: float
) -> SweepResult:
    """The answer from every cell's metric (in :meth:`SweepPlan.cells` order)."""
    table = np.asarray(values, dtype=np.float64).reshape(len(sweep.rows), len(sweep.positions))
    k = len(sweep.points)
    head_grid = None
    if sweep.head_points:
        head_grid = table[k:].reshape(len(sweep.head_points), len(sweep.heads), -1)
    return SweepResult(
        points=list(sweep.points),
        positions=list(sweep.positions),
        grid=table[:k],
        clean=float(clean),
        corrupted=float(corrupted),
        metric=sweep.metric,
        num_tokens=len(sweep.clean_ids),
        head_points=list(sweep.head_points),
        heads=list(sweep.heads),
        head_grid=head_grid,
    )


# -- the Python helper --------------------------------------------------------


def engine_facts(vllm_config: Any) -> dict[str, Any]:
    """What :func:`plan` reads of an engine: its configs, vocabulary,
    context and heads."""
    from vllm_hidden_states.hidden_states_config import HiddenStatesConfig, built_once
    from vllm_hidden_states.steering_config import SteeringConfig

    model_config = vllm_config.model_config
    return dict(
        hs_cfg=built_once(HiddenStatesConfig, vllm_config),
        steer_cfg=built_once(SteeringConfig, vllm_config),
        vocab_size=int(model_config.get_vocab_size()),
        max_model_len=int(model_config.max_model_len),
        num_heads=int(model_config.hf_text_config.num_attention_heads),
    )


def patch_sweep(
    llm: Any,
    *,
    clean: str | list[int],
    corrupted: str | list[int],
    points: list[str],
    metric: dict[str, Any],
    positions: str | list[int] = "all",
    heads: str | list[int] | None = None,
    max_cells: int = DEFAULT_MAX_CELLS,
    add_special_tokens: bool = True,
) -> SweepResult:
    """POST /v1/patch_sweep's contract on an ``LLM`` (started with
    ``enable_steering=True`` and ``steering_points`` covering ``points``,
    whose capture points cover them too): the metric grid of the corrupted
    prompt with each point's clean row patched in at each position.

    Every cell is one request of one ``llm.generate`` call (the engine
    batches them). ValueError (:class:`SweepError`, with ``param``) for a
    sweep the engine cannot run, before any engine work.
    """
    from vllm import SamplingParams

    tokenizer = llm.get_tokenizer()
    sweep = plan(
        clean=clean,
        corrupted=corrupted,
        points=points,
        metric=metric,
        positions=positions,
        heads=heads,
        engine=SweepEngine(
            **engine_facts(llm.llm_engine.vllm_config),
            encode=lambda text: tokenizer.encode(text, add_special_tokens=add_special_tokens),
            encode_token=lambda text: tokenizer.encode(text, add_special_tokens=False),
            max_cells=max_cells,
            max_cells_hint="max_cells",
        ),
    )
    (captured,) = llm.generate(
        [{"prompt_token_ids": sweep.clean_ids}],
        SamplingParams(**capture_params(sweep)),
        use_tqdm=False,
    )
    rows = clean_rows(sweep, captured.outputs[0].hidden_states)
    cells = sweep.cells()
    params = [SamplingParams(**metric_params(sweep))]
    params += [SamplingParams(**metric_params(sweep, cell_steering(sweep, c, rows))) for c in cells]
    prompt = {"prompt_token_ids": sweep.corrupted_ids}
    outputs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    corrupted_value = read_metric(sweep, outputs[0], "the corrupted run")
    values = [read_metric(sweep, out, f"cell {i}") for i, out in enumerate(outputs[1:])]
    return assemble(sweep, values, read_metric(sweep, captured, "the clean run"), corrupted_value)
