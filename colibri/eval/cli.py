"""`colibri eval [STORE] --task TASK --data PATH`: a store's measured quality.

    colibri eval STORE --task perplexity --data text.txt [--ctx 512] [--reference F32_STORE]
    colibri eval STORE --task hellaswag --data hellaswag_validation.jsonl.xz --limit 500
    colibri eval STORE --task mmlu --data mmlu_test.jsonl.xz --shots 5 --json out.json

The embedded demo model when STORE is omitted; the engine options of `colibri run`. A
progress bar with ETA on a terminal. --json FILE writes {"task", "store", "n", "metrics",
"statistics", "items"} (metrics that do not apply are absent; written to a temporary, then
renamed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import numpy as np

from colibri import run as run_cmd
from colibri.engine import DEFAULT_N_CTX, Engine, open_engine
from colibri.errors import ColibriError
from colibri.eval import scoring
from colibri.eval.data import EvalError, read_records, read_text
from colibri.eval.tasks import TASKS, build_requests
from colibri.io.format import open_store
from colibri.options import whole

PPL_CTX = 512  # llama-perplexity's default --ctx-size for perplexity


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a store made by `colibri convert` (default: the embedded demo model)",
    )
    p.add_argument("--task", required=True, choices=["perplexity", *TASKS], help="what to measure")
    p.add_argument(
        "--data",
        required=True,
        type=Path,
        help="perplexity: a UTF-8 text file (plain/.gz/.xz); multiple choice: the dataset's "
        "records as JSON lines (plain/.gz/.xz), parquet, or a datasets.save_to_disk folder",
    )
    p.add_argument("--limit", type=whole(1), help="only the first N items (perplexity: N windows)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write metrics and items as JSON")
    p.add_argument(
        "--reference",
        metavar="STORE2",
        help="the same model in another format (e.g. the f32 store); perplexity: per-token "
        "KL(reference || this), top-1 and routing agreement; multiple choice: the accuracy "
        "delta and per-item prediction agreement",
    )
    p.add_argument("--shots", type=whole(0), default=0, help="mmlu: few-shot examples (0..5)")
    p.add_argument(
        "--fewshot-data",
        type=Path,
        help="mmlu: the dev split for --shots (default: --data with 'test' replaced by 'dev')",
    )
    run_cmd.add_engine_options(p)
    for action in p._actions:  # --ctx: the perplexity window here, llama-perplexity's 512
        if action.dest == "n_ctx":
            action.default = None
            action.help = (
                f"perplexity: window length in tokens (default {PPL_CTX}); multiple choice: "
                f"context length (default {DEFAULT_N_CTX})"
            )
        if action.dest == "batch":  # eval feeds many sequences at once: one weight pass
            action.default = "fused"
            action.help = (
                "how the sequences scored together meet the kernels: fused (default here: rows "
                "stacked, one weight pass for all) or split (per-sequence calls, the logits of "
                "a solo run)"
            )


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    opts = run_cmd._engine_options(args)  # --queue-depth and --mirror included
    opts["n_ctx"] = args.n_ctx or (PPL_CTX if args.task == "perplexity" else DEFAULT_N_CTX)
    return opts


def _progress(total: int, unit: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, disable=None, file=sys.stderr, dynamic_ncols=True)


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """obj as JSON at path, through a temporary in the same folder and a rename."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(obj, indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _statistics(engine: Engine, s0: Any, counters: scoring.Counters) -> dict[str, Any]:
    d = engine.statistics(components=False).delta(s0)
    hits, misses = d.expert_hits, d.expert_misses
    return {
        "tokens": counters.tokens,
        "seconds": round(counters.seconds, 3),
        "tokens_per_second": counters.tokens / counters.seconds if counters.seconds else 0.0,
        "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
        "bytes_read": d.bytes_read,
    }


def _tokenizer(engine: Engine) -> Any:
    if engine.tokenizer is None:
        raise EvalError(f"{engine.store.path}: the store has no tokenizer.json")
    return engine.tokenizer


