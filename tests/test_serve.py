"""`colibri serve` through the official openai and anthropic clients, on the demo model:
streaming == non-streaming == the engine's own output, concurrent == solo, usage and
logprobs, stop strings, errors in both styles, API key, disconnect, 429, body limit, batch,
metrics and SIGTERM draining."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import anthropic
import httpx2 as httpx
import openai
import pytest

from colibri import SyncEngine
from tests.serve_util import DEMO, SHARED, free_port, running_server

MODEL = "colibri-demo"
CHAT = [{"role": "user", "content": "Write a for statement"}]


@pytest.fixture(scope="module")
def server():
    with running_server(parallel=4) as srv:
        yield srv


@pytest.fixture(scope="module")
def engine():
    with SyncEngine(DEMO, io="threads") as eng:
        yield eng


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=30, max_retries=0)


def _engine_items(engine, prompt, **kw):
    return list(engine.stream(prompt, **kw))


def test_models_and_health(server, oai):
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("other-model")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert server.health()["status"] == "ok"


def test_a_huge_prompt_is_refused_while_the_server_keeps_serving(server, oai):
    """A prompt of megabytes takes seconds to render and tokenize: that runs off the event
    loop, so a small request sent after it is answered first; the big one gets the context
    error (with its token count), and one past what a template may render gets it at once."""
    big = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 150_000}]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:

        def huge() -> tuple[str, float]:
            with pytest.raises(openai.BadRequestError) as e:
                oai.chat.completions.create(model=MODEL, messages=big, max_tokens=2)
            return e.value.body, time.monotonic()

        fut = pool.submit(huge)
        time.sleep(0.5)  # the big request is being tokenized
        small = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
        small_done = time.monotonic()
        body, big_done = fut.result()
    assert small.choices[0].message.content is not None
    assert small_done < big_done
    assert body["code"] == "context_length_exceeded" and body["param"] == "messages"
    assert "tokens; this model's context length is" in body["message"], body
    huge = [{"role": "user", "content": "x" * (1 << 24)}, {"role": "user", "content": "y"}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=huge, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded", e.value.body
    assert "more than 16777216 characters" in e.value.body["message"]
    assert server.wait_idle()["leased"] == 0


def test_unknown_paths_and_methods_get_the_api_error_body(server):
    for method, path, status in [("GET", "/v1/nothing", 404), ("DELETE", "/v1/models", 405)]:
        r = httpx.request(method, server.url + path, timeout=30)
        assert r.status_code == status
        err = r.json()["error"]
        assert path in err["message"] and err["type"] == "invalid_request_error"
    r = httpx.get(server.url + "/v1/messages/nothing", timeout=30)
    assert r.status_code == 404 and r.json()["type"] == "error"  # Anthropic style there


def test_chat_streaming_equals_non_streaming_equals_engine(server, oai, engine):
    expected = engine.generate(CHAT, max_tokens=12, temperature=0)
    full = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert full.choices[0].message.content == expected
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == len(engine.engine.encode_prompt(CHAT))
    ext = full.usage.model_extra["colibri"]
    assert ext["expert_hits"] + ext["expert_reads"] > 0 and 0 <= ext["hit_rate"] <= 1
    chunks = list(
        oai.chat.completions.create(
            model=MODEL, messages=CHAT, max_completion_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completions_logprobs_stop_and_seed(server, oai, engine):
    prompt = "The for statement"
    items = _engine_items(engine, prompt, max_tokens=10, temperature=0, logprobs=3)
    expected = "".join(t.text for t in items)
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=3)
    c = r.choices[0]
    assert c.text == expected
    want = [t.logprob for t in items if t.token_id is not None]
    assert c.logprobs.token_logprobs == pytest.approx(want, abs=1e-9)
    for lp, top in zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs, strict=True):
        assert len(top) == 3 and max(top.values()) == pytest.approx(lp)  # greedy: the top one
    # a stop string from the middle of the greedy text ends the completion before it
    stop = expected.strip()[len(expected.strip()) // 2 :][:3]
    if stop:
        r = oai.completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stop=[stop]
        )
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].text == expected[: expected.find(stop)]
    # the same seed gives the same sampled tokens, and the engine's
    kw = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=7)
    a, b = oai.completions.create(**kw), oai.completions.create(**kw)
    sampled = engine.generate(prompt, max_tokens=8, temperature=1.0, seed=7)
    assert a.choices[0].text == b.choices[0].text == sampled


def test_completions_echo_scores_the_prompt(server, oai, engine):
    """echo + logprobs (+ max_tokens 0), as lm-evaluation-harness's local-completions uses
    it: the prompt's own token logprobs, checked against log-softmax of the engine's logits
    fed one token at a time."""
    import numpy as np

    from colibri.sampling import log_softmax

    prompt = "The for statement is used to iterate"
    ids = engine.engine.encode_prompt(prompt)
    r = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    c = r.choices[0]
    assert c.text == engine.engine.tokenizer.decode(ids)
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.token_logprobs) == len(ids)

    async def reference():
        seq = engine.engine.new_sequence()
        out = []
        for i, t in enumerate(ids[:-1]):
            logits = await engine.engine.forward(seq, [t])
            out.append(float(log_softmax(logits)[ids[i + 1]]))
        return out

    want = engine._call(reference())
    np.testing.assert_allclose(c.logprobs.token_logprobs[1:], want, rtol=1e-4, atol=1e-4)
    for lp, top in zip(c.logprobs.token_logprobs[1:], c.logprobs.top_logprobs[1:], strict=True):
        assert len(top) == 1 and max(top.values()) >= lp - 1e-9
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    r2 = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=0, temperature=0
    )
    plain = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    assert r2.choices[0].text == c.text + plain.choices[0].text
    assert len(r2.choices[0].logprobs.token_logprobs) == len(ids) + 3
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


def test_chat_logprobs(server, oai, engine):
    items = _engine_items(engine, CHAT, max_tokens=5, temperature=0, logprobs=2)
    r = oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx(
        [t.logprob for t in items if t.token_id is not None], abs=1e-9
    )
    assert all(len(e.top_logprobs) == 2 for e in content)


def test_concurrent_requests_equal_their_solo_runs(server, oai, engine):
    prompts = [
        [{"role": "user", "content": f"Question number {i}: what is a loop?"}] for i in range(4)
    ]
    solo = [engine.generate(p, max_tokens=10, temperature=0) for p in prompts]

    def ask(p):
        stream = oai.chat.completions.create(
            model=MODEL, messages=p, max_tokens=10, temperature=0, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, prompts))
    assert together == solo
    h = server.wait_idle()
    assert h["running"] == 0 and h["leased"] == 0


def test_anthropic_messages(server, engine):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", timeout=30, max_retries=0)
    msgs = [{"role": "user", "content": "Write a for statement"}]
    expected = engine.generate(
        [{"role": "system", "content": "Be brief."}, *msgs], max_tokens=9, temperature=0
    )
    r = client.messages.create(
        model=MODEL, max_tokens=9, messages=msgs, system="Be brief.", extra_body={"temperature": 0}
    )
    assert r.content[0].text == expected and r.stop_reason == "max_tokens"
    assert r.usage.output_tokens == 9
    ext = r.usage.model_extra["colibri"]  # the OpenAI endpoints' extension object
    assert ext["expert_hits"] + ext["expert_reads"] > 0 and 0 <= ext["hit_rate"] <= 1
    assert ext["ttft_seconds"] > 0 and ext["decode_tokens_per_second"] > 0
    with client.messages.stream(
        model=MODEL, max_tokens=9, messages=msgs, system="Be brief.", extra_body={"temperature": 0}
    ) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == expected and final.stop_reason == "max_tokens"
    stop = expected.strip()[2:5]
    if stop:
        r = client.messages.create(
            model=MODEL, max_tokens=9, messages=msgs, system="Be brief.",
            extra_body={"temperature": 0}, stop_sequences=[stop],
        )  # fmt: skip
        assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=4, messages=msgs)
    assert e.value.body["type"] == "error" and "nope" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=-3, messages=msgs)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    bad_use = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                                  "input": [1, 2]}]}]  # fmt: skip
    with pytest.raises(anthropic.BadRequestError, match="input must be an object"):
        client.messages.create(model=MODEL, max_tokens=2, messages=bad_use)


def test_bad_requests_get_4xx_and_the_server_goes_on(server, oai):
    url = server.url + "/v1/completions"
    r = httpx.post(url, content=b"{not json", timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    for body, param in (
        ({"model": MODEL, "prompt": "a", "max_tokens": "many"}, "max_tokens"),
        ({"model": MODEL, "prompt": "a", "max_tokens": -5}, "max_tokens"),
        ({"model": MODEL, "prompt": "a", "temperature": -1}, "temperature"),
        ({"model": MODEL, "prompt": 17}, "prompt"),
        ({"model": MODEL, "prompt": "a", "top_p": 0}, "top_p"),
        ({"prompt": "a"}, "model"),
    ):
        r = httpx.post(url, json=body, timeout=10)
        assert r.status_code == 400, body
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"].startswith(param), err
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt=[5] * 2000, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-4", messages=CHAT, max_tokens=2)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=2)
    for args in ("[1, 2]", '"text"', "{not json"):
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
        msgs = [*CHAT, {"role": "assistant", "tool_calls": [call]}]
        with pytest.raises(openai.BadRequestError, match="arguments") as e:
            oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
        assert e.value.body["param"] == f"messages.{len(CHAT)}.tool_calls"
    ok = oai.completions.create(model=MODEL, prompt="a", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")
    assert server.wait_idle()["leased"] == 0


def test_max_tokens_beyond_the_context_is_a_400_naming_it(server, oai):
    # vLLM's answer: 400, "'max_tokens' or 'max_completion_tokens' is too large: N. This
    # model's maximum context length is C tokens and your request has P input tokens
    # (N > C - P)", the field as param; a chat that asks for nothing runs to the context's
    # end and finishes with "length"
    n_ctx = server.service.engine.n_ctx
    prompt = [(i * 7) % 1500 + 20 for i in range(n_ctx - 10)]
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt=prompt, max_tokens=11)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == "max_tokens", err
    assert err["type"] == "invalid_request_error"
    msg = err["message"]
    assert "is too large: 11." in msg and f"(11 > {n_ctx} - {n_ctx - 10})" in msg, err
    ok = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 10
    # max_tokens not given: the default 16 shrinks to the 10 tokens the context leaves
    dflt = oai.completions.create(
        model=MODEL, prompt=prompt, temperature=0, extra_body={"ignore_eos": True}
    )
    assert dflt.choices[0].finish_reason == "length" and dflt.usage.completion_tokens == 10
    msgs = [{"role": "user", "content": "a " * 2000}]
    while len(ids := server.service.engine.encode_prompt(msgs)) > n_ctx - 6:
        msgs[0]["content"] = msgs[0]["content"][: -2 * max(1, len(ids) - (n_ctx - 6))]
    room = n_ctx - len(ids)
    assert 0 < room <= 6
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=msgs, **{field: room + 1})
        assert e.value.body["param"] == field and f"{field}' is too large" in str(e.value)
    for stream in (False, True):
        kw = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        r = oai.chat.completions.create(
            model=MODEL, messages=msgs, temperature=0, extra_body={"ignore_eos": True}, **kw
        )
        chunks = list(r) if stream else [r]
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert reasons[-1] == "length"
        assert chunks[-1].usage.prompt_tokens == len(ids)
        assert chunks[-1].usage.completion_tokens == room
    assert server.wait_idle()["leased"] == 0


def test_disconnect_cancels_the_sequence(server):
    body = {"model": MODEL, "prompt": "The for statement", "max_tokens": 900, "stream": True,
            "temperature": 0.9, "seed": 1, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
    assert any(line.startswith("data: ") for line in got)
    before = server.service.engine.statistics().generated_tokens
    h = server.wait_idle()
    assert h["running"] == 0 and h["leased"] == 0 and h["reads_in_flight"] == 0
    time.sleep(0.2)
    assert server.service.engine.statistics().generated_tokens - before < 50  # it stopped


def test_api_key():
    with running_server(api_key="s3cret") as srv:
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.models.list().data[0].id == MODEL
        client = anthropic.Anthropic(base_url=srv.url, api_key="s3cret", max_retries=0)
        r = client.messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
        assert r.usage.output_tokens >= 1
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0).messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
        assert httpx.get(srv.url + "/health").status_code == 200  # health stays open


def test_full_queue_429_and_body_limit():
    with running_server(parallel=1, max_queue=0, max_body_bytes=4096) as srv:
        body = {"model": MODEL, "prompt": "The for statement", "max_tokens": 300,
                "temperature": 0.9, "ignore_eos": True}  # fmt: skip

        def post():
            return httpx.post(srv.url + "/v1/completions", json=body, timeout=60)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(post)
            deadline = time.monotonic() + 30
            while srv.service.admission.running == 0:  # the first one holds the one slot
                assert time.monotonic() < deadline
                time.sleep(0.005)
            busy = post()  # 300 tokens take far longer than this round trip
            assert first.result().status_code == 200
        assert busy.status_code == 429, busy.text
        assert busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["type"] == "rate_limit_error"
        big = httpx.post(
            srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 5000}, timeout=10
        )
        assert big.status_code == 413 and "4096" in big.json()["error"]["message"]
        counted = 'colibri_requests_total{endpoint="/v1/completions",status="413"} 1.0'
        assert counted in httpx.get(srv.url + "/metrics", timeout=10).text
        assert srv.wait_idle()["running"] == 0
        ok = httpx.post(
            srv.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2},
            timeout=10,
        )  # fmt: skip
        assert ok.status_code == 200


def test_batch(server, engine):
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": "The for statement", "max_tokens": 5,
                  "temperature": 0}},
        {"custom_id": "b", "url": "/v1/chat/completions",
         "body": {"model": MODEL, "messages": CHAT, "max_tokens": 4, "temperature": 0}},
        {"custom_id": "c", "url": "/v1/completions", "body": {"model": "other", "prompt": "a"}},
    ]  # fmt: skip
    data = "\n".join(json.dumps(x) for x in lines) + "\nnot json\n"
    r = httpx.post(server.url + "/v1/batch", content=data, timeout=30)
    assert r.status_code == 200
    out = [json.loads(s) for s in r.text.splitlines()]
    assert [o["custom_id"] for o in out] == ["a", "b", "c", None]
    assert [o["response"]["status_code"] for o in out] == [200, 200, 404, 400]
    a = out[0]["response"]["body"]["choices"][0]["text"]
    assert a == engine.generate("The for statement", max_tokens=5, temperature=0)
    b = out[1]["response"]["body"]["choices"][0]["message"]["content"]
    assert b == engine.generate(CHAT, max_tokens=4, temperature=0)


def test_metrics(server, oai):
    oai.completions.create(model=MODEL, prompt="a", max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, v = line.rpartition(" ")
            values[name] = float(v)
    assert values['colibri_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert values["colibri_generation_tokens_total"] >= 3
    assert values["colibri_time_to_first_token_seconds_count"] >= 1
    assert values["colibri_inter_token_latency_seconds_count"] >= 2
    assert values["colibri_expert_hits_total"] + values["colibri_expert_misses_total"] > 0
    assert 0 <= values["colibri_expert_hit_rate"] <= 1
    assert values["colibri_cache_budget_bytes"] > 0
    for gauge in ("running_sequences", "queue_depth", "cache_used_bytes"):
        assert f"colibri_{gauge}" in values


def test_sigterm_drains_running_requests():
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "colibri", "serve", "--port", str(port), "--io", "threads"],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        body = {"model": MODEL, "prompt": "The for statement", "max_tokens": 300,
                "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
        chunks = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    if len(chunks) == 1:
                        proc.send_signal(signal.SIGTERM)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # drained, not cut
        assert len(chunks) >= 300
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "running 0; leased 0; reads in flight 0" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_tools_reach_the_chat_template(tmp_path):
    """A store whose chat template is Qwen3's (the demo's weights and vocabulary): the tools of
    a request are rendered into the prompt, for OpenAI and Anthropic requests alike."""
    import shutil

    template = SHARED / "chat_templates" / "Qwen-Qwen3-0.6B.jinja"
    if not template.exists():
        pytest.skip(f"shared data missing: {template}")
    store = tmp_path / "demo-qwen3-template"
    shutil.copytree(DEMO, store)
    (store / "chat_template.jinja").write_text(template.read_text())
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    with running_server(store=store) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        kw = dict(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
        plain = client.chat.completions.create(**kw)
        with_tools = client.chat.completions.create(**kw, tools=[tool])
        assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
        none = client.chat.completions.create(**kw, tools=[tool], tool_choice="none")
        assert none.usage.prompt_tokens == plain.usage.prompt_tokens
        ant = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
        msg = [{"role": "user", "content": CHAT[0]["content"]}]
        a_plain = ant.messages.create(model=MODEL, max_tokens=2, messages=msg)
        a_tools = ant.messages.create(
            model=MODEL, max_tokens=2, messages=msg,
            tools=[{"name": "get_weather", "input_schema": params}],
        )  # fmt: skip
        assert a_tools.usage.input_tokens == with_tools.usage.prompt_tokens
        assert a_plain.usage.input_tokens == plain.usage.prompt_tokens
        a_none = ant.messages.create(
            model=MODEL, max_tokens=2, messages=msg, tool_choice={"type": "none"},
            tools=[{"name": "get_weather", "input_schema": params}],
        )  # fmt: skip
        assert a_none.usage.input_tokens == plain.usage.prompt_tokens  # was: tools rendered
        with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
            ant.messages.create(
                model=MODEL, max_tokens=2, messages=msg, tool_choice={"type": "any"},
                tools=[{"name": "get_weather", "input_schema": params}],
            )  # fmt: skip


def test_a_corrupt_expert_record_ends_the_stream_with_an_error(tmp_path):
    import shutil

    store = tmp_path / "corrupt"
    shutil.copytree(DEMO, store)
    with open(store / "experts.bin", "r+b") as f:  # every record's bytes, not its checksum
        size = f.seek(0, 2)
        for off in range(100, size, 4096):
            f.seek(off)
            f.write(b"\xff" * 16)
    with running_server(store=store) as srv:
        body = {"model": MODEL, "prompt": "The for statement", "max_tokens": 5, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        err = json.loads(lines[-2][6:])["error"]
        assert lines[-1] == "data: [DONE]" and err["type"] == "server_error"
        assert "experts.bin" in err["message"] or "checksum" in err["message"].lower()
        r = httpx.post(srv.url + "/v1/completions", json={**body, "stream": False}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert srv.health()["status"] == "ok"
        assert srv.wait_idle()["leased"] == 0


def test_strict_types_roles_and_unknown_fields(server, oai):
    """As OpenAI's API: a bool or a string is not an integer, a role must be one of OpenAI's,
    an unknown top-level field is refused by name (a typo is not silently ignored), fields
    that cannot change the answer are accepted, and vLLM's top_k -1 is off like 0."""
    url = server.url + "/v1/chat/completions"
    base = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    for extra, param, message in (
        (
            {"messages": [{"role": "wizard", "content": "hi"}]},
            "messages.0.role",
            "messages[0].role",
        ),
        ({"max_tokens": True}, "max_tokens", "valid integer (got True)"),
        ({"max_tokens": "5"}, "max_tokens", "valid integer"),
        ({"stream": "yes"}, "stream", "valid boolean"),
        ({"temperature": "0"}, "temperature", "valid number"),
        ({"max_token": 5}, "max_token", "unrecognized request argument supplied: max_token"),
        ({"logit_bias": {"5": 100}}, "logit_bias", "logit_bias is not supported"),
        ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
        ({"messages": [{"role": "user"}]}, "messages.0", "a user message needs content"),
        # colibri cannot force a tool call (no constrained decoding): said, not ignored
        ({"tool_choice": "required"}, "tool_choice", "only 'auto' and 'none' are supported"),
        # was a 500 (TypeError: multiple values for 'messages')
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "'messages'"),
    ):
        r = httpx.post(url, json={**base, **extra}, timeout=10)
        assert r.status_code == 400, extra
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
        assert message in err["message"], err
    deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(url, content=deep, timeout=10)  # was a 500 (RecursionError)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "frob": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frob", r.text
    with pytest.raises(openai.BadRequestError, match="unrecognized request argument"):
        oai.chat.completions.create(**base, extra_body={"temprature": 0.5})

    def text(**kw):
        out = oai.chat.completions.create(**{**base, "max_tokens": 6, **kw})
        return out.choices[0].message.content

    greedy = text(temperature=0)
    # accepted and ignored: they cannot change the tokens (null is "not given")
    assert greedy == text(
        temperature=0, user="u", store=False, metadata={"k": "v"}, parallel_tool_calls=True,
        service_tier="auto", response_format={"type": "text"}, logit_bias={},
        extra_body={"prompt_cache_key": "x", "safety_identifier": "s", "audio": None},
    )  # fmt: skip
    # vLLM's top_k -1 and colibri's 0 both mean off: the same sampled tokens for a seed
    sampled = [text(temperature=1.5, seed=5, extra_body={"top_k": k}) for k in (-1, 0)]
    assert sampled[0] == sampled[1]
    r = httpx.post(url, json={**base, "top_k": -2}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text
    # developer is OpenAI's newer system role: the template sees a system message
    dev = [{"role": "developer", "content": "Be brief."}, *CHAT]
    sys_ = [{"role": "system", "content": "Be brief."}, *CHAT]
    assert text(temperature=0, messages=dev) == text(temperature=0, messages=sys_)
    assert server.wait_idle()["leased"] == 0
