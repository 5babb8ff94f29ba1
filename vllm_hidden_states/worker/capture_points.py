# SPDX-License-Identifier: Apache-2.0
"""Capture points inside the model: selected rows of the residual stream,
written into persistent buffers by one custom op, under torch.compile and
CUDA-graph replay alike.

At model load (:meth:`CapturePoints.install`), the decoder-layer list is found
generically (:func:`find_decoder_layers`: no per-architecture code) and each
decoder layer ``k`` whose layer index is capturable gets a capture point: a
forward pre-hook (PyTorch's ``register_forward_pre_hook``, traced by Dynamo
into the compiled graph like the forward itself) that calls
``torch.ops.vllm.hidden_states_capture(hidden, residual, rows, counts, index,
out)`` before the layer's own forward. Nothing of the layer is replaced:
parameter names, classes and forwards stay vLLM's, so weight loading, LoRA and
reloads see the same model.

The op writes ``(hidden + residual)[rows[:n]]`` into ``out[:n]``, ``n =
counts[index]`` (``index``: the point's position among the capture points): the
residual stream *entering* layer ``k``, which is HF's
``output_hidden_states[k]`` (``k = 0``: the embedding output, Gemma's
embedding scaling included; layers with vLLM's fused residual pass
``residual`` separately, others fold it into ``hidden``). Layer ``L``, the
final post-norm state, is the model's own output: the runner gathers it.

``rows`` (int64 ``[max_rows]``) and ``counts`` (int64 ``[num_points]``, one
count per capture point, so that a step captures only the layers some request
asked) are shared by all capture points; ``out`` is one ``[max_rows,
hidden_size]`` buffer per captured layer, in the model dtype. All are
registered as non-persistent module buffers, so Dynamo lifts them as graph
inputs rather than constants; their storage never changes, so compiled graphs
and captured CUDA graphs stay valid (``index`` is a constant of the graph). The
runner fills ``rows``/``counts`` before a forward that captures and zeroes them
after it (:meth:`CapturePoints.arm` / :meth:`CapturePoints.disarm`).

Cost of a forward where nobody asked (count 0): on CPU the op reads the
count and returns (one call per capture point); on other devices, where the
count cannot be read without a host sync (and not at all inside CUDA-graph
capture), the op gathers the first ``min(max_rows, tokens)`` entries of the
persistent index, whose unused entries point at row 0: ``min(max_rows,
tokens) x hidden_size`` elements copied per capture point per forward (a
batch-b decode step: b rows). Invariant: entries of ``rows`` past the armed
count are 0 (:meth:`CapturePoints.arm` writes them so, :meth:`CapturePoints.disarm`
resets the whole index), so that gather never reads past a smaller batch.
"""

import inspect
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import torch
from torch import nn

from vllm.logger import init_logger

logger = init_logger(__name__)

OP_NAME = "hidden_states_capture"

# Names a decoder layer's forward uses for its input stream, most common
# first; failing these, the first positional argument that is not a position.
_STREAM_ARG_NAMES = ("hidden_states", "hidden_state", "hidden", "x")
_NOT_STREAM_ARGS = ("positions", "position_ids", "position_embeddings")


def count_readable_on_host(device: torch.device) -> bool:
    """Whether the op may read ``count`` on the host: on CPU it is a plain
    memory read; elsewhere it would be a host sync (and is impossible inside
    CUDA-graph capture), so the op gathers every entry of ``rows`` instead."""
    return device.type == "cpu"


def gather_rows(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    index: torch.Tensor,
    target: torch.Tensor,
) -> None:
    """``target = (hidden + residual)[index]``: ``hidden``/``residual``
    ``[tokens, hidden_size]``, ``index`` int64 ``[n]`` (every entry
    ``< tokens``), ``target`` ``[n, hidden_size]`` in the model dtype."""
    if residual is None:
        torch.index_select(hidden, 0, index, out=target)
    else:
        residual = residual.reshape(-1, residual.shape[-1])
        torch.add(hidden.index_select(0, index), residual.index_select(0, index), out=target)


