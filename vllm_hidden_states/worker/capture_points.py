# SPDX-License-Identifier: Apache-2.0
"""CapturePoints: the capture points of one loaded model and their buffers.

At model load each capturable id gets a forward hook at its tap
(``taps.py``) that calls the capture op (``capture_op.py``) with persistent
buffers (``rows``, ``counts``, one ``out`` per id), so compiled graphs and
CUDA graphs stay valid; the runner arms them before a forward that captures
and disarms them after it. Nothing of the model is replaced. The story is
docs/architecture.md, "The capture op".
"""

from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import torch
from torch import nn
from torch._dynamo import mark_dynamic

from vllm.logger import init_logger
from vllm_hidden_states.points import NEURON_KIND, PATTERN_KIND, QKV_KINDS, Z_KIND, point_of_id
from vllm_hidden_states.worker.capture_op import (
    capture,
    count_readable_on_host,
    register_op,
    write_route,
)
from vllm_hidden_states.worker.taps import (
    QKV_ARGS,
    Reader,
    Tap,
    arg_reader,
    attention_module,
    find_decoder_layers,
    first_arg,
    flat_arg_reader,
    heads_in_hf_order,
    heads_out_module,
    is_pp_placeholder,
    neuron_module,
    point_tap,
    qk_halves_head_size,
    qkv_module,
    qkv_width,
    stream_tap,
)

logger = init_logger(__name__)

# The least length of CapturePoints.armed (see there): Dynamo specializes
# sizes 0 and 1.
ARMED_FLOOR = 2


def _hook(
    taps: list[tuple[Reader, str, int, float]], post: bool, host_counts: np.ndarray | None
) -> Callable[..., None]:
    """A forward hook (PyTorch's own extension point; Dynamo traces it into the
    compiled graph like the forward) that captures the points read at one
    module: ``(read, buffer name, index in counts, scale)`` each.
    ``host_counts``: on CPU, the counts as a numpy view, so that an eager
    forward where nobody asked returns after one memory read per point,
    before reading arguments or buffers (about 1.5 us of Python per point)."""
    indices = [index for _, _, index, _ in taps]

    def capture_points(module: nn.Module, args: tuple, kwargs: dict, output: Any = None) -> None:
        # is_compiling() first: Dynamo must not see the numpy view at all.
        if not torch.compiler.is_compiling() and host_counts is not None:
            for index in indices:
                if host_counts[index]:
                    break
            else:
                return
        for read, out_name, index, scale in taps:
            a, b = read(args, kwargs, output)
            if a.dim() != 2 and not (a.dim() == 3 and a.shape[0] == 1):
                # A last guard: a layer that takes several streams stacked
                # (Gemma 3n's AltUp) has no rows of tokens to copy; the front
                # end refuses such layers first (layers.NO_SINGLE_STREAM).
                # HF's layers (Transformers backend) take a batch of one.
                raise RuntimeError(
                    f"hidden states: {type(module).__name__} passes a {tuple(a.shape)} "
                    "tensor, not [tokens, hidden]; refusing to copy rows from it"
                )
            capture(
                a,
                b,
                module._hs_rows,
                module._hs_counts,
                index,
                getattr(module, out_name),
                scale,
                getattr(module, "_hs_armed", None),
            )

    if post:
        return capture_points

    def capture_points_pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        capture_points(module, args, kwargs)

    return capture_points_pre


def has_capture_points(model: nn.Module) -> bool:
    """Whether any module of ``model`` carries a capture point."""
    return any(hasattr(m, "_hs_rows") for m in model.modules())


