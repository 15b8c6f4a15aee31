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


def test_outcome_says_did_not_finish_for_a_timed_out_peer():
    assert sec_llama.outcome(1, 1, 0, 0, 900) == "ok"
    assert sec_llama.outcome(1, 0, 0, 1, 900) == "did not finish in 900 s"
    assert sec_llama.outcome(3, 1, 0, 2, 300.0) == "did not finish in 300 s (2×)"
    assert sec_llama.outcome(2, 0, 2, 0, 900) == "killed by the OOM killer (2×)"
    assert sec_llama.outcome(2, 1, 0, 0, 900) == "failed 1/2"


def test_run_capped_ends_the_whole_process_group(tmp_path):
    """A peer past its wall-clock limit is ended with every process it started (here a shell
    whose child ignores SIGTERM, as a thrashing process may not get to handle it); what it
    wrote before is kept; a run within the limit is untouched."""
    import time
    from pathlib import Path

    from colibri.bench import llama_cpp

    pidfile = tmp_path / "child.pid"
    script = (
        f"(trap '' TERM; echo $BASHPID > {pidfile}; exec sleep 60) & echo started; sleep 60; wait"
    )
    t0 = time.monotonic()
    res, timed_out = llama_cpp.run_capped(["bash", "-c", script], 1.0)
    assert timed_out and res.returncode != 0
    assert time.monotonic() - t0 < 20
    assert res.stdout == "started\n"
    stat = Path(f"/proc/{int(pidfile.read_text())}/stat")
    deadline = time.monotonic() + 10
    # the grandchild that ignored SIGTERM ends too (SIGKILL): gone, or a zombie left to init
    while _state(stat) not in ("", "Z", "X"):
        assert time.monotonic() < deadline, f"{stat}: state {_state(stat)}"
        time.sleep(0.05)
    res, timed_out = llama_cpp.run_capped(["bash", "-c", "echo done; exit 3"], 30)
    assert not timed_out and (res.returncode, res.stdout) == (3, "done\n")


def _state(stat) -> str:
    """The state letter in /proc/PID/stat ("" once the process is gone)."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""
