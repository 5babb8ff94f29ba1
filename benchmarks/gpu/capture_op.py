# SPDX-License-Identifier: Apache-2.0
"""The capture op alone: what capture points cost one forward of a layer stack.

    python -m benchmarks.gpu.capture_op [--quick | --tiny] [--out DIR]

A stack of ``L`` of vLLM's own ``NemotronHMLPDecoderLayer`` (RMSNorm + a
squared-ReLU MLP, the residual fused into the norm: a decoder layer class
whose stream the package reads as verified against HF, with no attention, so
it runs outside an engine) gets the package's capture points
(:class:`vllm_hidden_states.worker.capture_points.CapturePoints`) before every
layer; before timing, the rows they write are checked against the stream.
One step of ``tokens`` tokens is timed without capture points (the
baseline) and with them, armed with 0, 1, 64 and 1024 rows (capped by the
tokens and ``max_rows``), and the same armed forward followed by the rows'
copy to the host (pinned memory, one copy per layer, as
:mod:`vllm_hidden_states.worker.host_rows` does). On CUDA each variant is
captured as a CUDA graph and replayed (timed with CUDA events), as vLLM runs a
decode step, once per route of the op (``triton``: one kernel per point that
reads the count on the device; ``torch``: the aten gather of every entry;
``c``: ``vllm_hidden_states._C``'s CUDA kernel, where it was built with them).
On CPU it runs eagerly (the count read on the host), once with the op's
Python body (``python``, the route without ``_C``) and once with ``_C``
(``c``), and once with a no-op forward pre-hook per layer (``no-op hook``:
what PyTorch's hook call itself costs, the floor of any eager capture point).

Shapes: 8B-like (32 x 4096, bf16) on CUDA; 16 x 256 fp32 on CPU. Batches:
decode 1, 16, 64 and a 2048-token prefill (CPU: 1, 16, 64). Output: the
overhead of each variant over the baseline in percent and per capture point
in microseconds (medians of paired rounds), JSON and a PNG.
"""

import argparse
import json
import socket
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from vllm_hidden_states.worker import c_ops
from vllm_hidden_states.worker.capture_op import OFF_CPU_ROUTES, use_off_cpu_route
from vllm_hidden_states.worker.capture_points import CapturePoints

REPO = Path(__file__).resolve().parents[2]
ROWS = (0, 1, 64, 1024)


