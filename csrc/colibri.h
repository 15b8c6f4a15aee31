/* colibri.h — the C API of colibri's kernel library, and also the cffi cdef.
 *
 * The cdef parser understands only plain declarations: no #include, no macros, no
 * attributes in this file. Conventions:
 *   - outputs first, caller-allocated; kernels never allocate;
 *   - matrices are row-major; a quantized matrix [rows, cols] is rows × row_nbytes bytes,
 *     each row a run of GGML blocks (32 weights a block);
 *   - int return: 0 on success, a negative CLB_E* code on bad arguments (nothing written);
 *   - nthreads <= 0 means "the default" (clb_default_threads()).
 */

/* Storage types. Values equal GGML's ggml_type so GGUF tensors map one to one. */
enum clb_qtype {
    CLB_QTYPE_F32 = 0,
    CLB_QTYPE_F16 = 1,
    CLB_QTYPE_Q4_0 = 2,
    CLB_QTYPE_Q4_1 = 3,
    CLB_QTYPE_Q5_0 = 6,
    CLB_QTYPE_Q5_1 = 7,
    CLB_QTYPE_Q8_0 = 8,
    CLB_QTYPE_Q2_K = 10,
    CLB_QTYPE_Q3_K = 11,
    CLB_QTYPE_Q4_K = 12,
    CLB_QTYPE_Q5_K = 13,
    CLB_QTYPE_Q6_K = 14,
    CLB_QTYPE_IQ4_NL = 20,
    CLB_QTYPE_IQ4_XS = 23,
    CLB_QTYPE_BF16 = 30,
    CLB_QTYPE_MXFP4 = 39,
    /* not a GGML type: e4m3fn rows with f32 scales per 128 columns (csrc/kquants.h) */
    CLB_QTYPE_FP8 = 200
};

/* Instruction-set levels; clb_isa_set() forces one (tests), COLIBRI_ISA=scalar|avx2|avx512
 * forces one at load time. */
enum clb_isa { CLB_ISA_SCALAR = 0, CLB_ISA_AVX2 = 1, CLB_ISA_AVX512 = 2 };

/* Expert FFN activations. SILU: down(silu(gate x) * up x) (SwiGLU).
 * SWIGLU_OAI (gpt-oss): g = min(gate x, limit); u = clamp(up x, -limit, limit);
 * down((u + 1) * g * sigmoid(alpha * g)). GELU: down(gelu_tanh(gate x) * up x).
 * SILU_CLAMP (DeepSeek-V4, clamped SwiGLU): down(silu(min(gate x, limit)) *
 * clamp(up x, -limit, limit)). */
enum clb_act { CLB_ACT_SILU = 0, CLB_ACT_GELU = 1, CLB_ACT_SWIGLU_OAI = 2, CLB_ACT_SILU_CLAMP = 3 };

/* RoPE pairings: NEOX rotates (x[i], x[i + rot_dim/2]) ("rotate_half", Llama/Mixtral/Qwen);
 * INTERLEAVED rotates (x[2i], x[2i+1]) (GPT-J, DeepSeek MLA rope part, GLM). */
enum clb_rope_mode { CLB_ROPE_NEOX = 0, CLB_ROPE_INTERLEAVED = 1 };

enum clb_error {
    CLB_OK = 0,
    CLB_EINVAL = -1,      /* a size or pointer argument is invalid */
    CLB_EQTYPE = -2,      /* unknown quant type */
    CLB_EBLOCK = -3,      /* ncols not a multiple of the format's block size (32) */
    CLB_EISA = -4         /* requested ISA level not supported by this CPU or build */
};

/* ---- dispatch ---------------------------------------------------------------------- */
int clb_isa_detect(void);           /* best level this CPU and build support */
int clb_isa_get(void);              /* level in use */
int clb_isa_set(int isa);           /* CLB_OK or CLB_EISA */
int clb_default_threads(void);      /* physical cores */
/* AMX tiles for the Q8_0-activation GEMM at the AVX-512 level (same bits as without):
 * supported = CPU + OS + the kernel's XTILEDATA permission; COLIBRI_AMX=0 turns it off at load. */
int clb_amx_supported(void);
int clb_amx_get(void);              /* 1 when in use (supported, on, AVX-512 level) */
int clb_amx_set(int on);            /* CLB_OK, or CLB_EISA to turn on where unsupported */

