"""colibri/bench/sec_llama.py figures that need no llama.cpp, disk or timing: the weight bytes one
decoded token reads (checked against Mixtral-8x7B's published 12.9B active parameters) and the
expert budget that fits under a memory limit."""

import pytest

from colibri.bench import sec_llama


def _mixtral_8x7b_params() -> tuple[dict[str, int], int]:
    """Parameter counts of Mixtral-8x7B's dense tensors (HF names) and of one expert."""
    d, d_ff, vocab, kv, experts = 4096, 14336, 32000, 1024, 8
    dense = {"model.embed_tokens.weight": vocab * d, "lm_head.weight": vocab * d,
             "model.norm.weight": d}  # fmt: skip
    for i in range(32):
        p = f"model.layers.{i}."
        dense |= {
            p + "self_attn.q_proj.weight": d * d,
            p + "self_attn.k_proj.weight": kv * d,
            p + "self_attn.v_proj.weight": kv * d,
            p + "self_attn.o_proj.weight": d * d,
            p + "block_sparse_moe.gate.weight": experts * d,
            p + "input_layernorm.weight": d,
            p + "post_attention_layernorm.weight": d,
        }
    return dense, 3 * d * d_ff


def test_active_bytes_matches_mixtral_active_parameters():
    dense, expert = _mixtral_8x7b_params()
    # one byte per parameter: the result counts parameters touched by one token
    active = sec_llama.active_bytes_per_token(
        dense, "model.embed_tokens.weight", 32000, 32, 2, expert
    )
    # Mistral AI: 12.9B active parameters per token, counting the whole embedding table
    with_embedding = active + dense["model.embed_tokens.weight"] - 4096
    assert with_embedding == pytest.approx(12.9e9, rel=0.005)
    # decoding reads one embedding row, not the table
    assert active == sum(dense.values()) - 31999 * 4096 + 32 * 2 * expert


def test_active_bytes_unknown_embedding_raises():
    with pytest.raises(KeyError):
        sec_llama.active_bytes_per_token({"a": 10}, "embed", 2, 1, 1, 1)


def test_colibri_budget_whole_records_under_the_limit():
    assert sec_llama.colibri_budget(1000, 300, 100, overhead=150) == 500
    assert sec_llama.colibri_budget(1000, 300, 120, overhead=150) == 480
    assert sec_llama.colibri_budget(1000, 800, 100, overhead=150) == 0
    assert sec_llama.colibri_budget(1000, 950, 100, overhead=150) == 0
