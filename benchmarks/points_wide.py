# SPDX-License-Identifier: Apache-2.0
"""The capture points comparison (:mod:`benchmarks.points`) on four random
Llama layers of a 0.5B model's width (896 hidden, 4864 MLP, 14 heads of 64:
:func:`benchmarks.small_model.wide_model`), same workload and method.

Why a second model: with every point capturable and nobody asking, the
compiled CPU forward pays, per capture point, a fixed cost in each step (a
few microseconds: the extra kernel loops and their barriers), whatever the
rows it copies (2 scratch rows when nobody asked; README, "A step where
nobody asked"). Against a 256-wide layer that is a few percent of a decode
step; against a layer of a production model's width it shrinks, and what is
left is what a user of such a model pays. Both models are reported.
"""

from pathlib import Path

from benchmarks import points
from benchmarks.common import Comparison
from benchmarks.small_model import wide_model


def run(rounds: int, quick: bool, model: Path | None = None, progress=None) -> list[Comparison]:
    return points.run(rounds, quick, model or wide_model(), progress)


if __name__ == "__main__":
    from benchmarks.common import section_main

    section_main(run, "points_wide")
