"""Checkpoints shipped quantized (issue 15): FP8 block-scaled DeepSeek-V3 and MXFP4 gpt-oss,
tiny random transformers models written in the hub's exact layouts by the test itself.

FP8: the checkpoint is made as DeepSeek's quantizer does (per 128x128 block scale = amax / 448,
e4m3 = (x / scale).to(torch.float8_e4m3fn), `weight_scale_inv` = scale), with hidden and
expert sizes that leave ragged edge blocks. MXFP4: gpt-oss experts quantized by gguf's MXFP4
quantizer, repacked here into the hub's nibble order, and checked to read back identically
through transformers' own dequantizer (integrations.mxfp4.convert_moe_packed_tensors).
Converted with the format kept (--quant fp8 / mxfp4), the store holds the shipped bytes and the
engine's logits and greedy tokens equal transformers run on the dequantized weights."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from tests import hf_models

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
from safetensors.torch import load_file, save_file  # noqa: E402

from colibri.compute import ops, ref  # noqa: E402
from colibri.convert import convert  # noqa: E402
from colibri.errors import ConversionError  # noqa: E402
from colibri.io.format import fp8_unrows, open_store  # noqa: E402

LOGIT_RTOL = 1e-4
PROMPT_LEN, NEW_TOKENS = 16, 16
FP8_CFG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
           "weight_block_size": [128, 128]}  # fmt: skip
# sizes with ragged 128-blocks: 160 = 128 + 32 columns / rows
DSV3 = dict(hidden_size=160, moe_intermediate_size=160, intermediate_size=288)


def _record_tensor(store, layer: int, expert: int, name: str) -> np.ndarray:
    rec = store.record(layer, expert)
    spec = store.layout_for(layer).tensors[name]
    with open(store.experts_path, "rb") as f:
        f.seek(rec.offset + spec.offset)
        return np.frombuffer(f.read(spec.nbytes), np.uint8)


def _fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style 128x128 block FP8 of w [rows, cols] -> (float8_e4m3fn, scale_inv f32)."""
    rows, cols = w.shape
    gr, gc = -(-rows // 128), -(-cols // 128)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(gr, gc, dtype=torch.float32)
    for i in range(gr):
        for j in range(gc):
            blk = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            scale = blk.abs().max().clamp(min=1e-12) / 448.0
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (blk / scale).to(q.dtype)
            s[i, j] = scale
    return q, s


def _fp8_dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    scale = s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return q.float() * scale


def _is_fp8(name: str, t: torch.Tensor) -> bool:
    """DeepSeek-V3's FP8 linears: every 2-D weight but embeddings, lm_head and the router."""
    skip = ("embed_tokens", "lm_head", "mlp.gate.weight", "norm")
    return t.ndim == 2 and name.endswith(".weight") and not any(k in name for k in skip)


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """(dequantized transformers model, FP8 checkpoint dir, prompt ids, source tensors)."""
    root = tmp_path_factory.mktemp("fp8")
    model = hf_models.build("deepseek_v3", seed=11, **DSV3)
    model.save_pretrained(root / "orig", save_original_format=True)
    sd = load_file(root / "orig" / "model.safetensors")
    fp8, deq = {}, {}
    for name, t in sd.items():
        if _is_fp8(name, t):
            q, s = _fp8_quantize(t)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = _fp8_dequantize(q, s)
        else:
            fp8[name] = deq[name] = t
    assert any(".mlp.experts.3.down_proj.weight" in n for n in fp8)  # hub per-expert layout
    cfg = json.loads((root / "orig" / "config.json").read_text())
    for sub, tensors, qc in (("fp8", fp8, FP8_CFG), ("deq", deq, None)):
        (root / sub).mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, root / sub / "model.safetensors")
        c = dict(cfg, quantization_config=qc) if qc else cfg
        (root / sub / "config.json").write_text(json.dumps(c))
    ref_model = transformers_model(root / "deq")
    ids = hf_models.find_prompt(ref_model, 5, PROMPT_LEN, NEW_TOKENS, 1e-4)
    if ids is None:
        pytest.skip("no prompt without a near-tie")
    return ref_model, root / "fp8", ids, fp8