/* ---- quantization (quant.c) ---------------------------------------------------------- */
int64_t clb_row_nbytes(int qtype, int64_t ncols);   /* < 0 on error (CLB_EQTYPE, CLB_EBLOCK) */
int clb_quantize(int qtype, void *out, const float *x, int64_t nrows, int64_t ncols);
int clb_dequantize(int qtype, float *out, const void *data, int64_t nrows, int64_t ncols);

/* ---- matmul (matmul.c, arch/) ---------------------------------------------------------
 * y[n, rows] = x[n, cols] @ W[rows, cols]^T, f32 activations and accumulation.
 * n is 1 (matvec) to any small batch; W in any clb_qtype. */
int clb_matmul(int qtype, float *y, const void *w, const float *x,
               int64_t rows, int64_t cols, int64_t n, int nthreads);

/* y[n, rows] = xq[n, cols] @ W[rows, cols]^T on Q8_0-quantized activations, as llama.cpp's CPU
 * path (ggml_vec_dot_q4_0_q8_0 / ggml_vec_dot_q8_0_q8_0): per 32-weight block an exact int8 x
 * int8 sum, times f32(d_w) * f32(d_x), accumulated in f32. W in CLB_QTYPE_Q4_0 or
 * CLB_QTYPE_Q8_0 (else CLB_EQTYPE); xq: n rows of clb_row_nbytes(CLB_QTYPE_Q8_0, cols) bytes,
 * e.g. from clb_quantize(CLB_QTYPE_Q8_0, ...) (= ggml's quantize_row_q8_0_ref). */
int clb_matmul_q8(int qtype, float *y, const void *w, const void *xq,
                  int64_t rows, int64_t cols, int64_t n, int nthreads);

/* ---- X16-packed weights (matmul.c, arch/matmul_q8.inc, arch/matmul_mxfp4.inc) --------
 * The decode layout of a Q4_0 / Q8_0 / MXFP4 matrix held in RAM: rows in tiles of 16 (a tile
 * keeps its 16 rows' bytes, 16 row_nbytes, so tile-aligned row ranges are the same byte ranges
 * as in GGML rows), each tile stored as the AVX-512 matvec reads it: per pair of blocks the
 * 2 x 16 scales (f16, MXFP4 e8m0: block 2p's rows 0..15, then block 2p+1's), then per block
 * the quant bytes in groups k (Q4_0, MXFP4: 4, Q8_0: 8) of 64 bytes, dword j = row j's quant
 * bytes 4k..4k+3. clb_x16_ok: the shapes that have it (those types, rows a multiple of 16,
 * cols of 64).
 * clb_pack_x16 / clb_unpack_x16: GGML rows <-> X16 bytes (dst may be src; CLB_EINVAL on a
 * shape without it or no memory for one tile). clb_matmul_q8_x16: clb_matmul_q8 on packed
 * weights, the same bits; on AVX512-VNNI one sequential stream per tile with no shuffles for
 * n <= 8, the GEMMs on the packed tiles above; elsewhere (and for AMX batches) the row-major
 * kernels on unpacked rows. clb_x16_fast: whether packing pays here (AVX512-VNNI, AMX off). */
int clb_x16_ok(int qtype, int64_t rows, int64_t cols);
int clb_x16_fast(void);
int clb_pack_x16(int qtype, void *dst, const void *src, int64_t rows, int64_t cols);
int clb_unpack_x16(int qtype, void *dst, const void *src, int64_t rows, int64_t cols);
int clb_matmul_q8_x16(int qtype, float *y, const void *w, const void *xq,
                      int64_t rows, int64_t cols, int64_t n, int nthreads);

/* ---- fused expert FFN (ffn.c) -----------------------------------------------------------
 * For each of n token rows: h = act(gate x + gate_bias, up x + up_bias)   [d_ff]
 *                           o = down h + down_bias                        [d_model]
 *                           y = (accumulate ? y : 0) + row_weight * o
 * gate, up: [d_ff, d_model] in qtype; down: [d_model, d_ff] in qtype; biases f32, nullable;
 * row_weight f32 [n], nullable (= 1). scratch f32 [n, 2 * d_ff].
 * qscratch: NULL for f32 activations; else Q8_0 activations (see clb_matmul_q8; qtype must be
 * Q4_0 or Q8_0): x is quantized once for gate and up, h before down, into qscratch of
 * n * (clb_row_nbytes(CLB_QTYPE_Q8_0, d_model) + clb_row_nbytes(CLB_QTYPE_Q8_0, d_ff)) bytes. */