def _vllm_ready() -> None:
    """What vLLM's layers need outside an engine: a current config (their
    custom ops read it) and a one-process tensor-parallel group (their
    parallel linear layers ask its size)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    global _CONFIG
    _CONFIG = set_current_vllm_config(VllmConfig())
    _CONFIG.__enter__()  # for the whole process, as in an engine's worker
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        backend="nccl" if torch.cuda.is_available() else "gloo",
    )
    initialize_model_parallel(1, 1)


_CONFIG = None


def mlp_layers(
    layers: int, hidden: int, inner: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> nn.ModuleList:
    """``layers`` of vLLM's ``NemotronHMLPDecoderLayer`` (RMSNorm + a
    squared-ReLU MLP, the residual fused into the norm, as every vLLM
    fused-residual layer carries it): a decoder layer class whose stream the
    package reads as verified against HF (``vllm_hidden_states.layers``), with
    no attention, so it runs outside an engine (no attention metadata).
    Random weights from ``seed`` (norm weights 1), prepared for vLLM's kernels
    as its loader leaves them."""
    from transformers import NemotronHConfig

    from vllm.model_executor.models.nemotron_h import NemotronHMLPDecoderLayer

    _vllm_ready()
    config = NemotronHConfig(
        hidden_size=hidden,
        intermediate_size=inner,
        num_hidden_layers=layers,
        layers_block_type=["mlp"] * layers,
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
    )
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        stack = nn.ModuleList(
            NemotronHMLPDecoderLayer(config, i, prefix=f"model.layers.{i}") for i in range(layers)
        )
    finally:
        torch.set_default_dtype(default_dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in stack.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * p.shape[-1] ** -0.5)
    stack.to(device)
    for module in stack.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return stack


class Stack(nn.Module):
    """Decoder layers called as a vLLM model calls them."""

    def __init__(self, layers: nn.ModuleList):
        super().__init__()
        self.layers = layers

    def forward(self, x):
        # A fresh stream per forward, as an embedding's output: vLLM's CUDA
        # add-norm writes its inputs in place, and a replayed graph reads x.
        hidden, residual = x.clone(), None
        for layer in self.layers:
            hidden, residual = layer(positions=None, hidden_states=hidden, residual=residual)
        return hidden + residual


def check_rows(points: CapturePoints, plain: Stack, captured: Stack, x: torch.Tensor) -> None:
    """Before timing: the rows the armed points write equal the stream
    entering each layer (hidden + residual, from the plain stack's forward)."""
    n = min(4, x.shape[0], points.max_rows)
    points.disarm()
    points.arm(np.arange(n, dtype=np.int64))
    captured(x)
    hidden, residual = x.clone(), None
    for k, layer in enumerate(plain.layers):
        stream = hidden if residual is None else hidden + residual
        got = points.buffers[k][:n].float()
        ref = stream[:n].float()
        err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        if not err <= 1e-2:
            raise RuntimeError(f"layer {k}: captured rows differ from the stream by {err:.3g}")
        hidden, residual = layer(positions=None, hidden_states=hidden, residual=residual)
    points.disarm()


@torch.inference_mode()
def per_point_cpu(quick: bool = False, tiny: bool = False) -> dict:
    """CPU eager: microseconds per capture point per forward, over a stack of
    64 layers with next to no compute (16 tokens, width 1024, an MLP of width
    8, fp32, one thread), by route: a no-op forward pre-hook per layer
    (PyTorch's hook call alone, the floor), the op's Python body (``python``)
    and ``_C`` (``c``), with 0, 1 and 16 rows armed. Paired rounds against
    the plain stack; medians. ``tiny``: 4 layers, one round of 2 forwards
    (a smoke test: its figures mean nothing)."""
    layers, tokens, width, inner = (4 if tiny else 64), 16, 1024, 8
    rounds, iters = (1, 2) if tiny else (7, 50) if quick else (31, 100)
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    plain = Stack(mlp_layers(layers, width, inner, torch.float32, cpu))
    hooked = Stack(mlp_layers(layers, width, inner, torch.float32, cpu))
    for layer in hooked.layers:
        layer.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True)
    captured = Stack(mlp_layers(layers, width, inner, torch.float32, cpu))
    points = CapturePoints(
        captured,
        list(range(layers)),
        num_layers=layers,
        hidden_size=width,
        max_rows=64,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    x = torch.randn(tokens, width)
    check_rows(points, plain, captured, x)
    variants = [("no-op hook", hooked, None, 0)]
    for route in ["python", "c"] if c_ops.load() else ["python"]:
        variants += [(route, captured, route, n) for n in (0, 1, 16)]
    cases = []
    for name, model, route, n in tqdm(variants, desc="capture_op layer stack", unit="case"):
        c_ops.disable(route == "python")
        points.disarm()
        if n:
            points.arm(np.arange(n, dtype=np.int64))
        diffs = []
        for _ in range(rounds):
            base = _timer(cpu, lambda: plain(x), iters)
            step = _timer(cpu, lambda: model(x), iters)  # noqa: B023 - used at once
            diffs.append((step - base) / layers * 1e6)
        cases.append({"route": name, "rows_armed": n, "per_point_us": statistics.median(diffs)})
    points.disarm()
    c_ops.disable(False)
    shape = {
        "layers": layers,
        "tokens": tokens,
        "width": width,
        "inner": inner,
        "dtype": "float32",
        "layer_class": type(plain.layers[0]).__name__,
    }
    return {"shape": shape, "threads": 1, "rounds": rounds, "iters": iters, "cases": cases}


def _timer(device: torch.device, fn, iters: int) -> float:
    """Seconds per call of ``fn``."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _runnable(model, x, device):
    """A callable running one forward: a replayed CUDA graph on CUDA."""
    if device.type != "cuda":
        return lambda: model(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            model(x)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model(x)
    return graph.replay


def _time_case(
    points: CapturePoints, base, step, n: int, rounds: int, iters: int, num_points: int
) -> dict:
    """One case: the baseline forward, the forward with ``n`` rows armed, and
    that forward followed by the rows' copy to the host, in paired rounds
    (A B C A B C ...). Times in ms (medians), overheads in percent (median of
    the per-round ratios to the baseline)."""
    device = points.rows.device
    pin = device.type == "cuda"
    host = [
        torch.empty(n, points.buffers[k].shape[-1], dtype=points.buffers[k].dtype, pin_memory=pin)
        for k in points.layers
    ]

    def step_and_copy():
        step()
        for k, dst in zip(points.layers, host):
            dst.copy_(points.buffers[k][:n], non_blocking=pin)

    times: dict[str, list[float]] = {"base": [], "op": [], "op+host": []}
    for _ in range(rounds):
        times["base"].append(_timer(device, base, iters))
        times["op"].append(_timer(device, step, iters))
        times["op+host"].append(_timer(device, step_and_copy, iters))
    med = {k: statistics.median(v) for k, v in times.items()}
    over = {
        k: statistics.median((a / b - 1) * 100 for a, b in zip(times[k], times["base"]))
        for k in ("op", "op+host")
    }
    per_point = statistics.median(
        (a - b) / num_points * 1e6 for a, b in zip(times["op"], times["base"])
    )
    return {
        "rows_armed": n,
        "base_ms": med["base"] * 1e3,
        "op_ms": med["op"] * 1e3,
        "op_host_ms": med["op+host"] * 1e3,
        "overhead_pct": over["op"],
        "overhead_with_host_copy_pct": over["op+host"],
        "per_point_us": per_point,
    }


@torch.inference_mode()
def run(quick: bool = False, tiny: bool = False) -> dict:
    """The layer stack with and without capture points, by route, batch and
    rows armed (module docstring). ``tiny``: 4 layers (CUDA: 4 x 512), the
    smallest batches, one round of 2 forwards (a smoke test: its figures mean
    nothing)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        layers, hidden, inner, dtype = 32, 4096, 14336, torch.bfloat16
        batches, max_rows, iters, rounds = (1, 16, 64, 2048), 512, 20, 5
    else:
        layers, hidden, inner, dtype = 16, 256, 512, torch.float32
        batches, max_rows, iters, rounds = (1, 16, 64), 512, 20, 21
        # One thread: what is measured is the Python and dispatch cost per
        # point, which intra-op threads only blur (more so on a shared box).
        torch.set_num_threads(1)
    if quick:
        rounds, iters = (2, max(2, iters // 4)) if cuda else (7, 10)
    if tiny:
        layers, rounds, iters, batches = 4, 1, 2, batches[:2]
        hidden, inner = (512, 1024) if cuda else (hidden, inner)
    torch.manual_seed(0)
    # The same weights (seed) in each stack.
    plain = Stack(mlp_layers(layers, hidden, inner, dtype, device))
    captured = Stack(mlp_layers(layers, hidden, inner, dtype, device))
    points = CapturePoints(
        captured,
        list(range(layers)),
        num_layers=layers,
        hidden_size=hidden,
        max_rows=max_rows,
        dtype=dtype,
        device=device,
    )
    x = torch.randn(batches[-1], hidden, dtype=dtype, device=device)
    check_rows(points, plain, captured, x)
    results = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "threads": torch.get_num_threads(),
        "shape": {
            "layers": layers,
            "hidden": hidden,
            "inner": inner,
            "dtype": str(dtype).removeprefix("torch."),
            "layer_class": type(plain.layers[0]).__name__,
        },
        "max_rows": max_rows,
        "rounds": rounds,
        "iters": iters,
        "cases": [],
    }
    if cuda:
        routes = [r for r in OFF_CPU_ROUTES if r != "c" or c_ops.has_cuda_kernels()]
    else:
        routes = ["python", "c"] if c_ops.load() else ["python"]
    bar = tqdm(desc="capture_op", unit="case")  # the row counts per batch vary
    for route in routes:
        if cuda:
            use_off_cpu_route(route)
        else:
            c_ops.disable(route == "python")
        for tokens in batches:
            x = torch.randn(tokens, hidden, dtype=dtype, device=device)
            base = _runnable(plain, x, device)
            for n in sorted({min(rows, tokens, max_rows) for rows in ROWS}):
                points.disarm()
                if n:
                    points.arm(np.arange(n, dtype=np.int64))
                case = _time_case(
                    points, base, _runnable(captured, x, device), n, rounds, iters, layers
                )
                results["cases"].append({"route": route, "tokens": tokens, **case})
                bar.update(1)
    bar.close()
    points.disarm()
    c_ops.disable(False)
    if not cuda:
        # The floor: PyTorch's call of a no-op forward pre-hook per layer.
        hooked = Stack(mlp_layers(layers, hidden, inner, dtype, device))
        for layer in hooked.layers:
            layer.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True)
        for tokens in batches:
            x = torch.randn(tokens, hidden, dtype=dtype, device=device)
            base, step = _runnable(plain, x, device), _runnable(hooked, x, device)
            case = _time_case(points, base, step, 0, rounds, iters, layers)
            results["cases"].append({"route": "no-op hook", "tokens": tokens, **case})
    return results


def lines(results: dict) -> list[str]:
    out = [
        f"capture op ({results['device']}, {results['shape']}, max_rows "
        f"{results['max_rows']}): overhead vs no capture points, median of paired rounds"
    ]
    for c in results["cases"]:
        out.append(
            f"  {c['route']:<10} tokens {c['tokens']:>5}  rows {c['rows_armed']:>4}  "
            f"base {c['base_ms']:8.3f} ms  op {c['overhead_pct']:+6.2f}% "
            f"({c['per_point_us']:6.2f} us/point)  "
            f"op+host copy {c['overhead_with_host_copy_pct']:+6.2f}%"
        )
    return out


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for route, tokens in sorted({(c["route"], c["tokens"]) for c in results["cases"]}):
        cases = [c for c in results["cases"] if (c["route"], c["tokens"]) == (route, tokens)]
        ax.plot(
            [c["rows_armed"] for c in cases],
            [c["overhead_pct"] for c in cases],
            marker="o",
            linestyle="-" if route != "torch" else "--",
            label=f"{route}, {tokens} tokens",
        )
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("symlog")
    ax.set_xlabel("rows armed")
    ax.set_ylabel("overhead vs no capture points (%)")
    ax.set_title(f"capture op, {results['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--tiny", action="store_true", help="4 layers, one round of 2 forwards: a smoke test"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    results = run(args.quick, args.tiny)
    if results["device"] == "cpu":
        results["per_point"] = per_point_cpu(args.quick, args.tiny)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "capture_op-" + ("cuda" if results["device"] != "cpu" else "cpu")
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / f"{stem}.png")
    print("\n".join(lines(results)))
    if "per_point" in results:
        pp = results["per_point"]
        print(f"CPU eager, cost per capture point per forward ({pp['shape']}, one thread):")
        for c in pp["cases"]:
            print(f"  {c['route']:<10} rows {c['rows_armed']:>3}  {c['per_point_us']:6.2f} us")
    return results


if __name__ == "__main__":
    main()
