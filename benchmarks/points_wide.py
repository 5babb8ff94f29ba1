# SPDX-License-Identifier: Apache-2.0
"""The capture points comparison (:mod:`benchmarks.points`) on four random
Llama layers of a 0.5B model's width (896 hidden, 4864 MLP, 14 heads of 64:
:func:`benchmarks.small_model.wide_model`), same workload and method.

Why a second model: with every point capturable, the compiled forward pays a
fixed cost per capture point (on CPU a few microseconds: the extra kernel
loops, their barriers and the graph inputs), whatever the rows asked. Against
a 256-wide layer that is a few percent of the step; against a layer of a
production model's width it is what a user of such a model pays. Both are
reported.
"""

from pathlib import Path

from benchmarks import points
from benchmarks.small_model import wide_model


def run(rounds: int, quick: bool, model: Path | None = None, progress=None) -> list:
    return points.run(rounds, quick, model or wide_model(), progress)


if __name__ == "__main__":
    from benchmarks.common import section_main

    section_main(run, "points_wide")