class CapturePoints:
    """The capture points of one model and their buffers.

    Attributes:
        layers: capture ids with a capture point, in the config's order
            (:attr:`HiddenStatesConfig.inner_layers`; with pipeline
            parallelism: this stage's only): HF layers ``k < L`` and points
            past ``L``.
        start_layer, end_layer: the decoder layers this stage owns,
            ``[start_layer, end_layer)``.
        buffers: ``{id: [max_rows, hidden_size]}`` in the model dtype.
        max_rows: rows one forward can capture.
        count: rows armed for the next forward (the points of the ids asked
            get it in the device ``counts`` tensor, the others 0).
        armed: on CPU, int64 ``[max(count, ARMED_FLOOR)]`` on the memory of
            ``rows``: the index the compiled graph gathers, its length a
            dynamic size of the graph (None off CPU, where CUDA graphs fix
            every size).
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
        layout: str | None = None,
    ):
        register_op()
        self.layers_name, decoder_layers = find_decoder_layers(model, num_layers)
        # The decoder layers this pipeline stage owns, [start_layer, end_layer)
        # (all of them without pipeline parallelism); the others are
        # placeholders and get no capture point.
        owned = [i for i, m in enumerate(decoder_layers) if not is_pp_placeholder(m)]
        self.start_layer, self.end_layer = (owned[0], owned[-1] + 1) if owned else (0, 0)
        self.max_rows = max_rows
        self.rows = torch.zeros(max_rows, dtype=torch.int64, device=device)
        # On the CPU the op reads the index and counts where arm() writes them
        # (no copy); elsewhere arm() writes host copies and copies them over.
        self._on_host = count_readable_on_host(self.rows.device)
        self.rows_host = self.rows if self._on_host else torch.zeros(max_rows, dtype=torch.int64)
        self.count = 0
        self._index: dict[int, int] = {}  # capture id -> its position in counts
        self.buffers: dict[int, torch.Tensor] = {}
        taps: dict[int, Tap] = {}
        # Attention patterns: vLLM's Attention module per pattern id; points
        # of their own width: the linear layer whose input they are, the MLP's
        # down projection per mlp_post id, the attention's output projection
        # per attn_z id.
        self.pattern_modules: dict[int, nn.Module] = {}
        self.neuron_modules: dict[int, nn.Module] = {}
        # q, k, v ids: their width at vLLM's attention (whose arguments they are).
        self.neuron_widths: dict[int, int] = {}
        # q / k ids whose heads vLLM holds in halves order (Llama 4): their
        # head size; their rows leave the worker in HF's order
        # (taps.heads_in_hf_order, applied by hf_order below).
        self.qk_halves: dict[int, int] = {}
        for k in layers:
            point = point_of_id(k, num_layers)
            layer = decoder_layers[k if point is None else point[1]]
            if is_pp_placeholder(layer):
                continue  # another pipeline stage owns it
            if point is not None and point[0] == NEURON_KIND:
                # The MLP's hidden activations: its down projection's input.
                down = neuron_module(layer, f"{NEURON_KIND}.{point[1]}")
                self.neuron_modules[k] = down
                taps[k] = Tap(down, "pre", first_arg(("x", "input_", "input")))
            elif point is not None and point[0] == Z_KIND:
                # The heads' outputs: the attention output projection's input.
                out_proj = heads_out_module(layer, f"{Z_KIND}.{point[1]}")
                self.neuron_modules[k] = out_proj
                taps[k] = Tap(out_proj, "pre", first_arg(("x", "input_", "input")))
            elif point is not None and point[0] in QKV_KINDS:
                # Queries, keys, values: vLLM's attention module's arguments.
                attn = qkv_module(layer, f"{point[0]}.{point[1]}")
                self.neuron_modules[k] = attn
                self.neuron_widths[k] = qkv_width(attn, point[0])
                head_size = qk_halves_head_size(layer, attn, point[0])
                if head_size is not None:
                    self.qk_halves[k] = head_size
                taps[k] = Tap(attn, "pre", flat_arg_reader(*QKV_ARGS[point[0]]))
            elif point is not None and point[0] == PATTERN_KIND:
                attn = attention_module(layer, f"{PATTERN_KIND}.{point[1]}")
                self.pattern_modules[k] = attn
                taps[k] = Tap(attn, "pre", arg_reader(0, "query"))
            elif point is None:  # resid_pre: the stream entering layer k
                taps[k] = stream_tap(layer, k)
            else:
                taps[k] = point_tap(layer, point[0], layout, f"{point[0]}.{point[1]}")
        self.counts = torch.zeros(max(len(taps), 1), dtype=torch.int64, device=device)
        self.counts_host = (
            self.counts if self._on_host else torch.zeros_like(self.counts, device="cpu")
        )
        # numpy views of the host tensors: arm() writes them once per step,
        # where a tensor index costs microseconds each.
        self._rows_np = self.rows_host.numpy()
        self._counts_np = self.counts_host.numpy()
        self._rows_written = 0  # leading entries of rows_host that may be non-zero
        # Under torch.compile on CPU the writes gather the entries of
        # ``armed``: a tensor on the memory of ``rows`` whose length arm()
        # sets per step, a dynamic size of the compiled graph, so that a
        # forward copies the rows armed in it rather than min(max_rows,
        # tokens) rows at every point (a 1152-token prefill where nobody
        # asked: x0.967 of plain vLLM with every point of a 5 x 256 model
        # capturable). Its length is never below ARMED_FLOOR, which Dynamo
        # would specialize to a constant (sizes 0 and 1): one graph serves
        # every step, and a step where nobody asked gathers row 0 twice per
        # point into scratch rows (with fewer buffer rows than that, the
        # writes gather every entry, as off CPU).
        self.armed: torch.Tensor | None = None
        if self._on_host and max_rows >= ARMED_FLOOR:
            self.armed = torch.empty(0, dtype=torch.int64)
            self._set_armed(0)
            mark_dynamic(self.armed, 0, min=ARMED_FLOOR, max=max_rows)
        # One hook per (module, pre/post), calling the op for each id read there.
        hooks: dict[tuple[int, str], list[tuple[Reader, str, int, float]]] = {}
        modules: dict[int, nn.Module] = {}
        # Pattern ids: their queries and keys, [max_rows, heads x head_size].
        self.pattern_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # mlp_post ids: [max_rows, intermediate_size]; attn_z ids: [max_rows,
        # heads * head_dim]; under tensor parallelism this rank's share of
        # either (its neurons / heads; gathered after the forward, capture.py).
        self.neuron_buffers: dict[int, torch.Tensor] = {}
        for index, (k, tap) in enumerate(taps.items()):
            module = tap.module
            if not hasattr(module, "_hs_rows"):
                module.register_buffer("_hs_rows", self.rows, persistent=False)
                module.register_buffer("_hs_counts", self.counts, persistent=False)
                if self.armed is not None:
                    # A plain attribute, not a buffer: Dynamo gives buffers
                    # static shapes, and this one's length changes per step.
                    module._hs_armed = self.armed
            hooked = hooks.setdefault((id(module), tap.when), [])
            modules[id(module)] = module
            self._index[k] = index
            if k in self.pattern_modules:
                # Two writes at one index: the query and the key rows.
                attn = self.pattern_modules[k]
                widths = (attn.num_heads * attn.head_size, attn.num_kv_heads * attn.head_size)
                outs = []
                for part, width, read in zip(("q", "k"), widths, (tap.read, arg_reader(1, "key"))):
                    out = torch.zeros(max_rows, width, dtype=dtype, device=device)
                    name = f"_hs_out_{index}_{part}"
                    module.register_buffer(name, out, persistent=False)
                    hooked.append((read, name, index, 1.0))
                    outs.append(out)
                self.pattern_buffers[k] = (outs[0], outs[1])
                continue
            width = hidden_size
            if k in self.neuron_widths:
                width = self.neuron_widths[k]
            elif k in self.neuron_modules:
                down = self.neuron_modules[k]
                width = int(getattr(down, "input_size_per_partition", 0) or down.in_features)
            out = torch.zeros(max_rows, width, dtype=dtype, device=device)
            name = f"_hs_out_{index}"
            module.register_buffer(name, out, persistent=False)
            hooked.append((tap.read, name, index, tap.scale))
            if k in self.neuron_modules:
                self.neuron_buffers[k] = out
            else:
                self.buffers[k] = out
        host_counts = self._counts_np if self._on_host else None
        for (module_id, when), module_taps in hooks.items():
            module = modules[module_id]
            if when == "pre":
                module.register_forward_pre_hook(
                    _hook(module_taps, False, host_counts), with_kwargs=True
                )
            else:
                module.register_forward_hook(
                    _hook(module_taps, True, host_counts), with_kwargs=True
                )
        self.layers = list(self.buffers)
        route = write_route(self.rows.device)
        if self.layers:
            logger.info(
                "Hidden states: %d capture points in %d of %d layers of %s.%s (%s), "
                "%d rows each; writes: %s",
                len(self.layers),
                len({k if (p := point_of_id(k, num_layers)) is None else p[1] for k in taps}),
                num_layers,
                type(model).__name__,
                self.layers_name,
                ", ".join(sorted({type(m).__name__ for m in decoder_layers})),
                max_rows,
                route,
            )

    def arm(self, rows: np.ndarray, layers: "Collection[int] | None" = None) -> None:
        """Capture batch rows ``rows`` (int64, at most ``max_rows``) in the
        next forward, at the capture points of ``layers`` (absolute indices;
        None: all of them)."""
        n = len(rows)
        if n > self.max_rows:
            raise ValueError(f"{n} rows asked in one step; the buffers hold {self.max_rows}")
        self._rows_np[:n] = rows
        if self._rows_written > n:
            # Entries past n stay 0 (the invariant above, for the writes that
            # gather without reading the count): only those a larger earlier
            # arm wrote are zeroed.
            self._rows_np[n : self._rows_written] = 0
        self._rows_written = n
        if layers is None:
            self._counts_np[:] = n
        else:
            self._counts_np[:] = 0
            for k in layers:
                if k in self._index:
                    self._counts_np[self._index[k]] = n
        if not self._on_host:
            self.rows.copy_(self.rows_host, non_blocking=True)
            self.counts.copy_(self.counts_host, non_blocking=True)
        elif self.armed is not None:
            self._set_armed(n)
        self.count = n

    def rest(self) -> None:
        """Before a forward that arms nothing (CPU, compiled): :attr:`armed`
        back to ARMED_FLOOR entries, so that the forward gathers no more
        scratch rows per point than that. A no-op while it is there."""
        if self.armed is not None and self.armed.shape[0] != ARMED_FLOOR:
            self._set_armed(0)

    def _set_armed(self, n: int) -> None:
        """Point :attr:`armed` at the first ``max(n, ARMED_FLOOR)`` entries
        of ``rows`` (in place: the compiled graph reads this tensor object,
        and its length, on every forward). Entries past ``n`` are 0."""
        assert self.armed is not None
        length = max(n, ARMED_FLOOR)
        if self.armed.shape[0] != length:
            with torch.no_grad():
                self.armed.set_(self.rows.untyped_storage(), 0, (length,), (1,))

    def disarm(self) -> None:
        """No capture in later forwards (profile, dummy and warm-up runs included).

        The index goes back to all zeros too: a write that cannot read the
        count (off CPU; on CPU under torch.compile) gathers every entry, and
        an index left over from a larger batch would read past a smaller
        one's rows (off CPU a device-side assert that kills the engine).
        :attr:`armed` keeps its length (zeros), so that a decode step arming
        as many rows as the one before resizes nothing; :meth:`rest` puts it
        back to its floor before a forward that arms nothing."""
        if self.count:
            if self._on_host:
                self._counts_np[:] = 0
                self._rows_np[: self._rows_written] = 0
                self._rows_written = 0
            else:
                # The host copy keeps its entries; the next arm zeroes those
                # past its count before copying it over.
                self.rows.zero_()
                self.counts.zero_()
            self.count = 0

    def read(self, k: int) -> torch.Tensor:
        """``[count, hidden_size]``: layer ``k``'s rows of the last forward (a view)."""
        return self.buffers[k][: self.count]

    def read_neurons(self, k: int) -> torch.Tensor:
        """``[count, width]``: mlp_post (``intermediate_size`` wide) or attn_z
        (``heads * head_dim``) id ``k``'s rows of the last forward."""
        return self.neuron_buffers[k][: self.count]

    def hf_order(self, k: int, rows: torch.Tensor) -> torch.Tensor:
        """Wide id ``k``'s ``rows`` (``[rows, width]``, whole heads: this
        rank's or, gathered, all of them) in HF's order: itself, except at
        the q / k ids of a layer whose heads vLLM holds in halves order
        (:attr:`qk_halves`), put back per head."""
        head_size = self.qk_halves.get(k)
        return rows if head_size is None else heads_in_hf_order(rows, head_size)

    def read_pattern(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pattern id ``k``'s query and key rows of the last forward (views)."""
        q, key = self.pattern_buffers[k]
        return q[: self.count], key[: self.count]
