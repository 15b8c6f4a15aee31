"""DeepSeek-V4's hub checkpoint layout (deepseek-ai/DeepSeek-V4-Flash / -Pro) converts: a tiny
random transformers DeepseekV4ForCausalLM written by the test in that layout, byte for byte.

Where the layout facts come from (transformers 5.24, the reference implementation):
- names: the inference repo's spelling without the `model.` prefix (`layers.L.attn.wq_a.weight`,
  `embed.weight`, `head.weight`, `norm.weight`, `hc_head_fn`, `mtp.K.*`): the leaf renames of
  conversion_mapping.py "deepseek_v4" (`^embed.weight`, `^head.weight`, `^hc_head_fn`, ...);
- scales: `X.scale`, renamed `X.weight_scale_inv` by quantizers/quantizer_finegrained_fp8.py
  ("Some FP8 checkpoints ship per-block scales under `.scale` (e.g. DeepSeek-V4-Flash)");
  config.json quantization_config quant_method fp8, weight_block_size [128, 128], scale_fmt
  "ue8m0" (UE8M0 = float8_e8m0fnu, safetensors F8_E8M0) and `expert_dtype` "fp4"
  (configuration_deepseek_v4.py moves a top-level expert_dtype into quantization_config);
- FP4 experts: int8 [out, in / 2], two E2M1 nibbles per byte, low nibble first, one UE8M0 scale
  per 32 weights of a row, [out, in / 32] (integrations/finegrained_fp8.py FP8Experts'
  "weight is int8, K dim halved ... per-row SF at gran_k=32" and Fp8Dequantize._unpack_fp4).
The test quantizes the model itself (experts with gguf's MXFP4 quantizer, repacked into the hub
nibble order from both layouts' definitions; linears into 128x128 FP8 blocks with power-of-two
scales), checks transformers' own Fp8Dequantize reads the bytes back to the weights the
reference model runs with (and that transformers' loader reads the whole checkpoint back to
that model), converts, and compares the engine to that model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests import hf_models

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
from safetensors.torch import load_file, save_file  # noqa: E402

from colibri.compute import ref  # noqa: E402
from colibri.convert import convert  # noqa: E402
from colibri.errors import ConversionError  # noqa: E402
from colibri.io.format import fp8_unrows, open_store  # noqa: E402
from tests.test_convert_quantized import (  # noqa: E402
    _check_engine,
    _ggml_to_hub,
    _record_tensor,
)

CASE = "deepseek_v4"
EXPERT = "layers.1.ffn.experts.0.w1.weight"
# ragged 128-blocks in the FP8 linears (160 = 128 + 32); every expert row a multiple of 32
DIMS = dict(hidden_size=160, moe_intermediate_size=64, q_lora_rank=160)
QCFG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}  # fmt: skip
# the FP8 linears of the tiny model (the converter reads whichever tensors carry a scale)
FP8_LINEARS = ("attn.wq_a.", "attn.wq_b.", "attn.wkv.", "attn.wo_a.", "attn.wo_b.",
               "shared_experts.", "indexer.wq_b.")  # fmt: skip


def _dequant():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one  # transformers' own FP8 / FP4 decoder


def _fp8_ue8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 block FP8 with UE8M0 scales (the block's amax / 448 rounded up to a power of
    two) -> (float8_e4m3fn [rows, cols], float8_e8m0fnu [ceil(rows/128), ceil(cols/128)])."""
    rows, cols = w.shape
    gr, gc = -(-rows // 128), -(-cols // 128)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    e = torch.empty(gr, gc, dtype=torch.uint8)
    for i in range(gr):
        for j in range(gc):
            blk = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            exp = int(torch.ceil(torch.log2(blk.abs().max().clamp(min=1e-30) / 448.0)))
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (blk / 2.0**exp).to(q.dtype)
            e[i, j] = exp + 127
    return q, e.view(torch.float8_e8m0fnu)


def _fp4(w: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """[out, in] f32 -> hub FP4 (int8 [out, in / 2], float8_e8m0fnu [out, in / 32]) and the
    GGML block_mxfp4 rows gguf's quantizer made (u8 [out, in / 32 * 17])."""
    q = ref.quantize(w, 39)  # gguf's MXFP4 quantizer
    blocks, scales = _ggml_to_hub(q.reshape(w.shape[0], -1), w.shape[1])
    packed = torch.from_numpy(np.ascontiguousarray(blocks.reshape(w.shape[0], -1))).view(torch.int8)
    return packed, torch.from_numpy(np.ascontiguousarray(scales)).view(torch.float8_e8m0fnu), q


def _hub_name(name: str) -> str:
    """save_pretrained's name -> the hub's (the inverse of SOURCE_RENAMES, written out)."""
    for src, dst in (("model.embed_tokens.weight", "embed.weight"),
                     ("model.norm.weight", "norm.weight")):  # fmt: skip
        if name == src:
            return dst
    if name.startswith("model.hc_head.hc_"):
        return "hc_head_" + name[len("model.hc_head.hc_") :]
    return name.removeprefix("model.")


@pytest.fixture(scope="module", params=["I8", "F4"])
def hub(tmp_path_factory, request):
    """(transformers model on the dequantized weights, hub checkpoint dir, prompt, hub tensors,
    GGML rows of every expert weight by save_pretrained name). The FP4 experts saved as int8
    (safetensors I8 [out, in / 2], as transformers' FP8Experts holds them) or as
    torch.float4_e2m1fn_x2 (safetensors F4 [out, in], as the inference repo's model holds
    them): the same bytes."""
    root = tmp_path_factory.mktemp("dsv4hub")
    model = hf_models.build(CASE, seed=5, **DIMS)
    model.save_pretrained(root / "float")
    sd = load_file(root / "float" / "model.safetensors")
    deq = _dequant()
    hub_t, ggml_rows, params = {}, {}, {}
    for name, t in sd.items():
        h = _hub_name(name)
        if ".ffn.experts." in name:
            packed, scale, rows = _fp4(t.numpy())
            back = deq(packed, scale, torch.float32)
            np.testing.assert_array_equal(back.numpy(), ref.dequantize(rows, 39, t.shape))
            if request.param == "F4":
                packed = packed.view(torch.float4_e2m1fn_x2)
            hub_t[h], hub_t[h[: -len(".weight")] + ".scale"] = packed, scale
            ggml_rows[name], params[name] = rows, back
        elif t.ndim == 2 and any(k in name for k in FP8_LINEARS):
            q, scale = _fp8_ue8m0(t)
            hub_t[h], hub_t[h[: -len(".weight")] + ".scale"] = q, scale
            params[name] = deq(q, scale, torch.float32)
        elif name.endswith(".tid2eid"):
            hub_t[h] = t.to(torch.int32)  # the inference repo's int32 table
        else:
            hub_t[h] = t
    # a multi-token-prediction module (not used for generation: dropped)
    e0 = "layers.1.ffn.experts.0.w1"
    hub_t["mtp.0.ffn.experts.0.w1.weight"] = hub_t[e0 + ".weight"].clone()
    hub_t["mtp.0.ffn.experts.0.w1.scale"] = hub_t[e0 + ".scale"].clone()
    hub_t["mtp.0.norm.weight"] = torch.ones(DIMS["hidden_size"])
    assert "embed.weight" in hub_t and "hc_head_fn" in hub_t and "layers.0.attn.wq_a.scale" in hub_t
    # the reference runs on exactly the weights the hub bytes stand for (save_pretrained's
    # names are the original spelling: map them back onto the modules' parameters)
    cfg = json.loads((root / "float" / "config.json").read_text())
    (root / "deq").mkdir()
    save_file({k: params.get(k, v).contiguous() for k, v in sd.items()},
              root / "deq" / "model.safetensors")  # fmt: skip
    (root / "deq" / "config.json").write_text(json.dumps(cfg))
    import transformers

    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        root / "deq", dtype=torch.float32
    ).eval()
    (root / "hub").mkdir()
    shard = {k: v.contiguous() for k, v in hub_t.items()}
    save_file(shard, root / "hub" / "model.safetensors", metadata={"format": "pt"})
    hub_cfg = dict(cfg, quantization_config=QCFG, expert_dtype="fp4")
    (root / "hub" / "config.json").write_text(json.dumps(hub_cfg))
    ids = hf_models.find_prompt(ref_model, 3, 16, 16, 1e-4)
    if ids is None:
        pytest.skip("no prompt without a near-tie")
    return ref_model, root / "hub", ids, hub_t, ggml_rows


def test_transformers_reads_the_test_hub_layout(hub):
    """transformers' own loader (the deepseek_v4 conversion mapping and the FP8 quantizer with
    dequantize=True) reads the test's hub checkpoint back to the reference model, exactly:
    the layout written here is the one transformers expects of the hub."""
    import transformers
    from transformers import FineGrainedFP8Config

    model, src, ids, hub_t, _rows = hub
    if hub_t[EXPERT].dtype != torch.int8:  # its FP8Experts allocate int8 [out, in / 2]
        pytest.skip("transformers 5.24 loads FP4 experts saved as int8 only")
    qc = FineGrainedFP8Config(dequantize=True, scale_fmt="ue8m0", expert_dtype="fp4")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, quantization_config=qc
    ).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_hub_fp4_experts_kept_as_mxfp4_and_logits_equal_transformers(hub, tmp_path):
    """--quant mxfp4: every expert record holds gguf's MXFP4 bytes of the hub's FP4 weights
    (no requantization), FP8 linears are dequantized exactly (power-of-two UE8M0 scales), the
    MTP module is dropped, and the engine's logits / greedy tokens equal transformers'."""
    model, src, ids, hub_t, ggml_rows = hub
    store_path = convert(src, tmp_path / "s", quant="mxfp4", dense_quant="f32")
    store = open_store(store_path)
    assert store.layout.qtype == "mxfp4"
    for layer in store.moe_layers:
        for e in (0, 3, 7):
            for role, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                rows = ggml_rows[f"model.layers.{layer}.ffn.experts.{e}.{w}.weight"]
                assert np.array_equal(_record_tensor(store, layer, e, role), rows.reshape(-1))
    name = "model.layers.1.attn.wo_b.weight"
    want = _dequant()(hub_t["layers.1.attn.wo_b.weight"], hub_t["layers.1.attn.wo_b.scale"],
                      torch.float32)  # fmt: skip
    assert np.array_equal(store.dense(name)[0], want.numpy())
    assert store.dense("model.embed_tokens.weight")[0].shape == (160, DIMS["hidden_size"])
    assert not any(n.startswith("mtp") or ".scale" in n for n in store.dense_names())
    _check_engine(model, store_path, ids)