def transformers_model(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _check_engine(model, store: Path, ids: list[int]) -> None:
    tokens, logits = asyncio.run(hf_models.engine_greedy(store, ids, NEW_TOKENS, activations="f32"))
    expected = hf_models.greedy(model, ids, NEW_TOKENS)
    assert tokens == expected
    want = hf_models.reference_logits(model, ids + expected)[len(ids) - 1 : -1]
    err = np.abs(logits - want).max()
    assert err <= LOGIT_RTOL * np.abs(want).max(), err


def test_fp8_kept_bytes_and_logits_equal_transformers(fp8_model, tmp_path):
    model, src, ids, tensors = fp8_model
    store_path = convert(src, tmp_path / "s", quant="fp8", dense_quant="f32", show_progress=False)
    store = open_store(store_path)
    assert store.layout.qtype == "fp8"
    for layer in store.moe_layers:
        for e in (0, 7, 15):
            for role, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                cols = store.layout.tensors[role].shape[1]
                rows = store.layout.tensors[role].shape[0]
                w, s = fp8_unrows(_record_tensor(store, layer, e, role).reshape(rows, -1), cols)
                assert np.array_equal(w, tensors[name].view(torch.uint8).numpy())
                assert np.array_equal(s, tensors[name + "_scale_inv"].numpy())
    # dense FP8 tensors were dequantized exactly into f32
    name = "model.layers.1.self_attn.o_proj.weight"
    got = store.dense(name)[0]
    want = _fp8_dequantize(tensors[name], tensors[name + "_scale_inv"]).numpy()
    assert np.array_equal(got, want)
    _check_engine(model, store_path, ids)


def test_fp8_dense_kept_and_experts_requantized(fp8_model, tmp_path):
    _model, src, _ids, tensors = fp8_model
    store = open_store(convert(src, tmp_path / "s", quant="q8_0", dense_quant="fp8"))
    name = "model.layers.1.self_attn.q_a_proj.weight"  # [48, 160]: cols a multiple of 32
    assert store.dense_qtype(name) == "fp8"
    rows, s = store.dense(name)[0], tensors[name + "_scale_inv"].numpy()
    w, scales = fp8_unrows(rows, tensors[name].shape[1])
    assert np.array_equal(w, tensors[name].view(torch.uint8).numpy())
    assert np.array_equal(scales, s)
    # experts: requantized from the exactly dequantized values
    e_name = "model.layers.2.mlp.experts.5.down_proj.weight"
    deq = _fp8_dequantize(tensors[e_name], tensors[e_name + "_scale_inv"]).numpy()
    assert np.array_equal(_record_tensor(store, 2, 5, "down"), ref.quantize(deq, 8).reshape(-1))
    # embeddings / routers were bf16-free f32 in the source: kept f32 / q8_0 as usual
    assert store.dense_qtype("model.layers.1.mlp.gate.weight") == "f32"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"activation_scheme": "static"}, "activation_scheme"),
        ({"weight_block_size": None}, "weight_block_size"),
        ({"quant_method": "gptq"}, "quant_method"),
        ({"fmt": "e5m2"}, "fmt"),
    ],
)
def test_fp8_config_errors_name_the_field(fp8_model, tmp_path, change, field):
    _model, src, _ids, _t = fp8_model
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {**FP8_CFG, **change}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=f"quantization_config.{field}"):
        convert(bad, tmp_path / "out", quant="fp8", dense_quant="f32")
    assert not (tmp_path / "out").exists()


def test_fp8_weights_without_quantization_config_refused(fp8_model, tmp_path):
    _model, src, _ids, _t = fp8_model
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["quantization_config"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match="quant_method 'fp8'"):
        convert(bad, tmp_path / "out", quant="fp8")


# ---- MXFP4 (gpt-oss) ------------------------------------------------------------------------