int clb_expert_ffn(int qtype, float *y, float *scratch, const float *x,
                   const void *gate, const void *up, const void *down,
                   const float *gate_bias, const float *up_bias, const float *down_bias,
                   const float *row_weight, int64_t n, int64_t d_model, int64_t d_ff,
                   int act, float alpha, float limit, int accumulate, void *qscratch,
                   int nthreads);

/* The same with its own storage type per tensor (mixed GGUF quants: Q4_K_M keeps some layers'
 * down in Q6_K). With qscratch every type must pass clb_q8_act_supported. */
int clb_expert_ffn_mixed(int gate_qtype, int up_qtype, int down_qtype, float *y, float *scratch,
                         const float *x, const void *gate, const void *up, const void *down,
                         const float *gate_bias, const float *up_bias, const float *down_bias,
                         const float *row_weight, int64_t n, int64_t d_model, int64_t d_ff,
                         int act, float alpha, float limit, int accumulate, void *qscratch,
                         int nthreads);

/* clb_expert_ffn on X16-packed gate, up, down (clb_pack_x16; Q8_0 activations: qscratch
 * given, clb_x16_ok shapes, else CLB_EINVAL): the same bits as on GGML rows. */
int clb_expert_ffn_x16(int qtype, float *y, float *scratch, const float *x,
                       const void *gate, const void *up, const void *down,
                       const float *gate_bias, const float *up_bias, const float *down_bias,
                       const float *row_weight, int64_t n, int64_t d_model, int64_t d_ff,
                       int act, float alpha, float limit, int accumulate, void *qscratch,
                       int nthreads);

/* Several experts of one layer in one call: expert e runs on rows [row_off[e], row_off[e+1])
 * of x and writes the same rows of y (y overwritten, never accumulated), exactly as
 * clb_expert_ffn_mixed (q8k = 0; qscratch as there) or clb_expert_ffn_q8k (q8k = 1; qscratch
 * unused) on those rows alone, so each row gets the bits of that call. gate[e], up[e],
 * down[e]: expert e's tensors (all experts in the same qt_g / qt_u / qt_d); the bias arrays
 * are NULL or hold one nullable pointer per expert; row_weight f32 [row_off[n_experts]],
 * nullable. scratch and qscratch are sized for the largest expert's row count. Experts run
 * one after another (each over the thread pool); the first error is returned. x16 = 1: every
 * tensor is X16-packed (clb_pack_x16; q8k = 0, qscratch given, clb_x16_ok shapes, else
 * CLB_EINVAL), the same bits as on GGML rows. */
int clb_expert_ffn_group(int n_experts, int qt_g, int qt_u, int qt_d, int q8k, int x16, float *y,
                         float *scratch, const float *x, const void *const *gate,
                         const void *const *up, const void *const *down,
                         const float *const *gate_bias, const float *const *up_bias,
                         const float *const *down_bias, const float *row_weight,
                         const int64_t *row_off, int64_t d_model, int64_t d_ff, int act,
                         float alpha, float limit, void *qscratch, int nthreads);

/* 1 if clb_matmul_q8 / clb_expert_ffn(qscratch) take weights of this type: Q4_0, Q8_0, Q5_0,
 * Q5_1, Q2_K..Q6_K, MXFP4, IQ4_NL, IQ4_XS (integer dots) and FP8 (f32 dots on the Q8_0 values). */
int clb_q8_act_supported(int qtype);

/* ---- memory read bound (membench.c) ----------------------------------------------------
 * Read nbytes of buf once with vector loads on nthreads threads (the kernel pool) and store
 * the XOR of its 64-bit words (as int64) in *xor_out, so the reads cannot be optimised away;
 * time it from the caller for the streaming read bandwidth. */
int clb_mem_read(int64_t *xor_out, const void *buf, int64_t nbytes, int nthreads);
/* Evict every cache line of buf (nbytes) from every cache level (clflush) and fence, so that
 * its next read comes from memory; the benchmarks call it between timed calls. */
int clb_cache_flush(const void *buf, int64_t nbytes);

