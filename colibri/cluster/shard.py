"""`colibri shard STORE --nodes N --out DIR`: per-node stores for `--cluster`.

Writes DIR/node-0 ... DIR/node-{N-1}, each a store (docs/FORMAT.md, with a "shard" field)
holding the dense weights, the side files and only that node's expert records, and
DIR/shards.json, the shard map (placement.py: records balanced per layer by popularity, from
--trace (a routing trace's counts), --usage, or the store's usage.json, else uniform, and by
each node's --gbps read bandwidth within its --budget). Copy node-k to its machine and run
the coordinator with `--cluster ADDRESS --shard-map DIR/shards.json`: owner k opens the
path listed for it (the same path on its machine), on the node whose IP is given by --hosts,
if any. Every record is checked against its XXH3-64 as it is copied; each store is written
to a temporary directory and renamed. Nothing here imports Ray.
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
    trace: str | None = None,
    bandwidth: list[float] | None = None,
    budget: list[int] | None = None,
    hosts: list[str] | None = None,
    force: bool = False,
) -> Path:
    """Split the store at `src` into `nodes` per-node stores under `out` and write
    out/shards.json; returns its path. Popularity: trace (a routing trace, .npz or Mixtral
    .jsonl: each (layer, expert) counted once per token routed to it), else usage (a
    usage.json of counts), else the store's own usage.json, else uniform. bandwidth: each
    node's read speed (any unit); budget: each node's bytes for records. hosts: each node's
    IP (owner k runs there).
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
    if trace is not None:
        from colibri.io.replay import load_trace

        t = load_trace(trace)
        if t.num_experts != store.num_experts or t.num_layers != len(spec.layers):
            raise ColibriError(
                f"{trace}: trace has {t.num_layers} layers x {t.num_experts} experts, the "
                f"model {len(spec.layers)} x {store.num_experts}"
            )
        counts: dict = {}
        for _, layer, experts in t.steps():
            for e in experts:
                counts[(layer, e)] = counts.get((layer, e), 0) + 1
    else:
        counts = load_usage(usage or (store.path / "usage.json"))
    popularity = {k: float(v) for k, v in counts.items()} if counts else None
    shard = place(
        store.moe_layers,
        len(spec.layers),
        store.num_experts,
        nodes,
        store.layout.record_nbytes,
        popularity=popularity,
        bandwidth=bandwidth,
        budget=budget,
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
    p.add_argument("--trace", help="a routing trace (.npz, Mixtral .jsonl) to balance by")
    p.add_argument("--gbps", help="comma-separated read GB/s of the nodes (default: equal)")
    p.add_argument(
        "--budget", help="comma-separated bytes each node may hold, e.g. 200G,100G (default: any)"
    )
    p.add_argument(
        "--hosts", help="comma-separated IPs of the nodes, in order (owner k runs on host k)"
    )
    p.add_argument("--force", action="store_true", help="replace existing node stores")


def run_cli(args: argparse.Namespace) -> int:
    from colibri.run import parse_size

    def split(text: str | None, kind: type, flag: str) -> list | None:
        if not text:
            return None
        try:
            return [kind(v.strip()) for v in text.split(",")]
        except ValueError:
            raise ColibriError(f"{flag} {text}: not a comma-separated list") from None

    target = shard_store(
        args.store,
        args.out,
        args.nodes,
        usage=args.usage,
        trace=args.trace,
        bandwidth=split(args.gbps, float, "--gbps"),
        budget=split(args.budget, parse_size, "--budget"),
        hosts=split(args.hosts, str, "--hosts"),
        force=args.force,
    )
    print(f"wrote {args.nodes} node stores and {target}")
    return 0
