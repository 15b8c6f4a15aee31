"""`colibri shard STORE --nodes N --out DIR`: per-node stores for `--cluster`.

Writes DIR/node-0 ... DIR/node-{N-1}, each a store (docs/FORMAT.md, with a "shard" field)
holding the dense weights, the side files and only that node's expert records, and
DIR/shards.json, the shard map (placement.py: records balanced per layer by usage.json's
counts, or --usage, else uniformly). Copy node-k to its machine and run the coordinator with
`--cluster ADDRESS --shard-map DIR/shards.json`: owner k opens the path listed for it (the
same path on its machine), on the node whose IP is given by --hosts, if any. Every record is
checked against its XXH3-64 as it is copied; each store is written to a temporary directory
and renamed. Nothing here imports Ray.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from colibri.cluster.placement import place, save_shard_map
from colibri.errors import ColibriError
from colibri.io.cache import load_usage
from colibri.io.format import MANIFEST, StoreWriter, open_store


def shard_store(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    nodes: int,
    *,
    usage: str | None = None,
    hosts: list[str] | None = None,
    force: bool = False,
) -> Path:
    """Split the store at `src` into `nodes` per-node stores under `out` and write
    out/shards.json; returns its path. usage: a usage.json of (layer, expert) counts
    (default: the store's own, else uniform). hosts: each node's IP (owner k runs there).
    Raises StoreError (a bad source record) and ColibriError (bad arguments, OUT exists)."""
    store = open_store(src)
    if "shard" in store.manifest:
        raise ColibriError(f"{src}: is already a shard of {store.manifest['shard']['source']}")
    if nodes < 1:
        raise ColibriError(f"--nodes {nodes}: must be at least 1")
    if hosts is not None and len(hosts) != nodes:
        raise ColibriError(f"--hosts: {len(hosts)} given for {nodes} nodes")
    out = Path(out)
    if (out / "shards.json").exists() and not force:
        raise ColibriError(f"{out}: already holds a shard map (use --force to replace it)")
    from colibri.registry import model_spec

    spec = model_spec(store.config)
    counts = load_usage(usage or (store.path / "usage.json"))
    popularity = {k: float(v) for k, v in counts.items()} if counts else None
    shard = place(
        store.moe_layers,
        len(spec.layers),
        store.num_experts,
        nodes,
        store.layout.record_nbytes,
        popularity=popularity,
    )
    side = [
        f.name
        for f in sorted(store.path.iterdir())
        if f.is_file() and f.name not in (MANIFEST, store.dense_path.name, store.experts_path.name)
    ]
    dense = [(n, store.dense_qtype(n), store.manifest["dense"][n]["shape"]) for n in store.dense_names()]  # fmt: skip  # noqa: E501
    paths = []
    with open(store.experts_path, "rb", buffering=0) as f:
        for k in range(nodes):
            path = out / f"node-{k}"
            with StoreWriter(path, store.layout, force=force, layouts=store.layouts) as w:
                w.begin_dense(dense)
                for name, _, _ in dense:
                    data, _, _ = store.dense(name)
                    w.write_dense(name, data)
                for r in store.records:
                    if shard[r.layer, r.expert] != k:
                        continue
                    raw = os.pread(f.fileno(), r.nbytes, r.offset)
                    store.verify_record(r, raw)
                    w.write_record(r.layer, r.expert, raw)
                for name in side:
                    w.add_file(name, (store.path / name).read_bytes())
                source = {"kind": "shard", "name": store.path.name}
                info = {"index": k, "of": nodes, "source": str(store.path.resolve())}
                w.finish(store.model_type, store.config, source, extra={"shard": info})
            paths.append(str(path.resolve()))
    target = out / "shards.json"
    save_shard_map(target, shard, paths, hosts)
    return target


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="the store to split")
    p.add_argument("--nodes", type=int, required=True, help="number of nodes (expert owners)")
    p.add_argument("--out", required=True, help="directory for node-K stores and shards.json")
    p.add_argument("--usage", help="usage.json counts to balance by (default: the store's)")
    p.add_argument(
        "--hosts", help="comma-separated IPs of the nodes, in order (owner k runs on host k)"
    )
    p.add_argument("--force", action="store_true", help="replace existing node stores")


def run_cli(args: argparse.Namespace) -> int:
    hosts = [h.strip() for h in args.hosts.split(",")] if args.hosts else None
    target = shard_store(
        args.store, args.out, args.nodes, usage=args.usage, hosts=hosts, force=args.force
    )
    print(f"wrote {args.nodes} node stores and {target}")
    return 0
