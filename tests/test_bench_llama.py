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


def test_prefill_breakdown_names_the_parts_where_colibri_is_slower():
    split = {"routed experts": 0.6, "attention core (QK^T, softmax, PV)": 0.3, "router": 0.0,
             "other (Python, gathers, residual sums, thread hand-offs)": 0.1}  # fmt: skip
    runs = [{"pp_by_n": {64: {"tok_s": 200.0, "breakdown_s": split},
                         512: {"tok_s": 512.0, "breakdown_s": split}}}]  # fmt: skip
    lines = sec_llama.prefill_breakdown(runs, {64: 100.0, 512: 1024.0}, (64, 512), "colibri")
    assert len(lines) == 1  # faster than the peer at 64 tokens: nothing to explain there
    assert lines[0].startswith("Where colibri's 512-token prefill time goes (colibri, last")
    assert "1000 ms; llama.cpp takes 500 ms (0.50×)" in lines[0]
    assert ("routed experts 600 ms (60%), attention core (QK^T, softmax, PV) 300 ms (30%), "
            "other (Python, gathers, residual sums, thread hand-offs) 100 ms (10%)."
            in lines[0])  # fmt: skip
    assert "router" not in lines[0]  # parts that took no time are left out
    with_rate = sec_llama.prefill_breakdown(runs, {512: 1024.0}, (512,), "colibri", 10**9)
    assert with_rate[0].endswith("The routed experts ran at 853 GMAC/s (wall).\n")  # 512/0.6
    # 4 MoE layers, the last one on the last token only: (3 * 512 + 1) / 4 tokens' worth
    kept = sec_llama.prefill_breakdown(runs, {512: 1024.0}, (512,), "c", 4 * 10**9, None, 4)
    assert kept[0].endswith("The routed experts ran at 2562 GMAC/s (wall).\n")  # 1537/0.6
    one = sec_llama.prefill_breakdown(runs, {512: 1024.0}, (512,), "c", 10**9, None, 1)
    assert "GMAC/s" not in one[0]  # one MoE layer: one token's matvec, no GEMM rate
    # no peer: every size is explained
    assert len(sec_llama.prefill_breakdown(runs, {}, (64, 512), "colibri")) == 2
    assert sec_llama.pp_at(runs[0], 512) == 512.0
    assert sec_llama.pp_at({"pp_by_n": {512: 900.0}}, 512) == 900.0  # llama.cpp's form
    assert sec_llama.pp_at(runs[0], 2048) is None


def test_decode_breakdown_states_each_weight_part_rate():
    split = {"routed experts": 0.004, "LM head": 0.002, "router": 0.0,
             "other (Python, gathers, residual sums, thread hand-offs)": 0.001}  # fmt: skip
    sf = {"experts_nbytes_per_token": 80_000_000, "lm_head_nbytes": 30_000_000,
          "attention_nbytes": 1, "active_bytes_per_token": 120_000_000}  # fmt: skip
    line = sec_llama.decode_breakdown(split, sf, 40.0, "colibri")
    assert (
        "7.00 ms a token; at the read bound (40.0 GB/s) the weight reads alone take 3.00 ms" in line
    )
    # 80 MB in 4 ms = 20 GB/s = half of 40; 30 MB in 2 ms = 15 GB/s
    assert "routed experts 4.00 ms (57%) at 20.0 GB/s = 50% of the read bound" in line
    assert "LM head 2.00 ms (29%) at 15.0 GB/s = 38% of the read bound" in line
    assert "other (Python, gathers, residual sums, thread hand-offs) 1.00 ms (14%)." in line
    assert "router" not in line
    assert "read bound" not in sec_llama.decode_breakdown(split, sf, None, "colibri")