async def eval_perplexity(
    engine: Engine,
    text: str,
    n_ctx: int,
    *,
    reference: Engine | None = None,
    limit: int | None = None,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Perplexity of `text` on engine (and against `reference`): the JSON's metrics and
    statistics. Raises EvalError (no tokenizer, text shorter than one window)."""
    tokens, bos = scoring.text_tokens(_tokenizer(engine), text)
    n_windows = len(tokens) // n_ctx if limit is None else min(limit, len(tokens) // n_ctx)
    c0 = engine.statistics(components=False)
    bar = _progress(n_windows, "window") if show_progress and n_windows else None
    try:
        res = await scoring.perplexity(
            engine, tokens, n_ctx, bos=bos, reference=reference, limit=limit,
            progress=bar.update if bar is not None else None,
        )  # fmt: skip
    finally:
        if bar is not None:
            bar.close()
    ppl, err = scoring.ppl_and_stderr(res.nll)
    metrics: dict[str, Any] = {"ppl": ppl, "ppl_stderr": err, "tokens_scored": len(res.nll)}
    if res.kl is not None and res.top1 is not None and res.ref_nll is not None:
        metrics |= {
            "kl_mean": float(res.kl.mean()),
            "kl_median": float(np.median(res.kl)),
            "kl_p99": float(np.percentile(res.kl, 99)),
            "kl_max": float(res.kl.max()),
            "top1_agreement": float(res.top1.mean()),
            "routing_agreement": res.routing_agreement,
            "routing_overlap": res.routing_overlap,
            "routing_layers": res.moe_layers,
            "reference_ppl": scoring.ppl_and_stderr(res.ref_nll)[0],
        }
    return {
        "n": len(tokens) // n_ctx if limit is None else min(limit, len(tokens) // n_ctx),
        "metrics": metrics,
        "statistics": _statistics(engine, c0, res.counters),
    }


async def eval_choice(
    engine: Engine,
    task: str,
    docs: list[dict[str, Any]],
    source: str,
    *,
    shots: int = 0,
    fewshot_docs: list[dict[str, Any]] | None = None,
    fewshot_source: str = "",
    reference: Engine | None = None,
    show_progress: bool = True,
) -> dict[str, Any]:
    """A multiple-choice task on docs: the JSON's n, metrics, statistics and items. With
    `reference` (the same model in another format) the same requests are scored there too:
    per item its logprobs and predictions, and the accuracy delta and prediction agreement
    (docs/EVAL.md). Raises EvalError (bad fields, an item longer than the context)."""
    requests = build_requests(
        task, docs, source, shots=shots, fewshot_docs=fewshot_docs or [],
        fewshot_source=fewshot_source,
    )  # fmt: skip
    tok = _tokenizer(engine)
    pairs = []
    for i, r in enumerate(requests):
        shared: dict[str, list[int]] = {}  # an item's choices mostly share their context
        try:
            pairs.append(
                [scoring.encode_pair(tok, c, t, shared) for c, t in zip(r.contexts,
                                                                        r.continuations,
                                                                        strict=True)]
            )  # fmt: skip
        except EvalError as exc:
            raise EvalError(f"{source}:item {i}: {exc}") from None
    counters = scoring.Counters()
    c0 = engine.statistics(components=False)
    total = len(requests) * (2 if reference is not None else 1)
    bar = _progress(total, "item") if show_progress else None
    update = bar.update if bar is not None else None
    try:
        try:
            lps = await scoring.score_items(engine, pairs, counters, progress=update)
            ref_lps = None
            if reference is not None:
                ref_lps = await scoring.score_items(reference, pairs, None, progress=update)
        except EvalError as exc:
            raise EvalError(f"{source}:{exc}") from None
    finally:
        if bar is not None:
            bar.close()
    items = []
    for i, r in enumerate(requests):
        logprobs = [float(lp.sum()) for lp in lps[i]]
        nchars = [len(c) for c in r.choices]
        pred, pred_norm = scoring.choose(logprobs, nchars)
        item: dict[str, Any] = {"gold": r.gold, "logprobs": logprobs, "nchars": nchars,
                                "pred": pred, "pred_norm": pred_norm}  # fmt: skip
        if ref_lps is not None:
            ref = [float(lp.sum()) for lp in ref_lps[i]]
            rp, rpn = scoring.choose(ref, nchars)
            item |= {"reference_logprobs": ref, "reference_pred": rp, "reference_pred_norm": rpn}
        items.append(item)
    has_norm = "acc_norm" in TASKS[task].metrics
    metrics = _choice_metrics(items, has_norm)
    if ref_lps is not None:
        metrics |= _reference_metrics(items, has_norm)
    return {
        "n": len(items),
        "metrics": metrics,
        "statistics": _statistics(engine, c0, counters),
        "items": items,
    }


def _choice_metrics(items: list[dict[str, Any]], has_norm: bool, prefix: str = "") -> dict:
    out: dict[str, float] = {}
    for metric, key in [("acc", "pred"), ("acc_norm", "pred_norm")][: 2 if has_norm else 1]:
        hit = [float(it[prefix + key] == it["gold"]) for it in items]
        out[prefix + metric] = float(np.mean(hit))
        out[prefix + metric + "_stderr"] = scoring.mean_stderr(hit)
    return out


def _reference_metrics(items: list[dict[str, Any]], has_norm: bool) -> dict[str, float]:
    """reference_acc(_norm) and its stderr; acc(_norm)_delta = this - reference, with the
    paired standard error (of the per-item difference); pred(_norm)_agreement: the fraction
    of items whose prediction equals the reference's."""
    out: dict[str, float] = {}
    ref = _choice_metrics(items, has_norm, prefix="reference_")
    for metric, key in [("acc", "pred"), ("acc_norm", "pred_norm")][: 2 if has_norm else 1]:
        ours = np.array([float(it[key] == it["gold"]) for it in items])
        theirs = np.array([float(it["reference_" + key] == it["gold"]) for it in items])
        out["reference_" + metric] = ref["reference_" + metric]
        out["reference_" + metric + "_stderr"] = ref["reference_" + metric + "_stderr"]
        out[metric + "_delta"] = float(ours.mean() - theirs.mean())
        out[metric + "_delta_stderr"] = scoring.mean_stderr(ours - theirs)
        agree = [float(it[key] == it["reference_" + key]) for it in items]
        out[key + "_agreement"] = float(np.mean(agree))
    return out


def _fewshot_path(args: argparse.Namespace) -> Path:
    if args.fewshot_data is not None:
        return args.fewshot_data
    guess = args.data.with_name(args.data.name.replace("test", "dev"))
    if guess == args.data or not guess.exists():
        raise EvalError(f"--shots {args.shots}: give the dev split with --fewshot-data")
    return guess


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + "s" * (n != 1)


def summary(task: str, result: dict[str, Any]) -> str:
    """The human-readable lines printed after a run."""
    m, s = result["metrics"], result["statistics"]
    lines = []
    if "ppl" in m:
        lines.append(
            f"{task}: PPL = {m['ppl']:.4f} +/- {m['ppl_stderr']:.5f} over {m['tokens_scored']} "
            f"tokens ({_count(result['n'], 'window')})"
        )
    if "kl_mean" in m:
        lines.append(
            f"reference PPL = {m['reference_ppl']:.4f}; KL(reference || this): mean "
            f"{m['kl_mean']:.6f}, median {m['kl_median']:.6f}, p99 {m['kl_p99']:.6f}, max "
            f"{m['kl_max']:.6f}; top-1 agreement {m['top1_agreement']:.2%}"
        )
        if m["routing_agreement"]:
            agree = " ".join(f"{x:.3f}" for x in m["routing_agreement"])
            over = " ".join(f"{x:.3f}" for x in m["routing_overlap"])
            lines.append(f"routing agreement per MoE layer: {agree}")
            lines.append(f"routing overlap per MoE layer:   {over}")
    if "acc" in m:
        line = f"{task}: acc {m['acc']:.4f} +/- {m['acc_stderr']:.4f}"
        if "acc_norm" in m:
            line += f", acc_norm {m['acc_norm']:.4f} +/- {m['acc_norm_stderr']:.4f}"
        lines.append(line + f" over {_count(result['n'], 'item')}")
    if "acc_delta" in m:
        line = (
            f"reference: acc {m['reference_acc']:.4f} (delta {m['acc_delta']:+.4f} +/- "
            f"{m['acc_delta_stderr']:.4f})"
        )
        if "acc_norm_delta" in m:
            line += (
                f", acc_norm {m['reference_acc_norm']:.4f} (delta {m['acc_norm_delta']:+.4f} "
                f"+/- {m['acc_norm_delta_stderr']:.4f})"
            )
        line += f"; same prediction on {m['pred_agreement']:.2%} of items"
        lines.append(line)
    lines.append(
        f"[{s['tokens']} tokens in {s['seconds']:.1f} s, {s['tokens_per_second']:.1f} tok/s; "
        f"hit rate {s['hit_rate']:.1%}; read {s['bytes_read'] / 2**20:.1f} MiB]"
    )
    return "\n".join(lines)


async def _eval(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise EvalError("--limit must be at least 1")
    path = Path(args.model) if args.model else run_cmd.DEMO_STORE
    if args.json is not None:  # where the results go: checked before the eval runs
        folder = args.json.parent
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            raise EvalError(f"--json {args.json}: {folder} is not a writable folder")
        if args.json.is_dir():
            raise EvalError(f"--json {args.json}: is a directory (give a file name)")
    # read the inputs before loading any weights: a bad file fails at once
    text, docs, fewshot = None, None, None
    if args.task == "perplexity":
        text = read_text(args.data)
    else:
        docs = read_records(args.data)
        if args.limit is not None:
            docs = docs[: args.limit]
        if args.shots:
            fewshot_path = _fewshot_path(args)
            fewshot = read_records(fewshot_path)
        fewshot_source = str(fewshot_path) if args.shots else ""
        # validates every item's fields now
        build_requests(
            args.task, docs, str(args.data), shots=args.shots, fewshot_docs=fewshot or [],
            fewshot_source=fewshot_source,
        )  # fmt: skip
    if args.task == "perplexity" and args.n_ctx is not None and args.n_ctx < 4:
        raise EvalError(f"--ctx {args.n_ctx}: a perplexity window needs at least 4 tokens")
    if args.reference:  # a bad reference fails before any weights load, naming the option
        try:
            open_store(args.reference)
        except ColibriError as exc:
            raise EvalError(f"--reference: {exc}") from None
    opts = _engine_options(args)
    async with AsyncExitStack() as stack:
        engine = await stack.enter_async_context(open_engine(path, **opts))
        run_cmd.check_ctx(engine, args)
        reference = None
        if args.reference:
            ref_opts = opts | {"trace": None}
            reference = await stack.enter_async_context(open_engine(args.reference, **ref_opts))
            scoring.check_same_model(engine, reference, args.reference)
        if args.task == "perplexity":
            assert text is not None
            try:
                result = await eval_perplexity(
                    engine, text, opts["n_ctx"], reference=reference, limit=args.limit
                )
            except EvalError as exc:  # "the text has 6 tokens, ...": say which text
                raise EvalError(f"--data {args.data}: {exc}") from None
        else:
            assert docs is not None
            result = await eval_choice(
                engine, args.task, docs, str(args.data), shots=args.shots, fewshot_docs=fewshot,
                fewshot_source=fewshot_source, reference=reference,
            )  # fmt: skip
    out = {"task": args.task, "store": str(path), **result}
    if args.reference:
        out["reference"] = str(args.reference)
    print(summary(args.task, out))
    if args.json is not None:
        write_json(args.json, out)
    return 0


def run_cli(args: argparse.Namespace) -> int:
    return asyncio.run(_eval(args))