def test_hub_fp8_linears_kept_and_experts_requantized(hub, tmp_path):
    """--dense-quant fp8 keeps the hub's e4m3 bytes and (decoded) UE8M0 block scales;
    --quant q8_0 requantizes the experts from their exact FP4 values."""
    _model, src, _ids, hub_t, ggml_rows = hub
    store = open_store(convert(src, tmp_path / "s", quant="q8_0", dense_quant="fp8"))
    name = "model.layers.2.attn.wq_b.weight"
    assert store.dense_qtype(name) == "fp8"
    q, scale = hub_t["layers.2.attn.wq_b.weight"], hub_t["layers.2.attn.wq_b.scale"]
    w, s = fp8_unrows(store.dense(name)[0], q.shape[1])
    assert np.array_equal(w, q.view(torch.uint8).numpy())
    assert np.array_equal(s, scale.float().numpy())
    rows = ggml_rows["model.layers.2.ffn.experts.5.w2.weight"]
    exact = ref.dequantize(rows, 39, (DIMS["hidden_size"], DIMS["moe_intermediate_size"]))
    assert np.array_equal(_record_tensor(store, 2, 5, "down"), ref.quantize(exact, 8).reshape(-1))


def _variant(src, tmp_path, drop=(), cfg_change=None, tensors=None):
    out = tmp_path / "bad"
    out.mkdir()
    t = {k: v for k, v in load_file(src / "model.safetensors").items() if k not in drop}
    save_file(t | (tensors or {}), out / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | (cfg_change or {})))
    return out


