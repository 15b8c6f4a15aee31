"""`colibri eval`: measured quality of a store. Sits above the engine and uses only its
public API (Engine.forward_batch with all_logits, Engine.capture_routing, Sequence.fork).

- perplexity (llama.cpp's llama-perplexity method) and, against a reference store of the same
  model, per-token KL divergence, top-1 agreement and routing agreement per MoE layer;
- multiple choice (arc_easy, arc_challenge, hellaswag, mmlu, piqa, winogrande, boolq, sciq,
  openbookqa) with lm-evaluation-harness's prompts, request tokenization and acc / acc_norm.

Modules: data.py (local inputs), tasks.py (prompt strings), scoring.py (log-likelihoods,
perplexity, metrics), cli.py (the command and its JSON).
"""

from colibri.eval.data import EvalError
from colibri.eval.scoring import (
    continuation_logprobs,
    encode_pair,
    perplexity,
    score_items,
    score_requests,
)

__all__ = [
    "EvalError",
    "continuation_logprobs",
    "encode_pair",
    "perplexity",
    "score_items",
    "score_requests",
]
