"""lm-evaluation-harness against a real `colibri serve`: `lm_eval --model local-completions`
(lm_eval 0.4.13, its own CLI in a subprocess) scores a slice of HellaSwag (../shared/data/eval)
through the server's /v1/completions `echo` logprobs; its per-choice log-likelihoods, acc and
acc_norm must equal `colibri eval`'s on the same items and the same store.

The task is lm_eval's own hellaswag.yaml (`include:`d, so its prompts, preprocessing and
metrics), pointed at a local JSON-lines file: nothing is downloaded.
"""

from __future__ import annotations

import json
import lzma
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from colibri.cli import main
from tests.serve_util import DEMO, SHARED, free_port

lm_eval = pytest.importorskip("lm_eval")
httpx = pytest.importorskip("httpx2")
HELLASWAG = next(
    (p / "shared" / "data" / "eval" / "hellaswag_validation.jsonl.xz"
     for p in Path(__file__).resolve().parents[2:4]
     if (p / "shared" / "data" / "eval").is_dir()),
    SHARED / "eval" / "hellaswag_validation.jsonl.xz",
)  # fmt: skip
N_ITEMS = 8


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise AssertionError(f"colibri serve exited: {proc.stderr.read()}")
        assert time.monotonic() < deadline, "colibri serve did not start"
        time.sleep(0.2)


def test_lm_eval_local_completions_equals_colibri_eval(tmp_path):
    if not HELLASWAG.exists():
        pytest.skip(f"shared data missing: {HELLASWAG}")
    with lzma.open(HELLASWAG, "rt") as f:
        lines = [next(f) for _ in range(N_ITEMS)]
    data = tmp_path / "hellaswag_slice.jsonl"
    data.write_text("".join(lines))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    builtin = Path(lm_eval.__file__).parent / "tasks" / "hellaswag" / "hellaswag.yaml"
    (tasks / "hellaswag_slice.yaml").write_text(
        f"include: {builtin}\n"
        "task: colibri_hellaswag_slice\n"
        "tag: []\n"
        "dataset_path: json\n"
        "dataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    validation: {data}\n"
        "training_split: null\n"
        "validation_split: validation\n"
    )

    # colibri eval on the same items and store (the demo model, its default options)
    ours_json = tmp_path / "colibri.json"
    assert main(["eval", "--task", "hellaswag", "--data", str(data), "--io", "threads",
                 "--json", str(ours_json)]) == 0  # fmt: skip
    ours = json.loads(ours_json.read_text())
    assert ours["n"] == N_ITEMS

    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets"),
           "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    serve = subprocess.Popen(
        [sys.executable, "-m", "colibri", "serve", "--port", str(port), "--io", "threads"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, serve)
        # the demo's tokenizer adds BOS, as HFLM (and colibri eval) encode: add_bos_token=True
        model_args = ",".join([
            f"base_url={url}/v1/completions", "model=colibri-demo", f"tokenizer={DEMO}",
            "tokenizer_backend=huggingface", "add_bos_token=True",
        ])  # fmt: skip
        out = tmp_path / "lm_eval_out"
        res = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions",
             "--model_args", model_args, "--tasks", "colibri_hellaswag_slice",
             "--include_path", str(tasks), "--output_path", str(out), "--log_samples"],
            capture_output=True, text=True, env=env, timeout=600,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
    finally:
        serve.terminate()
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    theirs = results["results"]["colibri_hellaswag_slice"]
    samples = [json.loads(line) for line in next(out.rglob("samples_*.jsonl")).open()]
    samples.sort(key=lambda s: s["doc_id"])
    assert len(samples) == N_ITEMS
    for item, s in zip(ours["items"], samples, strict=True):
        lls = [float(r[0]) for r in s["filtered_resps"]]
        np.testing.assert_allclose(item["logprobs"], lls, rtol=1e-5, err_msg=f"doc {s['doc_id']}")
        assert float(item["pred"] == item["gold"]) == s["acc"]
        assert float(item["pred_norm"] == item["gold"]) == s["acc_norm"]
    m = ours["metrics"]
    assert m["acc"] == pytest.approx(theirs["acc,none"], abs=1e-12)
    assert m["acc_norm"] == pytest.approx(theirs["acc_norm,none"], abs=1e-12)
    assert m["acc_stderr"] == pytest.approx(theirs["acc_stderr,none"], rel=1e-9)