def test_part_timer_splits_a_real_prefill(tmp_path):
    """The child's breakdown on a tiny converted Mixtral: the parts and the rest add up to the
    pass, the routed experts and attention took time, and uninstall restores the functions."""
    import asyncio
    import time

    from colibri import model
    from colibri.compute import ops
    from colibri.convert import convert
    from colibri.engine import open_engine
    from tests import hf_models

    hf_models.save_with_tokenizer("mixtral", tmp_path / "hf", seed=2)
    convert(tmp_path / "hf", tmp_path / "store", quant="q8_0", dense_quant="q8_0")
    before = (model.Model.expert_ffn, model.Model.attention, ops.attention)

    async def run() -> tuple[dict[str, float], float]:
        async with open_engine(tmp_path / "store", budget=1 << 30, threads=1) as eng:
            timer = sec_llama.PartTimer()
            try:
                t0 = time.perf_counter()
                await eng.forward(eng.new_sequence(), list(range(3, 40)))
                total = time.perf_counter() - t0
                return timer.split(total), total
            finally:
                timer.uninstall()

    split, total = asyncio.run(run())
    assert set(sec_llama.PARTS) < set(split)
    assert abs(sum(split.values()) - total) < 1e-6 * max(1.0, total)
    assert all(v >= 0 for v in split.values())
    assert split["routed experts"] > 0 and split["attention core (QK^T, softmax, PV)"] > 0
    assert split["attention (projections, norm, RoPE)"] > 0 and split["LM head"] > 0
    assert (model.Model.expert_ffn, model.Model.attention, ops.attention) == before


def test_best_peer_takes_the_fastest_peer_per_figure():
    """Decode and each prefill size are compared with whichever peer is fastest at that figure;
    colibri's own rows are never a peer."""
    med = {
        "llama.cpp": {"tg": 40.0, "pp": 300.0, "pp_by_n": {64: 300.0, 512: 1200.0}},
        "ik_llama.cpp (-rtr 1)": {"tg": 38.0, "pp": 500.0, "pp_by_n": {64: 500.0, 512: None}},
        "colibri (q8_0 activations)": {"tg": 99.0, "pp": 999.0, "pp_by_n": {64: 999.0}},
    }
    peer, names = sec_llama.best_peer(med)
    assert peer == {"tg": 40.0, "pp": 500.0, "pp_by_n": {64: 500.0, 512: 1200.0}}
    assert names == {"tg": "llama.cpp", "pp": "ik_llama.cpp (-rtr 1)",
                     64: "ik_llama.cpp (-rtr 1)", 512: "llama.cpp"}  # fmt: skip
    assert sec_llama.best_peer(
        {"colibri (f32 activations)": med["colibri (q8_0 activations)"]}
    ) == (
        {"tg": None, "pp": None, "pp_by_n": {}},
        {},
    )


def test_ik_commit_reads_what_the_build_script_recorded(tmp_path):
    (tmp_path / "bin").mkdir()
    assert sec_llama.ik_commit(tmp_path / "bin") is None and sec_llama.ik_commit(None) is None
    (tmp_path / "COMMIT").write_text("8337e4cd3861406fc04e0854b1409cd1b027fbc9\n")
    assert sec_llama.ik_commit(tmp_path / "bin") == "8337e4cd3861"


def test_per_layer_tok_s_is_the_extra_layers_rate():
    """n tokens: an overhead of a s plus c s per full layer; the L- and (L + 1)-layer models'
    tok/s give back n / c, the rate of one full layer, whatever the overhead."""
    n, a, c = 512, 0.03, 0.4
    for layers in (1, 2, 5):
        small, big = n / (a + layers * c), n / (a + (layers + 1) * c)
        assert sec_llama.per_layer_tok_s(small, big) == pytest.approx(n / c, rel=1e-12)
    # a peer that runs almost nothing of the last layer: its 1-layer tok/s says nothing about
    # a full layer, the difference does
    assert sec_llama.per_layer_tok_s(2000.0, 100.0) == pytest.approx(1 / (1 / 100 - 1 / 2000))
    assert sec_llama.per_layer_tok_s(None, 100.0) is None
    assert sec_llama.per_layer_tok_s(100.0, 0.0) is None
    assert sec_llama.per_layer_tok_s(100.0, 100.0) is None  # not slower: noise, no figure


