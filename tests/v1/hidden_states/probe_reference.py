# SPDX-License-Identifier: Apache-2.0
"""The probe directory of the probe tests and its numpy reference on HF
states (the ``probes_dir`` and ``reference`` fixtures of conftest.py)."""

import numpy as np

from vllm_hidden_states.probes import read_probe, save_probe, score_numpy

# Scores are float32 from float32 states: agreement with the float64
# reference within this, relative to the largest score.
TOL = 1e-4


def probe_points(num_layers: int) -> dict[str, tuple[str, str, int, bool]]:
    """name -> (point, output, k, normalised): every kind of point a probe
    reads, with layers taken from the model's depth."""
    last = num_layers - 1
    return {
        "final": ("-1", "none", 1, True),
        "embed": ("0", "sigmoid", 2, False),
        "pre2": ("blocks.2.hook_resid_pre", "softmax", 4, True),
        "post1": ("resid_post.1", "sigmoid", 3, False),
        "attn1": ("attn_out.1", "none", 2, True),
        "mid2": ("resid_mid.2", "softmax", 3, False),
        "mlp_last": (f"mlp_out.{last}", "sigmoid", 1, True),
        "post_last": (f"resid_post.{last}", "none", 2, False),
    }


def write_probes(directory, hidden_size: int, num_layers: int, seed: int = 0):
    """One random probe file per entry of :func:`probe_points`; weights
    scaled so that sigmoid / softmax stay away from saturation."""
    rng = np.random.default_rng(seed)
    for name, (point, output, k, normalised) in probe_points(num_layers).items():
        weight = rng.standard_normal((k, hidden_size)) / np.sqrt(hidden_size)
        if k == 1 and name == "final":
            weight = weight[0]  # the [hidden_size] form
        save_probe(
            directory / f"{name}.safetensors",
            weight,
            rng.standard_normal(k) * 0.1,
            point,
            output,
            mean=rng.standard_normal(hidden_size) * 0.1 if normalised else None,
            scale=rng.uniform(0.5, 2.0, hidden_size) if normalised else None,
        )
    return directory


class Reference:
    """The numpy scores on HF states at each probe's point."""

    def __init__(self, hf, directory):
        self.hf = hf
        self._seen: dict[tuple[int, ...], tuple] = {}  # one HF forward per sequence
        self.probes = {
            name: read_probe(directory / f"{name}.safetensors")
            for name in probe_points(hf.num_layers)
        }

    def rows(self, token_ids: list[int], point: str) -> np.ndarray:
        key = tuple(token_ids)
        if key not in self._seen:
            self._seen = {key: (self.hf.states(token_ids), self.hf.points(token_ids))}
        states, points = self._seen[key]
        if point.lstrip("-").isdigit():
            return states[int(point)].double().numpy()
        if point.startswith("blocks."):
            _, layer, hook = point.split(".")
            point = f"{hook.removeprefix('hook_')}.{layer}"
        return points[point].double().numpy()

    def check(self, scores: dict, token_ids: list[int], positions: slice, what: str) -> None:
        """Each probe's ``[n, k]`` float32 scores equal the reference at
        ``positions`` within :data:`TOL` relative."""
        for name, got in scores.items():
            probe = self.probes[name]
            want = score_numpy(self.rows(token_ids, probe.point), probe)[positions]
            got = got.numpy()
            assert got.dtype == np.float32, (what, name)
            assert got.shape == want.shape == (want.shape[0], probe.k), (what, name, got.shape)
            scale = max(np.abs(want).max(), 1e-3)
            np.testing.assert_allclose(
                got, want, atol=TOL * scale, rtol=0, err_msg=f"{what}: probe {name}"
            )
