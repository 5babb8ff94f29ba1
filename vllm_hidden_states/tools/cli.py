# SPDX-License-Identifier: Apache-2.0
"""``vllm-hidden-states`` console script.

vllm-hidden-states patch apply|check|revert
vllm-hidden-states patch verify [--version X.Y.Z]   (every supported set on its pristine wheel)
vllm-hidden-states patch rebase --to X.Y.Z [...]    (the newest set carried to a new release)
vllm-hidden-states tiny-model DIR [--arch qwen3|llama|gemma2|...] [...]
vllm-hidden-states collect DATASET OUT (--model M | --server-url URL) [...]
vllm-hidden-states store query ROOT deltas|threshold|sql ... | store prune ROOT
vllm-hidden-states audit [MODEL_DIR] [--json]   (what is exact: the docs table, or one checkpoint)
"""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from vllm_hidden_states.tools.tiny_models import ARCHS

    parser = argparse.ArgumentParser(prog="vllm-hidden-states")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("patch", help="manage the patches on the installed vLLM")
    p.add_argument(
        "action",
        choices=["apply", "check", "revert", "verify", "rebase"],
        help="verify and rebase take their own options (--help after them)",
    )
    t = sub.add_parser("tiny-model", help="build a tiny random-weight model")
    t.add_argument("out")
    t.add_argument("--arch", choices=ARCHS, default="qwen3")
    t.add_argument("--layers", type=int, default=4)
    t.add_argument("--hidden", type=int, default=128)
    t.add_argument("--vocab", type=int, default=512)
    t.add_argument("--seed", type=int, default=0)
    sae = sub.add_parser("tiny-sae", help="write a random SAE (SAELens layout) for a model")
    sae.add_argument("out")
    sae.add_argument("--model", required=True, help="model directory (reads hidden_size)")
    sae.add_argument("--layer", type=int, required=True, help="HF layer index >= 0")
    sae.add_argument("--d-sae", type=int, default=64)
    sae.add_argument("--architecture", choices=["standard", "jumprelu"], default="standard")
    sae.add_argument("--seed", type=int, default=0)
    from vllm_hidden_states.tools import collect, store_cli

    c = sub.add_parser("collect", help="harvest hidden states of a dataset to Parquet shards")
    collect.add_arguments(c)
    st = sub.add_parser("store", help="query or prune an activation store")
    store_cli.add_arguments(st)
    sub.add_parser(
        "seam", add_help=False, help="the vLLM symbols the package and patches touch (--check)"
    )
    sub.add_parser(
        "audit",
        add_help=False,
        help="what is exact: docs/architectures.md, or one checkpoint (MODEL_DIR [--json])",
    )
    args, rest = parser.parse_known_args(argv)
    if args.command == "audit":
        from vllm_hidden_states.tools import audit

        return audit.main(rest)
    if args.command == "seam":
        from vllm_hidden_states.tools import seam as seam_tool

        return seam_tool.main(rest)
    if args.command == "patch" and args.action == "verify":
        from vllm_hidden_states.tools import release_check

        return release_check.main(rest)
    if args.command == "patch" and args.action == "rebase":
        from vllm_hidden_states.tools import rebase

        return rebase.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")

    if args.command == "collect":
        return collect.run(args)
    if args.command == "store":
        return store_cli.run(args)

    if args.command == "tiny-sae":
        import json
        from pathlib import Path

        from vllm_hidden_states.sae import build_random_sae

        config = json.loads((Path(args.model) / "config.json").read_text())
        print(
            build_random_sae(
                args.out,
                config["hidden_size"],
                args.layer,
                args.d_sae,
                args.architecture,
                args.seed,
            )
        )
        return 0

    if args.command == "tiny-model":
        from vllm_hidden_states.tools.tiny_models import build_tiny_model

        path = build_tiny_model(
            args.out,
            arch=args.arch,
            num_layers=args.layers,
            hidden_size=args.hidden,
            vocab_size=args.vocab,
            seed=args.seed,
        )
        print(path)
        return 0

    from vllm_hidden_states.tools import source_patches

    try:
        if args.action == "apply":
            done = source_patches.apply()
            print(
                f"vLLM {source_patches.installed_vllm_version()} at {source_patches.site_root()}: "
                + (f"applied {', '.join(done)}" if done else "already patched")
            )
        elif args.action == "revert":
            done = source_patches.revert()
            print("reverted " + (", ".join(done) if done else "nothing"))
        else:
            source_patches.check_version()
            states = source_patches.status()
            for s in states:
                print(f"{s.state:12s} {s.name}")
            if any(s.state != "applied" for s in states):
                print("run `vllm-hidden-states patch apply`", file=sys.stderr)
                return 1
    except source_patches.PatchError as e:
        print(f"vllm-hidden-states: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
