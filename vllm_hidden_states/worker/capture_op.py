# SPDX-License-Identifier: Apache-2.0
"""The capture op: one capture point's write of selected stream rows into its
buffer, by the route that costs least where the forward runs (a Triton kernel
or the registered custom op off CPU; a compiled gather or the C++ / Python
body on CPU). docs/architecture.md, "The capture op", tells why each route.
"""

import importlib.util
from collections.abc import Callable

import numpy as np
import torch

from vllm.logger import init_logger
from vllm_hidden_states.worker import c_ops

logger = init_logger(__name__)

OP_NAME = "hidden_states_capture"


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
    scale: float = 1.0,
) -> None:
    """``target = ((hidden + residual) * scale)[index]``: ``hidden``/``residual``
    ``[tokens, hidden_size]``, ``index`` int64 ``[n]`` (every entry
    ``< tokens``), ``target`` ``[n, hidden_size]`` in the model dtype. The
    scale is applied to the gathered rows (the same products, elementwise)."""
    if residual is None:
        torch.index_select(hidden, 0, index, out=target)
    else:
        residual = residual.reshape(-1, residual.shape[-1])
        torch.add(hidden.index_select(0, index), residual.index_select(0, index), out=target)
    if scale != 1.0:
        target.mul_(scale)


# CPU count tensors seen as numpy arrays (the same memory), by data pointer:
# reading one element is then a plain memory read, not a tensor index.
_counts_views: dict[int, np.ndarray] = {}


def counts_on_host(counts: torch.Tensor) -> np.ndarray:
    """``counts`` (a persistent CPU tensor) as a numpy view of its memory."""
    view = _counts_views.get(counts.data_ptr())
    if view is None or view.shape[0] != counts.shape[0]:
        view = _counts_views[counts.data_ptr()] = counts.numpy()
    return view


def _capture_rows(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    rows: torch.Tensor,
    counts: torch.Tensor,
    index: int,
    out: torch.Tensor,
    scale: float,
) -> None:
    """``out[:n] = ((hidden + residual) * scale)[rows[:n]]`` with ``n =
    counts[index]`` (see module doc)."""
    if count_readable_on_host(counts.device):
        # A plain memory read on CPU; the "nobody asked" path is this one read.
        n = counts_on_host(counts)[index]
        if n:
            op = c_ops.capture_op()
            if op is not None:  # the same write in C++, one dispatcher call
                op(hidden, residual, rows, counts, index, out, scale)
            else:
                gather_rows(
                    hidden.reshape(-1, hidden.shape[-1]), residual, rows[:n], out[:n], scale
                )
        return
    if hidden.is_cuda and off_cpu_route() == "triton":
        from vllm_hidden_states.worker import capture_kernel

        if capture_kernel.gather(hidden, residual, rows, counts, index, out, scale):
            return
    _gather_every_entry(hidden, residual, rows, out, scale)


# "c": vllm_hidden_states._C's CUDA kernel (count read on the device, as
# Triton's). Not the default until benchmarks/gpu/capture_op.py has timed it
# against Triton on a GPU.
OFF_CPU_ROUTES = ("triton", "torch", "c")
_off_cpu_route: str | None = None  # decided on first use


def off_cpu_route() -> str:
    """How the op writes where it cannot read the count on the host:
    ``"triton"`` (:mod:`.capture_kernel`, the count read on the device) where
    Triton is installed, else ``"torch"`` (every entry gathered with aten
    ops). Decided once per process, unless :func:`use_off_cpu_route` chose."""
    global _off_cpu_route
    if _off_cpu_route is None:
        _off_cpu_route = "triton" if importlib.util.find_spec("triton") else "torch"
    return _off_cpu_route


def use_off_cpu_route(route: str) -> None:
    """Choose the off-CPU route for forwards (and CUDA graphs) captured from
    now on: ``benchmarks/gpu/capture_op.py`` times both."""
    global _off_cpu_route
    if route not in OFF_CPU_ROUTES:
        raise ValueError(f"off-CPU route {route!r}; expected one of {OFF_CPU_ROUTES}")
    if route == "c" and not c_ops.load():
        raise ValueError(f"off-CPU route 'c': {c_ops.why_not()}")
    _off_cpu_route = route


