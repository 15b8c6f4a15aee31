"""`python -m colibri inspect STORE [--verify]`: what a store holds, and whether it is intact."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

import numpy as np

from colibri import registry
from colibri.io.format import Store, open_store, tensor_nbytes

_TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk", "top_k_experts")


def describe(store: Store) -> dict[str, Any]:
    """Summary figures of `store`: architecture, layer and expert counts, top-k, parameters
    (total, and active per token = dense + top-k experts in every MoE layer), dense and expert
    bytes on disk, record size, and the quant types used (dense: count per type)."""
    cfg = store.config
    if store.model_type in registry.FAMILIES:  # keys left out: the transformers defaults
        cfg = registry.family(store.model_type).resolve_config(cfg)
    top_k = next((int(cfg[k]) for k in _TOP_K_KEYS if k in cfg), 0)
    lay = store.layout
    expert_params = sum(int(np.prod(t.shape)) for t in lay.tensors.values())
    dense_params = dense_bytes = 0
    dense_types: Counter[str] = Counter()
    for name in store.dense_names():
        m = store.manifest["dense"][name]
        dense_params += int(np.prod(m["shape"]))
        dense_bytes += tensor_nbytes(m["qtype"], m["shape"])
        dense_types[m["qtype"]] += 1
    n_moe = len(store.moe_layers)
    return {
        "path": str(store.path),
        "architecture": store.model_type,
        "layers": int(cfg.get("num_hidden_layers", 0)),
        "moe_layers": n_moe,
        "experts": store.num_experts,
        "top_k": top_k,
        "d_model": lay.d_model,
        "d_ff": lay.d_ff,
        "params_total": dense_params + len(store.records) * expert_params,
        "params_active": dense_params + n_moe * top_k * expert_params,
        "dense_bytes": dense_bytes,
        "expert_bytes": int(store.manifest["experts_nbytes"]),
        "record_nbytes": lay.record_nbytes,
        "expert_qtype": lay.qtype,
        "dense_qtypes": dict(dense_types),
    }


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    raise AssertionError


def _fmt_params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", metavar="STORE", help="store directory")
    p.add_argument(
        "--verify",
        action="store_true",
        help="read every expert record and dense tensor, check their checksums",
    )


def run_cli(args: argparse.Namespace) -> int:
    store = open_store(args.store)
    d = describe(store)
    print(f"store          {d['path']}")
    print(f"architecture   {d['architecture']}")
    print(f"layers         {d['layers']} ({d['moe_layers']} with experts)")
    print(f"experts        {d['experts']} per layer, top-k {d['top_k']}")
    print(f"d_model, d_ff  {d['d_model']}, {d['d_ff']} (per expert)")
    print(f"params         {_fmt_params(d['params_total'])} total, "
          f"{_fmt_params(d['params_active'])} active per token")  # fmt: skip
    types = ", ".join(f"{q}: {n} tensors" for q, n in sorted(d["dense_qtypes"].items()))
    print(f"dense          {_fmt_bytes(d['dense_bytes'])}  {types}")
    print(f"experts        {_fmt_bytes(d['expert_bytes'])}  {d['expert_qtype']}, "
          f"{len(store.records)} records of {_fmt_bytes(d['record_nbytes'])}")  # fmt: skip
    tok = store.manifest.get("tokenizer_files") or []
    print(f"tokenizer      {', '.join(tok) if tok else 'none'}")
    if args.verify:
        from tqdm import tqdm

        with tqdm(
            total=d["expert_bytes"], unit="B", unit_scale=True, desc="verify", disable=None
        ) as bar:
            store.verify_all(progress=bar.update)
        print(f"checksums      all {len(store.records)} records verified (xxh3_64)")
        checked = store.verify_dense()
        if store.dense_checksummed:
            print(f"               all {checked} dense tensors verified (xxh3_64)")
        else:
            print(
                f"               dense tensors: {checked} of {len(store.dense_names())} have "
                "checksums (a store written before dense checksums; re-convert to add them)"
            )
    else:
        print("checksums      not verified (use --verify)")
    return 0
