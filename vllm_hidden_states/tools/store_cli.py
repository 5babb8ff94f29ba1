# SPDX-License-Identifier: Apache-2.0
"""The ``vllm-hidden-states store`` command line: ``query`` an activation store
with DuckDB (a request's feature deltas, a threshold search, any SQL) and
``prune`` its old partitions (:mod:`vllm_hidden_states.store.activation_store`;
docs/datasets.md)."""

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="store_command", required=True)
    q = sub.add_parser("query", help="query an activation store with DuckDB")
    q.add_argument("root", help="the store directory (--activation-store DIR)")
    qs = q.add_subparsers(dest="query", required=True)
    d = qs.add_parser("deltas", help="feature activations over the positions of one request")
    d.add_argument(
        "--request-id",
        required=True,
        help="the response's id (the `id` field: cmpl-..., chatcmpl-...)",
    )
    d.add_argument(
        "--choice-index",
        type=int,
        default=0,
        help="the choice's index in the response (default 0; n > 1 or several prompts have more)",
    )
    d.add_argument("--feature", type=int, action="append", help="only these feature ids")
    d.add_argument("--layer", type=int, help="only this SAE layer")
    t = qs.add_parser("threshold", help="requests where a feature reached a value")
    t.add_argument("--feature", type=int, required=True)
    t.add_argument("--min", dest="min_activation", type=float, required=True)
    t.add_argument("--model-id")
    s = qs.add_parser("sql", help="any SQL over the views sae_features and hidden_states")
    s.add_argument("sql")
    for sp in (d, t, s):
        sp.add_argument(
            "--format", dest="out_format", choices=["table", "csv", "json"], default="table"
        )
    pr = sub.add_parser("prune", help="delete partitions older than --days")
    pr.add_argument("root")
    pr.add_argument(
        "--days",
        type=int,
        default=None,
        help="retention in days (default: $VLLM_HIDDEN_STATES_STORE_RETENTION_DAYS or 14)",
    )


TABLE_MAX_ROWS = 1_000_000  # --format table; csv and json print every row


def _print_relation(rel, out_format: str) -> None:
    """A DuckDB relation on stdout: DuckDB's own table, JSON records or CSV."""
    if out_format == "table":
        rel.show(max_rows=TABLE_MAX_ROWS, max_width=10_000)
        return
    cols, rows = rel.columns, rel.fetchall()
    if out_format == "json":
        print(json.dumps([dict(zip(cols, r)) for r in rows], default=str))
    else:
        import csv

        w = csv.writer(sys.stdout)
        w.writerow(cols)
        w.writerows(rows)


def run(args: argparse.Namespace) -> int:
    from vllm_hidden_states.store import activation_store as store

    if args.store_command == "prune":
        days = store.retention_days_from_env() if args.days is None else args.days
        for path in store.prune(args.root, days):
            print(f"deleted {path}")
        return 0
    if not Path(args.root).is_dir():
        print(f"vllm-hidden-states store: {args.root} is not a directory", file=sys.stderr)
        return 2
    if args.query == "deltas":
        cur = store.feature_deltas(
            args.root, args.request_id, args.feature, args.layer, choice_index=args.choice_index
        )
    elif args.query == "threshold":
        cur = store.threshold_search(
            args.root, args.feature, args.min_activation, model_id=args.model_id
        )
    else:
        cur = store.connect(args.root).sql(args.sql)
    _print_relation(cur, args.out_format)
    return 0