def _capture_rows(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    rows: torch.Tensor,
    counts: torch.Tensor,
    index: int,
    out: torch.Tensor,
) -> None:
    """``out[:n] = (hidden + residual)[rows[:n]]`` with ``n = counts[index]``
    (see module doc)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    if count_readable_on_host(hidden.device):
        n = int(counts[index])  # free on CPU; the op is opaque to Dynamo
        if n:
            gather_rows(hidden, residual, rows[:n], out[:n])
        return
    # No host sync: gather the first min(max_rows, tokens) entries of the
    # persistent index (the rows armed for this forward are among them: at
    # most one per token); the runner reads out[:count]. Entries past the
    # count are 0 (CapturePoints keeps them so), a row every forward has.
    # ``tokens`` is static per CUDA graph, so a decode step of batch b
    # gathers b rows, not max_rows.
    n = min(rows.shape[0], hidden.shape[0])
    gather_rows(hidden, residual, rows[:n], out[:n])


def _capture_rows_fake(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    rows: torch.Tensor,
    counts: torch.Tensor,
    index: int,
    out: torch.Tensor,
) -> None:
    return None


def register_op() -> None:
    """Register ``torch.ops.vllm.hidden_states_capture`` once per process."""
    if hasattr(torch.ops.vllm, OP_NAME):
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op(
        op_name=OP_NAME,
        op_func=_capture_rows,
        mutates_args=["out"],
        fake_impl=_capture_rows_fake,
    )


def _is_pp_placeholder(layer: nn.Module) -> bool:
    from vllm.model_executor.models.utils import PPMissingLayer

    return isinstance(layer, PPMissingLayer)


def find_decoder_layers(model: nn.Module, num_layers: int) -> tuple[str, nn.ModuleList]:
    """The model's decoder-layer list: ``(qualified name, ModuleList)``.

    Rule: of the ``nn.ModuleList`` s whose children are modules (not lists)
    and whose length is ``num_layers`` (the config's ``num_hidden_layers``;
    pipeline-parallel placeholders keep the length), the shallowest. Raises
    ``LookupError`` when there is none.
    """
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        and len(module) == num_layers
        and not any(isinstance(c, (nn.ModuleList, nn.ModuleDict)) for c in module)
    ]
    if not candidates:
        raise LookupError(f"no list of {num_layers} decoder layers in {type(model).__name__}")
    return min(candidates, key=lambda c: c[0].count("."))


class StreamArgs:
    """Where a decoder layer's forward takes the residual stream: the
    ``hidden`` argument and, with vLLM's fused residual, ``residual``."""

    def __init__(self, forward: Callable[..., Any]):
        params = [p for p in inspect.signature(forward).parameters.values() if p.name != "self"]
        names = [p.name for p in params]
        positional = [
            p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        hidden = next((n for n in _STREAM_ARG_NAMES if n in names), None)
        if hidden is None:
            hidden = next((n for n in positional if n not in _NOT_STREAM_ARGS), None)
        if hidden is None:
            raise LookupError(f"no hidden-states argument in forward{tuple(names)}")
        self.hidden = hidden
        self.hidden_pos = positional.index(hidden) if hidden in positional else None
        self.residual = "residual" if "residual" in names else None
        self.residual_pos = positional.index("residual") if "residual" in positional else None

    def read(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.hidden_pos is not None and len(args) > self.hidden_pos:
            hidden = args[self.hidden_pos]
        else:
            hidden = kwargs[self.hidden]
        residual = None
        if self.residual is not None:
            if self.residual_pos is not None and len(args) > self.residual_pos:
                residual = args[self.residual_pos]
            else:
                residual = kwargs.get(self.residual)
        return hidden, residual

    def __repr__(self) -> str:
        return f"StreamArgs(hidden={self.hidden!r}, residual={self.residual!r})"


_stream_args: dict[type[nn.Module], StreamArgs] = {}


def stream_args_of(cls: type[nn.Module]) -> StreamArgs:
    """Where ``cls.forward`` takes the residual stream (read once per class)."""
    if cls not in _stream_args:
        _stream_args[cls] = StreamArgs(cls.forward)
    return _stream_args[cls]


def _capture_hook(stream: StreamArgs) -> Callable[..., None]:
    """A forward pre-hook (PyTorch's own extension point; dynamo traces it into
    the compiled graph) that captures the layer's input residual stream."""

    def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden, residual = stream.read(args, kwargs)
        torch.ops.vllm.hidden_states_capture(
            hidden, residual, module._hs_rows, module._hs_counts, module._hs_index, module._hs_out
        )

    return capture


def has_capture_points(model: nn.Module) -> bool:
    """Whether any module of ``model`` carries a capture point."""
    return any(hasattr(m, "_hs_out") for m in model.modules())


class CapturePoints:
    """The capture points of one model and their buffers.

    Attributes:
        layers: absolute layer indices ``k < L`` with a capture point, ascending
            (with pipeline parallelism: this stage's only).
        start_layer, end_layer: the decoder layers this stage owns,
            ``[start_layer, end_layer)``.
        buffers: ``{k: [max_rows, hidden_size]}`` in the model dtype.
        max_rows: rows one forward can capture.
        count: rows armed for the next forward (the points of the layers
            asked get it in the device ``counts`` tensor, the others 0).
    """

    def __init__(
        self,
        model: nn.Module,
        layers: list[int],
        num_layers: int,
        hidden_size: int,
        max_rows: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        register_op()
        self.layers_name, decoder_layers = find_decoder_layers(model, num_layers)
        # The decoder layers this pipeline stage owns, [start_layer, end_layer)
        # (all of them without pipeline parallelism); the others are
        # placeholders and get no capture point.
        owned = [i for i, m in enumerate(decoder_layers) if not _is_pp_placeholder(m)]
        self.start_layer, self.end_layer = (owned[0], owned[-1] + 1) if owned else (0, 0)
        self.max_rows = max_rows
        self.rows = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.rows_host = torch.zeros(max_rows, dtype=torch.int64)
        self.count = 0
        self._index: dict[int, int] = {}  # layer -> its position in counts
        self.buffers: dict[int, torch.Tensor] = {}
        # Another pipeline stage owns the placeholders' layers.
        owned_points = [k for k in layers if not _is_pp_placeholder(decoder_layers[k])]
        self.counts = torch.zeros(max(len(owned_points), 1), dtype=torch.int64, device=device)
        self.counts_host = torch.zeros_like(self.counts, device="cpu")
        for index, k in enumerate(owned_points):
            layer = decoder_layers[k]
            out = torch.zeros(max_rows, hidden_size, dtype=dtype, device=device)
            stream = stream_args_of(type(layer))
            layer._hs_index = index
            layer.register_buffer("_hs_rows", self.rows, persistent=False)
            layer.register_buffer("_hs_counts", self.counts, persistent=False)
            layer.register_buffer("_hs_out", out, persistent=False)
            layer.register_forward_pre_hook(_capture_hook(stream), with_kwargs=True)
            self.buffers[k] = out
            self._index[k] = index
        self.layers = sorted(self.buffers)
        if self.layers:
            logger.info(
                "Hidden states: capture points before %d of %d layers of %s.%s (%s), %d rows each",
                len(self.layers),
                num_layers,
                type(model).__name__,
                self.layers_name,
                stream_args_of(type(decoder_layers[self.layers[0]])),
                max_rows,
            )

    def arm(self, rows: np.ndarray, layers: "Collection[int] | None" = None) -> None:
        """Capture batch rows ``rows`` (int64, at most ``max_rows``) in the
        next forward, at the capture points of ``layers`` (absolute indices;
        None: all of them)."""
        n = len(rows)
        if n > self.max_rows:
            raise ValueError(f"{n} rows asked in one step; the buffers hold {self.max_rows}")
        self.rows_host[:n] = torch.from_numpy(rows)
        self.rows_host[n:] = 0
        self.rows.copy_(self.rows_host, non_blocking=True)
        if layers is None:
            self.counts_host.fill_(n)
        else:
            self.counts_host.zero_()
            for k in layers:
                if k in self._index:
                    self.counts_host[self._index[k]] = n
        self.counts.copy_(self.counts_host, non_blocking=True)
        self.count = n

    def disarm(self) -> None:
        """No capture in later forwards (profile, dummy and warm-up runs included).

        The index goes back to all zeros too: where the op cannot read the
        count (off CPU) it gathers every entry, and an index left over from a
        larger batch would read past a smaller one's rows (a device-side
        assert that kills the engine)."""
        if self.count:
            self.rows.zero_()
            self.counts.zero_()
            self.count = 0

    def read(self, k: int) -> torch.Tensor:
        """``[count, hidden_size]``: layer ``k``'s rows of the last forward (a view)."""
        return self.buffers[k][: self.count]
