# SPDX-License-Identifier: Apache-2.0
"""Captured rows on their way from the device to the host, without a wait.

:class:`HostCopies` issues the copies; :class:`HostRows` is one capture's
destination, filled chunk by chunk (a chunked prefill), so rows are never
concatenated on the CPU while copies are in flight. On CUDA each copy lands in
pinned memory (PyTorch's caching host allocator), issued ``non_blocking`` right
after the forward; vLLM syncs that stream before the step's output leaves the
worker (sync and async scheduling alike), and :meth:`HostCopies.wait` sits on
that hand-over all the same, so it returns at once. On CPU the copies are
plain and the events no-ops.
"""

from dataclasses import dataclass

import torch

from vllm_hidden_states.wire import CapturedRows


class HostCopies:
    """Device-to-host copies of one model runner's captured rows."""

    def __init__(self, device: torch.device) -> None:
        self.asynchronous = device.type == "cuda"
        self.on_host = device.type == "cpu"
        self._event: torch.cuda.Event | None = None

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor to copy into (pinned on CUDA)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.asynchronous)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (host, contiguous) <- ``src`` (device), not waited on."""
        dst.copy_(src, non_blocking=self.asynchronous)

    def gather(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """A new host tensor ``[len(rows), *shape]`` holding ``rows`` (device
        tensors of one shape and dtype), not waited on: on the CPU one stack
        (the rows are in host memory already), elsewhere a copy each."""
        if self.on_host:
            return torch.stack(rows)
        host = self.empty((len(rows), *rows[0].shape), rows[0].dtype)
        for dst, src in zip(host, rows):
            self.copy(dst, src)
        return host

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (a fresh device tensor nothing else writes) on the host,
        not waited on: itself on the CPU, else a copy into pinned memory."""
        if self.on_host:
            return tensor
        host = self.empty(tuple(tensor.shape), tensor.dtype)
        self.copy(host, tensor)
        return host

    def record(self) -> None:
        """After a step's last copy: mark where its rows are complete."""
        if self.asynchronous:
            self._event = torch.cuda.Event()
            self._event.record()

    def take_event(self) -> "torch.cuda.Event | None":
        """The event after the last recorded step's copies, for a reader off
        the step (None on the CPU, or when taken already)."""
        event, self._event = self._event, None
        return event

    def wait(self) -> None:
        """Before rows leave the worker: their copies are complete."""
        if (event := self.take_event()) is not None:
            event.synchronize()


@dataclass
class HostRows:
    """One capture's rows on the host.

    Attributes:
        first: sequence position of row 0.
        states: ``[num_layers, rows, hidden_size]`` in the model dtype, or
            None when no layer's full states were asked.
        features: SAE top-k ``(ids int32, values float32)``, each
            ``[rows, k]``, or None without ``sae_top_k``.
        neurons: one ``[rows, width]`` per point of its own width (mlp_post:
            ``intermediate_size``; attn_z: ``heads * head_dim``) in the model
            dtype, or None when no such point was asked.
        scores: probe scores, float32 ``[rows, sum of k]``, or None when no
            probe was asked.
    """

    first: int
    states: torch.Tensor | None
    features: tuple[torch.Tensor, torch.Tensor] | None
    neurons: list[torch.Tensor] | None = None
    scores: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls,
        copies: HostCopies,
        first: int,
        num_rows: int,
        layers: list[torch.Tensor],
        features: tuple[torch.Tensor, torch.Tensor] | None,
        neurons: list[torch.Tensor] | None = None,
        scores: torch.Tensor | None = None,
    ) -> "HostRows":
        """Room for ``num_rows`` rows shaped like the first chunk's
        (``layers``: one ``[rows, hidden]`` device tensor per layer;
        ``neurons``: one ``[rows, width]`` per mlp_post / attn_z point;
        ``scores``: the chunk's probe scores ``[rows, sum of k]``)."""
        states = None
        if layers:
            hidden = layers[0].shape[-1]
            states = copies.empty((len(layers), num_rows, hidden), layers[0].dtype)
        host_neurons = None
        if neurons:
            host_neurons = [copies.empty((num_rows, n.shape[-1]), n.dtype) for n in neurons]
        host_features = None
        if features is not None:
            ids, values = features
            host_features = (
                copies.empty((num_rows, ids.shape[-1]), ids.dtype),
                copies.empty((num_rows, values.shape[-1]), values.dtype),
            )
        host_scores = None
        if scores is not None:
            host_scores = copies.empty((num_rows, scores.shape[-1]), scores.dtype)
        return cls(first, states, host_features, host_neurons, host_scores)

    def captured(self) -> CapturedRows:
        """The rows as they leave the worker (``ModelRunnerOutput.captured``)."""
        if self.features is None:
            return CapturedRows(hidden=self.states, neurons=self.neurons, probe_scores=self.scores)
        return CapturedRows(
            hidden=self.states,
            sae_ids=self.features[0],
            sae_values=self.features[1],
            neurons=self.neurons,
            probe_scores=self.scores,
        )

    @property
    def num_rows(self) -> int:
        if self.states is not None:
            return self.states.shape[1]
        if self.neurons:
            return self.neurons[0].shape[0]
        if self.scores is not None:
            return self.scores.shape[0]
        return self.features[0].shape[0] if self.features is not None else 0

    def write(
        self,
        copies: HostCopies,
        first: int,
        layers: list[torch.Tensor],
        features: tuple[torch.Tensor, torch.Tensor] | None,
        neurons: list[torch.Tensor] | None = None,
        scores: torch.Tensor | None = None,
    ) -> None:
        """Copy one chunk whose row 0 is position ``first``: one contiguous
        copy per layer (a row range of one layer is contiguous on both sides)."""
        if layers:
            count = layers[0].shape[0]
        elif neurons:
            count = neurons[0].shape[0]
        elif scores is not None:
            count = scores.shape[0]
        else:
            assert features is not None  # a chunk carries rows, features or both
            count = features[0].shape[0]
        lo = first - self.first
        if lo < 0 or lo + count > self.num_rows:
            raise RuntimeError(
                f"vllm-hidden-states: rows {first}..{first + count - 1} fall outside "
                f"the capture's positions {self.first}..{self.first + self.num_rows - 1}"
            )
        for i, rows in enumerate(layers):
            assert self.states is not None  # allocated for the same layers
            copies.copy(self.states[i, lo : lo + count], rows)
        if features is not None:
            assert self.features is not None  # allocated with features
            copies.copy(self.features[0][lo : lo + count], features[0])
            copies.copy(self.features[1][lo : lo + count], features[1])
        for i, rows in enumerate(neurons or ()):
            assert self.neurons is not None  # allocated for the same points
            copies.copy(self.neurons[i][lo : lo + count], rows)
        if scores is not None:
            assert self.scores is not None  # allocated with probes
            copies.copy(self.scores[lo : lo + count], scores)
