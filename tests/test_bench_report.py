"""The `colibri bench` report writer and run order (colibri/bench/report.py, suite.py): ratios
in the headline table, interleaved A/B order, the files written, and bad arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colibri.bench.report import Context, Headline, Section, interleave, median, write_report


def test_interleave_alternates_order_and_keeps_values():
    calls: list[str] = []
    values = {"a": iter([1.0, 2.0, 3.0]), "b": iter([10.0, 20.0, 30.0])}

    def runner(name: str):
        def run() -> float:
            calls.append(name)
            return next(values[name])

        return run

    out = interleave({"a": runner("a"), "b": runner("b")}, rounds=3)
    assert calls == ["a", "b", "b", "a", "a", "b"]  # drift spread over both contestants
    assert out == {"a": [1.0, 2.0, 3.0], "b": [10.0, 20.0, 30.0]}
    assert median(out["b"]) == 20.0
    assert median([None, 4.0, 2.0]) == 3.0
    assert median([]) is None


def test_write_report_headline_ratios_and_json(tmp_path: Path):
    ctx = Context(out=tmp_path, work=tmp_path, quick=True, threads=2, rounds=2)
    ctx.record(["fio", "--name=x", "--bs=4096"])
    head = Headline("Decode, fits", "tok/s", 30.0, peer=24.0, limit=60.0, limit_name="bw bound")
    missing = Headline("Decode, no peer", "tok/s", 5.0)
    sec = Section("demo", "Demo section", "body text", data={"x": 1}, headlines=[head, missing])
    failed = Section("bad", "Broken section", "", error="RuntimeError('disk full')")
    machine = {"date": "d", "cpu": "c", "cores": 2, "isa": ["avx2"], "colibri_isa": "avx2",
               "ram_gib": 1.0, "disk": {}, "kernel": "k", "colibri_commit": "abc"}  # fmt: skip
    path = write_report(ctx, machine, [sec, failed])
    md = path.read_text()
    row = next(line for line in md.splitlines() if line.startswith("| Decode, fits"))
    assert "1.25×" in row and "50%" in row and "60 (bw bound)" in row
    row = next(line for line in md.splitlines() if line.startswith("| Decode, no peer"))
    assert row.count("—") >= 3  # no peer, no ratio, no limit
    assert "**This section failed:** `RuntimeError('disk full')`" in md
    assert "fio --name=x --bs=4096" in md
    raw = json.loads((tmp_path / "results.json").read_text())
    assert raw["headlines"][0]["ratio_peer"] == pytest.approx(1.25)
    assert raw["headlines"][0]["ratio_limit"] == pytest.approx(0.5)
    assert raw["sections"]["demo"]["data"] == {"x": 1}
    assert not list(tmp_path.glob("*.tmp"))  # written to a temporary, then renamed


def test_cli_rejects_unknown_section(capsys):
    from colibri.cli import main

    assert main(["bench", "--sections", "limits,nope", "--out", "/nonexistent/x"]) == 2
    assert "unknown section" in capsys.readouterr().err


def test_tool_names_the_missing_checkout_script(monkeypatch, tmp_path):
    from colibri.bench import report

    assert report.tool("synth_store.py").endswith("tools/synth_store.py")
    monkeypatch.setattr(report, "ROOT", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"tools/synth_store\.py not found.*checkout"):
        report.tool("synth_store.py")