def test_child_decodes_after_a_context_of_depth_tokens(tmp_path, capsys):
    """The colibri child's --depth: the timed decode starts after a context of exactly that
    many tokens (llama-bench's -d / ik_llama.cpp's -gp), and the store's KV geometry gives the
    bound's KV bytes per token."""
    import json

    from colibri.convert import convert
    from tests import hf_models

    hf_models.save_with_tokenizer("mixtral", tmp_path / "hf", seed=2)
    convert(tmp_path / "hf", tmp_path / "store", quant="q8_0", dense_quant="q8_0")
    args = [str(tmp_path / "store"), "--budget", str(1 << 30), "--threads", "1", "--n-ctx",
            "128", "--n-gen", "3", "--depth", "100", "--activations", "q8_0"]  # fmt: skip
    assert sec_llama.child_main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_prompt_decode"] == 100 and out["tg_tok_s"] > 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert sec_llama.store_figures(tmp_path / "store")["kv_dim"] == (
        cfg["num_key_value_heads"] * head_dim
    )


def test_thrash_note_bounds_a_peer_the_clock_ended():
    """A peer ended by the wall clock made fewer than N tokens in T s: its cell says < N / T
    tok/s and how much it read; a peer that failed otherwise keeps its outcome."""
    m = {"timeouts": 1, "runs": 1, "ok": 0, "oom_kills": 0, "read_bytes": 43_210_000_000}
    assert sec_llama.thrash_note(m, 6, 120.0) == (
        "< 0.05 tok/s (did not finish 6 tokens in 120 s; read 43 GB)"
    )
    m |= {"timeouts": 0, "oom_kills": 1}
    assert sec_llama.thrash_note(m, 6, 120.0) == "killed by the OOM killer (1×)"


def test_run_capped_counts_what_the_process_group_read_from_storage(tmp_path):
    """run_capped's stats: the storage bytes its processes read (/proc/PID/io), here a child
    reading a 32 MiB file whose page cache was dropped first."""
    import os
    import sys
    import tempfile
    from pathlib import Path

    from colibri.bench import llama_cpp

    with open("/proc/mounts") as f:
        mounts = [ln.split() for ln in f]

    def fstype(p: Path) -> str:
        return max((m for m in mounts if str(p).startswith(m[1])), key=lambda m: len(m[1]))[2]

    # a directory on storage: tmp_path, else /var/tmp or the checkout (a tmpfs /tmp has none)
    dirs = [tmp_path, Path("/var/tmp"), Path(__file__).resolve().parent]
    where = next((d for d in dirs if fstype(d.resolve()) not in ("tmpfs", "ramfs")), None)
    if where is None:
        pytest.skip(f"none of {dirs} is on storage: no storage reads to count")
    with tempfile.TemporaryDirectory(dir=where) as d:
        path = Path(d) / "blob.bin"
        path.write_bytes(os.urandom(32 << 20))
        llama_cpp.drop_file_cache(path)
        code = f"import time; open({str(path)!r}, 'rb').read(); time.sleep(1.5)"
        stats: dict = {}
        res, timed_out = llama_cpp.run_capped([sys.executable, "-c", code], 30, stats=stats)
    assert not timed_out and res.returncode == 0
    assert stats["read_bytes"] >= 0.9 * (32 << 20)


def test_run_capped_survives_output_that_is_not_utf8():
    """A peer generating with random weights prints any bytes (half a UTF-8 character, 0xf3
    alone): its output is kept with the bytes replaced, not a UnicodeDecodeError."""
    import sys

    from colibri.bench import llama_cpp

    code = "import sys; sys.stdout.buffer.write(b'ok \\xf3 \\xe6\\x8b end')"
    res, timed_out = llama_cpp.run_capped([sys.executable, "-c", code], 30)
    assert not timed_out and res.returncode == 0
    assert res.stdout == "ok \ufffd \ufffd end"