def _ggml_to_hub(rows: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """GGML block_mxfp4 rows u8 [..., cols / 32 * 17] -> hub (blocks [..., G, 16], scales
    [..., G]): written independently of colibri's repacker, from both layouts' definitions."""
    b = rows.reshape(*rows.shape[:-1], cols // 32, 17)
    scales, qs = b[..., 0], b[..., 1:]
    w = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # GGML: weight j low, j + 16 high
    blocks = (w[..., 0::2] | (w[..., 1::2] << 4)).astype(np.uint8)  # hub: 2j low, 2j+1 high
    return blocks, scales.copy()


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    """(transformers model with MXFP4-exact experts, MXFP4 checkpoint dir, prompt, GGML rows)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    root = tmp_path_factory.mktemp("mxfp4")
    model = hf_models.build("gpt_oss", seed=13)
    ggml_rows = {}  # name -> GGML block_mxfp4 rows u8 [E, out, in / 32 * 17]
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for pname in ("gate_up_proj", "down_proj"):
                p = getattr(layer.mlp.experts, pname)  # [E, in, out]
                w = p.transpose(1, 2).contiguous().numpy()  # [E, out, in]
                q = ref.quantize(w, 39)  # gguf's MXFP4 quantizer
                p.copy_(torch.from_numpy(ref.dequantize(q, 39, w.shape)).transpose(1, 2))
                ggml_rows[f"model.layers.{i}.mlp.experts.{pname}"] = q
    model.save_pretrained(root / "float")
    sd = load_file(root / "float" / "model.safetensors")
    out = {}
    for name, t in sd.items():
        if name in ggml_rows:
            blocks, scales = _ggml_to_hub(ggml_rows[name], t.shape[1])
            back = convert_moe_packed_tensors(
                torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
            )
            assert torch.equal(back, t)  # transformers' own dequantizer reads the packing back
            out[name + "_blocks"] = torch.from_numpy(blocks)
            out[name + "_scales"] = torch.from_numpy(scales)
        else:
            out[name] = t
    assert len(ggml_rows) == 2 * len(model.model.layers)
    (root / "mx").mkdir()
    save_file(out, root / "mx" / "model.safetensors")
    cfg = json.loads((root / "float" / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (root / "mx" / "config.json").write_text(json.dumps(cfg))
    ids = hf_models.find_prompt(model, 5, PROMPT_LEN, NEW_TOKENS, 1e-4)
    if ids is None:
        pytest.skip("no prompt without a near-tie")
    return model, root / "mx", ids, ggml_rows


def test_mxfp4_kept_as_ggml_blocks_and_logits_equal_transformers(mxfp4_model, tmp_path):
    model, src, ids, ggml_rows = mxfp4_model
    store_path = convert(src, tmp_path / "s", quant="mxfp4", dense_quant="f32")
    store = open_store(store_path)
    assert store.layout.qtype == "mxfp4"
    for layer in store.moe_layers:
        q = ggml_rows[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        d = ggml_rows[f"model.layers.{layer}.mlp.experts.down_proj"]
        for e in range(store.num_experts):  # GGML's bytes, interleaved gate/up rows split
            assert np.array_equal(_record_tensor(store, layer, e, "gate"), q[e, 0::2].reshape(-1))
            assert np.array_equal(_record_tensor(store, layer, e, "up"), q[e, 1::2].reshape(-1))
            assert np.array_equal(_record_tensor(store, layer, e, "down"), d[e].reshape(-1))
    _check_engine(model, store_path, ids)


def test_mxfp4_requantized(mxfp4_model, tmp_path):
    model, src, _ids, _rows = mxfp4_model
    store = open_store(convert(src, tmp_path / "s", quant="q8_0", dense_quant="f32"))
    down = model.model.layers[1].mlp.experts.down_proj[3].detach().T.contiguous().numpy()
    assert np.array_equal(_record_tensor(store, 1, 3, "down"), ref.quantize(down, 8).reshape(-1))


# ---- float sources into the new types ------------------------------------------------------


@pytest.fixture(scope="module")
def mixtral256(tmp_path_factory):
    """A tiny random Mixtral (hub layout) with 256-wide rows, so K-quant blocks fit."""
    model = hf_models.build("mixtral", seed=17, hidden_size=256, intermediate_size=256)
    path = tmp_path_factory.mktemp("m256") / "hf"
    model.save_pretrained(path, save_original_format=True)
    return model, path


@pytest.mark.parametrize("quant", ["q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "mxfp4", "fp8"])
def test_float_source_into_new_types(mixtral256, tmp_path, quant):
    """--quant of every new type with a quantizer: each record holds colibri's quantization
    of the float weights (gguf's bytes for q5_0/q5_1/mxfp4; the K-quants' error no worse than
    the numpy port of ggml's reference quantizer on the same weights); the store runs close
    to the f32 one, teacher-forced (q5_1 experts with q8_0 attention: the seed users'
    choice)."""
    from tests import ggml_kquant_ref

    model, src = mixtral256
    store = open_store(convert(src, tmp_path / "s", quant=quant, dense_quant="q8_0"))
    assert store.layout.qtype == quant
    w = model.model.layers[1].mlp.experts.down_proj[2].detach().numpy()  # [H, I]
    got = _record_tensor(store, 1, 2, "down")
    assert np.array_equal(got, ops.quantize(w, quant).reshape(-1))
    if int(ops.QType[quant.upper()]) in ref.GGUF_QUANTIZE:
        assert np.array_equal(got, ref.quantize(w, int(ops.QType[quant.upper()])).reshape(-1))
    if quant in ("q4_k", "q5_k", "q6_k"):
        ours = ops.dequantize(got, quant, w.shape)
        theirs = ggml_kquant_ref.quantize_k(w, quant)
        rmse, rmse_ref = (float(np.sqrt(np.mean((v - w) ** 2))) for v in (ours, theirs))
        assert rmse <= rmse_ref * 1.002, (rmse, rmse_ref)
    ids = hf_models.greedy(model, list(range(3, 3 + PROMPT_LEN)), PROMPT_LEN)
    f32 = convert(src, tmp_path / "f32", quant="f32", dense_quant="f32")
    p, q = _forced(f32, ids, "f32"), _forced(store.path, ids, "q8_0")  # teacher-forced
    logp = p - np.logaddexp.reduce(p, axis=1, keepdims=True)
    logq = q - np.logaddexp.reduce(q, axis=1, keepdims=True)
    kl = float((np.exp(logp) * (logp - logq)).sum(axis=1).mean())
    # random tiny models are sensitive (near-tied routers flip): bounds ~2x the KL measured,
    # far below a broken decoder's (nats); the bytes above are the exact checks
    assert kl < {"q4_k": 0.15, "mxfp4": 0.25}.get(quant, 0.06), kl


def _forced(store: Path, ids: list[int], activations: str) -> np.ndarray:
    """f64 [len(ids) - 1, vocab]: the engine's logits after each prefix of `ids`."""
    from colibri.engine import open_engine

    async def run() -> list[np.ndarray]:
        async with open_engine(store, activations=activations) as engine:
            seq = engine.new_sequence()
            out = [await engine.forward(seq, ids[:1])]
            for t in ids[1:-1]:
                out.append(await engine.forward(seq, [t]))
            return out

    return np.stack(asyncio.run(run())).astype(np.float64)


def test_import_only_and_unfit_types_refused(mixtral256, fp8_model, tmp_path):
    _model, src = mixtral256
    with pytest.raises(ConversionError, match="--quant 'q3_k' has no quantizer"):
        convert(src, tmp_path / "a", quant="q3_k")
    with pytest.raises(ConversionError, match="--dense-quant 'iq4_xs' has no quantizer"):
        convert(src, tmp_path / "b", dense_quant="iq4_xs")
    with pytest.raises(ConversionError, match="--dense-quant keep is for GGUF sources"):
        convert(src, tmp_path / "b", dense_quant="keep")
    small = hf_models.save(hf_models.build("mixtral"), tmp_path / "small")  # hidden 64
    with pytest.raises(ConversionError, match="--quant q4_k cannot hold the experts' rows of 64"):
        convert(small, tmp_path / "c", quant="q4_k")
    assert not list(tmp_path.glob("[abc]*"))


@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
def test_fp8_dequantize_any_block_grid(block):
    """quantized.fp8_dequantize == torch's float8_e4m3fn widening x the repeated block scales,
    for any weight_block_size and ragged edges, from any first row (chunked reads)."""
    from colibri.convert.quantized import e4m3_to_f32, fp8_dequantize

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(150, 100, generator=g) * 50).to(torch.float8_e4m3fn)
    br, bc = block
    s = torch.rand(-(-150 // br), -(-100 // bc), generator=g) + 0.01
    want = w.float() * s.repeat_interleave(br, 0)[:150].repeat_interleave(bc, 1)[:, :100]
    raw = w.view(torch.uint8).numpy()
    assert np.array_equal(e4m3_to_f32(np.arange(256, dtype=np.uint8)[:127]),
                          torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn)
                          .float().numpy())  # fmt: skip
    assert np.array_equal(fp8_dequantize(raw, s.numpy(), block), want.numpy())
    part = fp8_dequantize(raw[70:130], s.numpy(), block, first_row=70)
    assert np.array_equal(part, want[70:130].numpy())
