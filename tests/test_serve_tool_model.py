"""Issue 16, end to end: a model that really emits a tool call, through `colibri serve` and the
official openai client, streaming and not.

The model is a one-layer Qwen3-MoE with the real Qwen3 vocabulary, tokenizer and chat template
(../shared/data/tokenizers/qwen), built train-free so that its greedy continuation of a chat
prompt is a fixed hermes tool call: each token of the target has its own embedding direction
(30 x a one-hot, far above what the random attention and experts add to the residual) and the
lm_head row of the token that follows it reads that direction, so every token predicts its
successor (a bigram chain). That needs the target's tokens, and the prompt's last token, to have
one successor each; the payload below is spelled so that they do (checked before building).
transformers' own greedy run on the checkpoint is the reference that the construction holds;
the engine, the template's tool rendering, the hermes parser and the API are what is tested.
"""

from __future__ import annotations

import itertools
import json
import lzma

import pytest

from tests import hf_models
from tests.serve_util import SHARED, running_server
from tests.test_serve_tools import TOOLS  # get_weather(city)

openai = pytest.importorskip("openai")
torch = hf_models.torch

QWEN = SHARED / "tokenizers" / "qwen"
VOCAB = 151936  # Qwen3's embedding rows (the tokenizer has 151669 ids)
ARGUMENTS = {"city": "Paris"}
# the hermes call Qwen3's template writes, spaced so that no token repeats with another successor
CALL = '<tool_call>{"name": "get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """(store, prompt ids, target ids): a converted checkpoint whose greedy continuation of the
    chat prompt (MESSAGES with TOOLS, Qwen3's template) is CALL then <|im_end|>."""
    if not (QWEN / "qwen3_tokenizer.json.xz").exists():
        pytest.skip(f"shared data missing: {QWEN}")
    from colibri.convert import convert

    root = tmp_path_factory.mktemp("tool_model")
    hf = root / "hf"
    hf.mkdir()
    (hf / "tokenizer.json").write_bytes(
        lzma.decompress((QWEN / "qwen3_tokenizer.json.xz").read_bytes())
    )
    (hf / "tokenizer_config.json").write_bytes((QWEN / "qwen3_tokenizer_config.json").read_bytes())
    tok = hf_models.transformers.AutoTokenizer.from_pretrained(hf)
    text = tok.apply_chat_template(
        MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    prompt = tok(text, add_special_tokens=False).input_ids
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    target = [*tok(CALL, add_special_tokens=False).input_ids, eos]
    chain = [prompt[-1], *target]
    successor: dict[int, int] = {}
    for a, b in itertools.pairwise(chain):
        assert successor.setdefault(a, b) == b, f"token {a} has two successors: respell CALL"

    model = hf_models.build("qwen3_moe", seed=3, vocab_size=VOCAB, num_hidden_layers=1,
                            eos_token_id=eos, pad_token_id=eos, bos_token_id=None)  # fmt: skip
    d = model.config.hidden_size
    assert len(successor) <= d
    with torch.no_grad():
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        model.model.norm.weight.fill_(1.0)
        for slot, (a, b) in enumerate(successor.items()):
            emb[a] = 0.0
            emb[a, slot] = 30.0
            head[b, slot] = 1.0
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    hf_models.save(model, hf)
    # the reference: transformers' greedy run of the checkpoint emits the call, then stops
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=len(target) + 8, do_sample=False
        )
    assert out[0, len(prompt) :].tolist() == target
    store = convert(hf, root / "store", quant="f32", dense_quant="f32")
    return store, prompt, target


def test_a_model_emits_a_tool_call_through_serve(tool_model):
    """The openai client's tool_calls (non-streaming, and assembled from the stream's deltas)
    are the call the model generated, parsed: name get_weather, arguments {"city": "Paris"};
    finish_reason "tool_calls"; no content; the prompt the server rendered is transformers'."""
    store, prompt, target = tool_model
    with running_server(store=store, parallel=1) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        kw = dict(model="colibri-demo", messages=MESSAGES, tools=TOOLS, max_tokens=64,
                  temperature=0)  # fmt: skip
        r = client.chat.completions.create(**kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert not choice.message.content
        assert r.usage.prompt_tokens == len(prompt)
        assert r.usage.completion_tokens == len(target)  # the call and <|im_end|>
        calls = choice.message.tool_calls
        assert [(c.type, c.function.name) for c in calls] == [("function", "get_weather")]
        assert json.loads(calls[0].function.arguments) == ARGUMENTS
        assert calls[0].id.startswith("call_")

        names: dict[int, str] = {}
        args: dict[int, str] = {}
        reasons, content = [], ""
        for chunk in client.chat.completions.create(**kw, stream=True):
            for c in chunk.choices:
                content += c.delta.content or ""
                for tc in c.delta.tool_calls or []:
                    if tc.function.name:
                        names[tc.index] = names.get(tc.index, "") + tc.function.name
                    args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
                if c.finish_reason is not None:
                    reasons.append(c.finish_reason)
        assert reasons == ["tool_calls"]
        assert content == ""
        assert names == {0: "get_weather"}
        assert json.loads(args[0]) == ARGUMENTS

        # without tools the same generation is plain text: the call's own characters, untouched
        plain = client.chat.completions.create(
            model="colibri-demo", messages=MESSAGES, max_tokens=64, temperature=0
        )
        assert plain.choices[0].message.tool_calls is None
        assert plain.choices[0].message.content == CALL
        assert plain.choices[0].finish_reason == "stop"