def _gather_every_entry(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    rows: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """The write without a count: the first ``n = min(max_rows, tokens)``
    entries of the persistent index (the rows armed for this forward are
    among them: at most one per token; entries past the count are 0, a row
    every forward has). ``tokens`` is static per CUDA graph, so a decode step
    of batch b gathers b rows, not max_rows. Written with out-of-place ops and
    one ``copy_``, so that Dynamo traces it into a compiled graph as well (on
    CPU ``rows`` is then :attr:`CapturePoints.armed`, whose length is the
    armed count: ``n`` follows it)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    n = min(rows.shape[0], hidden.shape[0])
    index = rows[:n]
    value = hidden.index_select(0, index)
    if residual is not None:
        value = value + residual.reshape(-1, residual.shape[-1]).index_select(0, index)
    if scale != 1.0:
        value = value * scale
    out[:n].copy_(value)


def _capture_rows_fake(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    rows: torch.Tensor,
    counts: torch.Tensor,
    index: int,
    out: torch.Tensor,
    scale: float,
) -> None:
    return None


def register_custom_op(
    name: str, func: Callable[..., None], fake: Callable[..., None], mutates: str | list[str]
) -> None:
    """Register ``torch.ops.vllm.<name>`` (mutating the argument(s)
    ``mutates``) once per process, with vLLM's own helper."""
    if hasattr(torch.ops.vllm, name):
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    mutated = [mutates] if isinstance(mutates, str) else list(mutates)
    direct_register_custom_op(op_name=name, op_func=func, mutates_args=mutated, fake_impl=fake)


def register_op() -> None:
    """Register ``torch.ops.vllm.hidden_states_capture`` once per process."""
    register_custom_op(OP_NAME, _capture_rows, _capture_rows_fake, "out")


def write_route(device: torch.device) -> str:
    """How capture points write on ``device``, in words (the engine-start log
    line names it)."""
    if count_readable_on_host(device):
        eager = (
            "vllm_hidden_states._C (C++)"
            if c_ops.load()
            else f"the op's Python body ({c_ops.why_not()})"
        )
        return (
            f"count read on the host; eager forwards write with {eager}, "
            "compiled ones with aten ops in the graph"
        )
    route = off_cpu_route()
    if route == "triton":
        return (
            "one Triton kernel per point, count read on the device (kept until "
            "benchmarks/gpu/capture_op.py times vllm_hidden_states._C on a GPU)"
        )
    if route == "c":
        return "vllm_hidden_states._C's CUDA kernel per point, count read on the device"
    return "aten gather of every entry (Triton not importable)"


def capture(
    a: torch.Tensor,
    b: torch.Tensor | None,
    rows: torch.Tensor,
    counts: torch.Tensor,
    index: int,
    out: torch.Tensor,
    scale: float,
    armed: torch.Tensor | None = None,
) -> None:
    """One capture point's write, ``out[:n] = ((a + b) * scale)[rows[:n]]``,
    by the route that costs least where the forward runs (see module doc).
    Under Dynamo the branch is taken at trace time (device and compiling are
    constants of the graph). ``armed``: on CPU, the armed entries of ``rows``
    as a tensor of dynamic length (:attr:`CapturePoints.armed`)."""
    if not count_readable_on_host(counts.device):
        if off_cpu_route() == "c":
            torch.ops.vllm_hidden_states.capture(a, b, rows, counts, index, out, scale)
        else:
            torch.ops.vllm.hidden_states_capture(a, b, rows, counts, index, out, scale)
    elif torch.compiler.is_compiling():
        _gather_every_entry(a, b, rows if armed is None else armed, out, scale)
    else:
        _capture_rows(a, b, rows, counts, index, out, scale)