/* ---- small ops (ops.c) ----------------------------------------------------------------- */
/* y[n, d] = x / sqrt(mean(x^2) + eps) * w; w nullable (= 1); y may alias x. */
int clb_rmsnorm(float *y, const float *x, const float *w, int64_t n, int64_t d, float eps);
/* In place on x[n_tokens, n_heads, head_dim]: rotate the first rot_dim dims of each head at
 * position pos[t] with angles pos * inv_freq[i] (inv_freq [rot_dim/2]); cos and sin are
 * multiplied by mscale (YaRN attention factor, 1 otherwise). */
int clb_rope(float *x, const int32_t *pos, const float *inv_freq, int64_t n_tokens,
             int64_t n_heads, int64_t head_dim, int64_t rot_dim, float mscale, int mode);
int clb_softmax(float *x, int64_t n, int64_t d);                        /* rows, in place */
/* out[r] = log(sum_i exp(x[r, i])) for the rows of x[n, d] (f64; the exps in f32, max-shifted,
 * their sums in f64 past every 256 values); rows spread over nthreads. */
int clb_logsumexp(double *out, const float *x, int64_t n, int64_t d, int nthreads);
/* Per row of x[n, d]: the k largest, descending; ties broken by lowest index. */
int clb_topk(int32_t *idx, float *val, const float *x, int64_t n, int64_t d, int64_t k);
int clb_silu(float *y, const float *x, int64_t n);
int clb_gelu(float *y, const float *x, int64_t n);                       /* tanh approximation */

/* ---- attention (attention.c) -------------------------------------------------------------
 * out[n_q, n_heads, dv] = softmax(scale * q k^T + mask) v over the KV cache, grouped-query:
 * head h reads kv head h / (n_heads / n_kv_heads).
 * q: f32 [n_q, n_heads, dk]; k_cache: [n_ctx, n_kv_heads, dk], v_cache: [n_ctx, n_kv_heads, dv],
 * f32 or f16 (kv_f16); positions 0..n_kv-1 are valid. Query i sits at position q_pos0 + i and
 * sees keys j <= q_pos0 + i, and if window > 0 only j > q_pos0 + i - window.
 * sinks: f32 [n_heads] nullable; a per-head logit added to the softmax denominator only
 * (gpt-oss). */
int clb_attention(float *out, const float *q, const void *k_cache, const void *v_cache,
                  int kv_f16, int64_t n_q, int64_t n_kv, int64_t q_pos0, int64_t n_heads,
                  int64_t n_kv_heads, int64_t dk, int64_t dv, float scale, int64_t window,
                  const float *sinks, int nthreads);

/* ---- DSA lightning indexer (indexer.c) -----------------------------------------------------
 * out[n_q, n_kv]: out[i, t] = sum_h w[i, h] * max(0, scale * q[i, h, :] . k[t, :]) for
 * t <= q_pos0 + i, -inf for later t (DeepSeek-V3.2 / GLM-5 top-k selection scores).
 * q: f32 [n_q, n_heads, d]; w: f32 [n_q, n_heads]; k: [n_ctx >= n_kv, d], f32 or f16 (k_f16). */
int clb_index_scores(float *out, const float *q, const float *w, const void *k, int k_f16,
                     int64_t n_q, int64_t n_kv, int64_t q_pos0, int64_t n_heads, int64_t d,
                     float scale, int nthreads);
/* ---- gated delta rule (deltanet.c) ---------------------------------------------------------
 * The recurrent form of Gated DeltaNet's linear attention (Yang et al., arXiv:2412.06464;
 * transformers' torch_recurrent_gated_delta_rule), token by token, per value head h:
 *   S_h = S_h * exp(g[t, h])                      S_h: [dk, dv], state of head h
 *   u   = (v[t, h] - S_h^T k[t, hk]) * beta[t, h]
 *   S_h = S_h + k[t, hk] u^T
 *   out[t, h] = S_h^T q[t, hk]                    hk = h / (n_heads / n_k_heads)
 * q, k: f32 [n, n_k_heads, dk] (already l2-normalised; q already scaled by dk^-0.5);
 * v: f32 [n, n_heads, dv]; g (log decay), beta: f32 [n, n_heads];
 * state: f32 [n_heads, dk, dv], read and updated in place; out: f32 [n, n_heads, dv].
 * dv <= 1024. Heads run in parallel; results do not depend on nthreads. */
