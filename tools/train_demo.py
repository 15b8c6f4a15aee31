"""Train colibri's embedded demo model: a tiny Mixtral (8 experts, top-2) on Python's own docs.

Usage::

    nice .venv/bin/python tools/train_demo.py --out /work/demo/hf [--steps N] [--fused-out DIR]

Writes a Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, chat_template.jinja, generation_config.json) that `colibri convert`
turns into the store shipped at ``colibri/data/demo/``. The run is deterministic for a given
Python, torch and transformers version (fixed seed, one thread); it prints the loss, the
final train/validation loss and sample generations from transformers' ``generate()``.

Text and license
    * ``pydoc_data.topics.topics``: the Python Language Reference / Library topics that
      CPython bundles for ``help()`` (about 0.47 MB for Python 3.11).
    * docstrings (``inspect.getdoc``) of the standard-library modules listed in ``MODULES``,
      their public classes, functions and methods (about 0.6 MB).
    * the Zen of Python (``this.s``, ROT13-decoded).
    All of it is part of CPython, copyright the Python Software Foundation, distributed under
    the PSF License Agreement (Python Software Foundation License Version 2); the
    documentation text is additionally covered by the PSF documentation license terms, which
    allow redistribution of derived works with the copyright notice. The text therefore depends
    on the Python version that runs this script (3.11 for the shipped model).

    About one example in ten is also rendered as a ChatML conversation ("What is <topic>?" ->
    the topic's first paragraphs), so ``colibri chat`` on the demo answers in kind.

Model
    ``MixtralForCausalLM`` (model_type "mixtral"): hidden 192, 4 layers, 4 attention heads of
    48 with 2 KV heads (GQA), 8 experts of intermediate size 320, top-2 routing with the
    load-balancing auxiliary loss (Switch Transformer, Fedus et al. 2021, eq. 4; transformers'
    ``load_balancing_loss_func``), untied embeddings, byte-level BPE vocabulary of 2048.
    In q8_0 the converted store is about 7.6 MB (32 expert records of 192 KiB + 1.3 MB dense).

Training
    AdamW (beta2 0.95, weight decay 0.1), linear warm-up then cosine decay to 10 % (as in
    Chinchilla / Llama), gradient clipping at 1.0, random windows of ``--seq-len`` tokens from
    the concatenated training documents, 5 % of the documents held out for validation.
    One step (8 x 192 tokens) costs about 1.2 s of one AVX2 core, so the default 1500 steps
    (the shipped colibri/data/demo: val loss 2.93 nats/token) take about 30 minutes on an idle
    thread. ``training.json`` in the output records the
    arguments and the final losses of the run that produced it.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import importlib
import inspect
import io
import json
import math
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GenerationConfig,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
)

BOS, EOS, IM_START, IM_END = "<s>", "</s>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MODULES = """builtins os os.path itertools functools collections json re string math random
datetime pathlib typing dataclasses enum abc io contextlib heapq bisect textwrap shutil
subprocess argparse logging unittest asyncio threading socket csv sqlite3 decimal fractions
statistics inspect operator copy pickle struct zipfile tarfile hashlib time calendar html
urllib.parse http.client xml.etree.ElementTree tempfile glob fnmatch queue sched selectors
signal codecs unicodedata difflib pprint reprlib weakref types array base64 binascii zlib gzip
bz2 lzma configparser tomllib secrets uuid ipaddress concurrent.futures multiprocessing
traceback warnings doctest timeit""".split()  # noqa: SIM905


def _first_paragraphs(text: str, max_chars: int = 600) -> str:
    """Leading paragraphs of ``text`` (split on blank lines) up to about ``max_chars``."""
    out: list[str] = []
    for para in text.strip().split("\n\n"):
        if out and sum(map(len, out)) + len(para) > max_chars:
            break
        out.append(para.strip())
    return "\n\n".join(out)


def build_corpus() -> tuple[list[str], list[list[dict[str, str]]]]:
    """Collect the training text that ships with CPython.

    Returns:
        (documents, conversations): plain-text documents in a fixed order, and ChatML
        conversations (lists of {"role", "content"}) built from the same documents.
    """
    from pydoc_data.topics import topics

    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (prints the Zen on first import; its text is this.s)

    docs: list[str] = []
    chats: list[list[dict[str, str]]] = []
    for key in sorted(topics):
        text = topics[key].strip()
        docs.append(text)
        title = text.split("\n", 1)[0].strip()
        body = text.split("\n", 2)[2] if text.count("\n") >= 2 else text
        if body.strip():
            q = f"What is {title[0].lower() + title[1:]}?" if title else f"What is {key}?"
            chats.append(_chat(q, _first_paragraphs(body)))
    docs.append(codecs.decode(sys.modules["this"].s, "rot13"))

    seen: set[str] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for modname in MODULES:
            mod = importlib.import_module(modname)
            items = [(modname, mod)]
            for name in sorted(vars(mod)):
                obj = getattr(mod, name)
                if name.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
                    continue
                items.append((f"{modname}.{name}", obj))
                if inspect.isclass(obj):
                    for attr in sorted(vars(obj)):
                        meth = getattr(obj, attr, None)
                        if not attr.startswith("_") and inspect.isroutine(meth):
                            items.append((f"{modname}.{name}.{attr}", meth))
            for qualname, obj in items:
                doc = inspect.getdoc(obj)
                if not doc or len(doc) < 80 or doc in seen:
                    continue
                seen.add(doc)
                docs.append(f"{qualname}\n\n{doc}")
                if len(seen) % 8 == 0:
                    chats.append(_chat(f"What does {qualname} do?", _first_paragraphs(doc)))
    return docs, chats


def _chat(question: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def train_tokenizer(docs: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style) trained with `tokenizers` on ``docs``; adds BOS on encode."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=None,
        pad_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def make_config(tokenizer: PreTrainedTokenizerFast) -> MixtralConfig:
    """The demo's MixtralConfig (sizes in the module docstring)."""
    return MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=192,
        intermediate_size=320,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
        max_position_embeddings=1024,
        num_local_experts=8,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
        use_cache=True,
    )