@pytest.mark.parametrize(
    ("drop", "cfg_change", "match"),
    [
        ((), {"expert_dtype": "fp8"}, "needs expert_dtype 'fp4'"),
        # the messages name the file's own spelling
        (("layers.1.ffn.experts.2.w3.scale",), None, r"'layers\.1\.ffn\.experts\.2\.w3\.weight' "),
        (("layers.0.attn.wq_a.scale",), None, r"'layers\.0\.attn\.wq_a\.weight' \(read as"),
        ((), {"quantization_config": None}, "quant_method 'fp8'"),
        ((), {"quantization_config": QCFG | {"scale_fmt": "e5m2"}}, "scale_fmt"),
    ],
)
def test_hub_layout_errors_name_the_tensor(hub, tmp_path, drop, cfg_change, match):
    _model, src, _ids, hub_t, _rows = hub
    if "expert_dtype" in str(cfg_change) and hub_t[EXPERT].dtype != torch.int8:
        pytest.skip("F4 is FP4 whatever expert_dtype says")
    bad = _variant(src, tmp_path, drop, cfg_change)
    with pytest.raises(ConversionError, match=match):
        convert(bad, tmp_path / "out", quant="mxfp4", dense_quant="f32")
    assert not (tmp_path / "out").exists()


def test_hub_fp4_scale_grid_checked(hub, tmp_path):
    _model, src, _ids, hub_t, _rows = hub
    name = "layers.2.ffn.experts.1.w2.scale"
    wrong = hub_t[name].view(torch.uint8)[:, :1].contiguous().view(torch.float8_e8m0fnu)
    bad = _variant(src, tmp_path, tensors={name: wrong})
    with pytest.raises(ConversionError, match=r"w2\.weight.*needs a scale of"):
        convert(bad, tmp_path / "out", quant="mxfp4", dense_quant="f32")