int clb_gated_delta_rule(float *out, float *state, const float *q, const float *k,
                         const float *v, const float *g, const float *beta, int64_t n,
                         int64_t n_heads, int64_t n_k_heads, int64_t dk, int64_t dv,
                         int nthreads);

/* ---- MLA kv_b_proj in its storage type (mla.c, arch/mla_simd.inc) -------------------------
 * kv_b: W [n_heads * (nope + dv), rank] in qtype (any clb_qtype; rank a multiple of 32 for the
 * block formats), DeepSeek-V2's kv_b_proj: head h's rows are W_UK_h [nope, rank] then
 * W_UV_h [dv, rank]. Threads over heads.
 * clb_mla_absorb_q: q_abs[t, h, 0:rank] = sum_{j < nope} q[t, h, j] W_UK_h[j, :], the absorbed
 *   query W_UK_h^T q_nope; q: f32 [n, n_heads, dq] (the first nope of each head are read),
 *   q_abs: f32 [n, n_heads, dout] (the first rank of each head are written). f32 activations.
 * clb_mla_values: out[t, h, :] = W_UV_h lat[t, h, 0:rank]; lat: f32 [n, n_heads, dl];
 *   out: f32 [n, n_heads, dv].
 * clb_mla_values_q8: the same on Q8_0 activations (see clb_matmul_q8): xq holds n * n_heads
 *   rows of clb_row_nbytes(CLB_QTYPE_Q8_0, rank) bytes (head h of token t at row t n_heads + h);
 *   qtype Q4_0 or Q8_0 (else CLB_EQTYPE). */
int clb_mla_absorb_q(int qtype, float *q_abs, const void *kv_b, const float *q, int64_t n,
                     int64_t n_heads, int64_t nope, int64_t dv, int64_t rank, int64_t dq,
                     int64_t dout, int nthreads);
int clb_mla_values(int qtype, float *out, const void *kv_b, const float *lat, int64_t n,
                   int64_t n_heads, int64_t nope, int64_t dv, int64_t rank, int64_t dl,
                   int nthreads);
int clb_mla_values_q8(int qtype, float *out, const void *kv_b, const void *xq, int64_t n,
                      int64_t n_heads, int64_t nope, int64_t dv, int64_t rank, int nthreads);

/* ---- K-quant GEMM on Q8_K activations (kquants_gemm.c, arch/kquants_gemm.inc) -------------
 * xq: n rows of clb_q8k_row_nbytes(cols) bytes of ggml's block_q8_K (per 256 values f32 d,
 * 256 int8, 16 int16 sums of 16), from clb_quantize_q8_k (= ggml's quantize_row_q8_K_ref).
 * clb_matmul_q8k: y[n, rows] = xq[n, cols] @ W[rows, cols]^T for W in Q4_K, Q5_K or Q6_K (else
 * CLB_EQTYPE): per 256-weight block the exact int32 sums of ggml's vec_dot_q*_K_q8_K, then
 * acc = fma(sumi, d_w d_x, acc) (and fma(-summ, dmin_w d_x, acc)) in block order, the same
 * bits at every ISA level, tile and batch size (kquants_gemm.h). cols a multiple of 256. */
int64_t clb_q8k_row_nbytes(int64_t ncols);
int clb_quantize_q8_k(void *out, const float *x, int64_t nrows, int64_t ncols);
int clb_matmul_q8k(int qtype, float *y, const void *w, const void *xq, int64_t rows,
                   int64_t cols, int64_t n, int nthreads);
int clb_q8k_supported(int qtype);
/* The fused expert FFN (as clb_expert_ffn, same arguments but qscratch) with gate, up and down
 * in Q4_K / Q5_K / Q6_K on Q8_K activations: x and h quantized to Q8_K (its own scratch; NaN in
 * y if that allocation fails), the three products by clb_matmul_q8k's GEMM. d_model and d_ff
 * multiples of 256. */
int clb_expert_ffn_q8k(int gate_qtype, int up_qtype, int down_qtype, float *y, float *scratch,
                       const float *x, const void *gate, const void *up, const void *down,
                       const float *gate_bias, const float *up_bias, const float *down_bias,
                       const float *row_weight, int64_t n, int64_t d_model, int64_t d_ff,
                       int act, float alpha, float limit, int accumulate, int nthreads);