def encode_stream(tok: PreTrainedTokenizerFast, docs: list[str], chats: list) -> torch.Tensor:
    """Concatenate ``<s> doc </s>`` and rendered conversations into one int64 token stream."""
    ids: list[int] = []
    for enc in tok.backend_tokenizer.encode_batch(docs):  # the post-processor prepends <s>
        ids += [*enc.ids, tok.eos_token_id]
    for c in chats:
        ids += tok.apply_chat_template(c, tokenize=True, return_dict=False)
    return torch.tensor(ids, dtype=torch.int64)


def split(docs: list, every: int = 20) -> tuple[list, list]:
    """Deterministic train/validation split: every ``every``-th item goes to validation."""
    return [d for i, d in enumerate(docs) if i % every != 7], docs[7::every]


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay from ``peak`` to ``peak / 10``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def evaluate(model: MixtralForCausalLM, stream: torch.Tensor, seq_len: int, n: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over up to ``n`` consecutive windows of ``stream``."""
    model.eval()
    starts = range(0, min(len(stream) - seq_len, n * seq_len), seq_len)
    x = torch.stack([stream[s : s + seq_len] for s in starts])
    loss = model(input_ids=x, labels=x, output_router_logits=False).loss
    model.train()
    return float(loss)


def save_atomic(out: str, save) -> None:
    """Run ``save(tmpdir)`` next to ``out`` then rename it over ``out`` (no half-written dir)."""
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".train_demo.", dir=parent)
    try:
        save(tmp)
        os.chmod(tmp, 0o755)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--fused-out", help="also save the fused (save_original_format=False) layout")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=192)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--experts-implementation", default="eager")
    p.add_argument("--samples", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    docs, chats = build_corpus()
    train_docs, val_docs = split(docs)
    train_chats, val_chats = split(chats)
    tok = train_tokenizer(train_docs, args.vocab_size)
    train = encode_stream(tok, train_docs, train_chats)
    val = encode_stream(tok, val_docs, val_chats)
    nchars = sum(map(len, docs))
    print(
        f"corpus: {len(docs)} documents, {len(chats)} conversations, {nchars / 1e6:.2f} M chars;"
        f" tokens train {len(train)} val {len(val)}; {time.time() - t0:.1f} s",
        flush=True,
    )

    config = make_config(tok)
    config._experts_implementation = args.experts_implementation
    model = MixtralForCausalLM(config)
    model.train()
    nparams = sum(p.numel() for p in model.parameters())
    print(f"model: {nparams / 1e6:.2f} M parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    warmup = max(1, args.steps // 20)
    t0 = time.time()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, warmup)
        starts = torch.randint(0, len(train) - args.seq_len - 1, (args.batch_size,), generator=gen)
        x = torch.stack([train[s : s + args.seq_len] for s in starts.tolist()])
        out = model(input_ids=x, labels=x)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            aux = out.aux_loss.item()
            lm = out.loss.item() - config.router_aux_loss_coef * aux
            print(
                f"step {step:5d}  lr {opt.param_groups[0]['lr']:.2e}  loss {lm:.3f}"
                f"  aux {aux:.3f}  {time.time() - t0:6.0f} s",
                flush=True,
            )
    train_loss = evaluate(model, train, args.seq_len)
    val_loss = evaluate(model, val, args.seq_len)
    print(f"final: train loss {train_loss:.3f}  val loss {val_loss:.3f} (nats/token)")

    model.eval()
    gcfg = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids(IM_END)],
        pad_token_id=tok.pad_token_id,
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        max_new_tokens=256,
    )
    model.generation_config = gcfg
    if args.samples:
        report_samples(model, tok)

    def save(d: str, original: bool = True) -> None:
        model.save_pretrained(d, save_original_format=original)
        tok.save_pretrained(d)
        # transformers 5 writes the template to chat_template.jinja; older readers look here.
        path = os.path.join(d, "tokenizer_config.json")
        with open(path) as f:
            tcfg = json.load(f)
        with open(path, "w") as f:
            json.dump({**tcfg, "chat_template": CHAT_TEMPLATE}, f, indent=2)
        with open(os.path.join(d, "training.json"), "w") as f:
            json.dump({**vars(args), "train_loss": train_loss, "val_loss": val_loss}, f, indent=1)

    save_atomic(args.out, save)
    if args.fused_out:
        save_atomic(args.fused_out, lambda d: save(d, original=False))
    print(f"saved {args.out}" + (f" and {args.fused_out}" if args.fused_out else ""))


@torch.no_grad()
def report_samples(model: MixtralForCausalLM, tok: PreTrainedTokenizerFast) -> None:
    """Print greedy and sampled continuations of a few prompts, and one chat answer."""
    for prompt in ["The for statement", "A list comprehension", "The with statement"]:
        x = tok(prompt, return_tensors="pt")
        for sample in (False, True):
            torch.manual_seed(0)
            y = model.generate(**x, do_sample=sample, max_new_tokens=60)
            text = tok.decode(y[0], skip_special_tokens=True)
            print(f"--- {'sampled' if sample else 'greedy'}: {text!r}")
    msgs = [{"role": "user", "content": "What is the while statement?"}]
    x = tok.apply_chat_template(
        msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    y = model.generate(**x, do_sample=False, max_new_tokens=80)
    print(f"--- chat greedy: {tok.decode(y[0, x['input_ids'].shape[1] :])!r}")


if __name__ == "__main__":
    main()
