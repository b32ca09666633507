/* The native CPU step of gefen_kernels (docs/algorithm.md#step): the element-wise part of the
 * block and factored steps and of the quantized Muon momentum, in one pass per block for the
 * block max and one for the re-quantisation and the parameter write.
 *
 * Built at first use by gefen_kernels/ops/_cpu_native.py with the system C compiler
 * (-ffp-contract=off: no fused multiply-add, so every operation below is the separately
 * rounded IEEE fp32 operation of the canonical rounding sequence in gefen_kernels/_numerics.py,
 * in the order the PyTorch reference performs it). The second-moment statistics, whose
 * summation order the reference's torch reductions define, are computed by the caller with
 * those same reductions; this file never sums anything.
 *
 * dtype codes: 0 = fp32, 1 = bf16, 2 = fp16.
 */
#include <math.h>
#include <stdint.h>

#define NUM_CODEWORDS 256
#define BINS 4096

static inline float from_bits(uint32_t w) { union { uint32_t u; float f; } v; v.u = w; return v.f; }
static inline uint32_t to_bits(float f) { union { float f; uint32_t u; } v; v.f = f; return v.u; }

static inline float bf16_to_f32(uint16_t h) { return from_bits((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
    /* round to nearest even, as c10::BFloat16 */
    uint32_t w = to_bits(f);
    if (f != f) return (uint16_t)0x7FC0;
    w += 0x7FFFu + ((w >> 16) & 1u);
    return (uint16_t)(w >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    /* IEEE half -> single, exact (the FP16 library's fp16_ieee_to_fp32_value) */
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t result = sign | (two_w < (1u << 27) ? to_bits(denormalized)
                                                       : to_bits(normalized));
    return from_bits(result);
}

static inline uint16_t f32_to_f16(float f) {
    /* single -> IEEE half, round to nearest even (fp16_ieee_from_fp32_value) */
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = to_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = to_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline float load(const void *p, int dt, int64_t i) {
    if (dt == 0) return ((const float *)p)[i];
    if (dt == 1) return bf16_to_f32(((const uint16_t *)p)[i]);
    return f16_to_f32(((const uint16_t *)p)[i]);
}

/* Round an fp32 value to dtype dt and back (the reference's .to(pdt).to(f32)). */
static inline float round_to(float x, int dt) {
    if (dt == 0) return x;
    if (dt == 1) return bf16_to_f32(f32_to_bf16(x));
    return f16_to_f32(f32_to_f16(x));
}

static inline void store(void *p, int dt, int64_t i, float x) {
    if (dt == 0) ((float *)p)[i] = x;
    else if (dt == 1) ((uint16_t *)p)[i] = f32_to_bf16(x);
    else ((uint16_t *)p)[i] = f32_to_f16(x);
}

/* docs/algorithm.md#stochastic-rounding: splitmix64 of (seed, flat index), 24 random bits. */
static inline float sr_uniform(uint64_t seed, int64_t index) {
    uint64_t z = ((uint64_t)index + 1u) * 0x9E3779B97F4A7C15ull + seed;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z = z ^ (z >> 31);
    return (float)(z >> 40) * 0x1.0p-24f;
}

/* Lower bound of x in the codebook (first index with c[j] >= x) through the bucket table of
 * gefen_kernels/ops/_search_table.py: a codeword in a lower bucket is below x and one in a
 * higher bucket above it, so a scan of x's own bucket finds it. NaN: bucket 0 (callers mask). */
static inline int lower_bound(float x, const float *cb, const int32_t *table) {
    const float t = floorf((x + 1.0f) * (float)(BINS / 2));
    const int b = t >= 0.0f ? (t > (float)(BINS - 1) ? BINS - 1 : (int)t) : 0;
    int j = table[b];
    const int end = table[b + 1];
    if (end - j <= 1) return j + (j < end && cb[j] < x); /* the usual case: one probe */
    while (j < end && cb[j] < x) j++;
    return j;
}

/* docs/algorithm.md#quantizer, #stochastic-rounding and #toward-zero-rounding; the reference is
 * gefen_kernels/ops/_quant_ref.py round_codes. */
static inline int quantize(float x, int zero_grad, int stochastic, float u, const float *cb,
                           const int32_t *table) {
    if (x != x) return 0;
    int right = lower_bound(x, cb, table);
    if (right > NUM_CODEWORDS - 1) right = NUM_CODEWORDS - 1;
    const int left = right > 0 ? right - 1 : 0;
    const float c_left = cb[left], c_right = cb[right];
    if (zero_grad) {
        const int nearest_left = fabsf(x - c_left) <= fabsf(x - c_right);
        const int straddle = (c_left < 0.0f) && (c_right > 0.0f);
        const int floor_left = (c_right > x) && (x > 0.0f);
        return (straddle ? nearest_left : floor_left) ? left : right;
    }
    if (stochastic) {
        const float width = c_right - c_left;
        const float clamped = fminf(fmaxf(x, c_left), c_right);
        const float p_up = width > 0.0f ? (clamped - c_left) / width : 0.0f;
        return u < p_up ? right : left;
    }
    if (x > cb[NUM_CODEWORDS - 1]) return NUM_CODEWORDS - 1;
    return left + (fabsf(x - c_left) > fabsf(x - c_right));
}

/* m = f32(f32(b1 * f32(s * c[q])) + f32(omb1 * g)) (gefen_kernels._numerics.momentum_ema). */
static inline float ema(float b1, float omb1, float s_old, float cw, float g) {
    const float dequant = s_old * cw;
    const float a = b1 * dequant;
    const float b = omb1 * g;
    return a + b;
}

/* New block scale: max |m| over the block, NaN if any m is NaN. */
static inline __attribute__((always_inline)) float block_max(const void *grad, int gdt, const uint8_t *codes, int64_t base,
                       int64_t period, float s_old, const float *cb, float b1, float omb1,
                       int maximize) {
    float amax = 0.0f;
    int nan = 0;
    for (int64_t i = 0; i < period; i++) {
        float g = load(grad, gdt, base + i);
        if (maximize) g = -g;
        const float a = fabsf(ema(b1, omb1, s_old, cb[codes[base + i]], g));
        if (a > amax) amax = a;
        else if (a != a) nan = 1;
    }
    return nan ? NAN : amax;
}

/* The Gefen step of blocks [first, stop) (block_step / factored_step, gefen_kernels/ops/
 * _step_ref.py run_step). Block mode: sigma_block[b] is sigma of block b (r == NULL).
 * Factored mode: sigma of element (i, j) from r[i], k[j] and inv_rbar, ncols columns. */
static inline __attribute__((always_inline)) void step_blocks(
                    void *param, const int pdt, const void *grad, const int gdt, uint8_t *codes,
                    float *scale, int64_t first, int64_t stop, int64_t period,
                    const float *sigma_block, const float *r, const float *k, int64_t ncols,
                    float inv_rbar, const float *cb, const int32_t *table, float b1, float omb1,
                    float eps, float lr, float bc2, float bc1_recip, float decay, int maximize,
                    int stochastic, uint64_t seed, int write_param) {
    for (int64_t blk = first; blk < stop; blk++) {
        const int64_t base = blk * period;
        const float s_old = scale[blk];
        const float s_new = block_max(grad, gdt, codes, base, period, s_old, cb, b1, omb1,
                                      maximize);
        const int positive = s_new > 0.0f;
        const float sig_b = sigma_block != 0 ? sigma_block[blk] : 0.0f;
        int64_t row = 0, col = 0;
        if (r != 0) {
            row = base / ncols;
            col = base - row * ncols;
        }
        for (int64_t i = 0; i < period; i++) {
            const int64_t idx = base + i;
            float g = load(grad, gdt, idx);
            if (maximize) g = -g;
            const float m = ema(b1, omb1, s_old, cb[codes[idx]], g);
            const float z = positive ? m / s_new : 0.0f;
            const float u = stochastic ? sr_uniform(seed, idx) : 0.0f;
            const int q = quantize(z, g == 0.0f, stochastic, u, cb, table);
            codes[idx] = (uint8_t)q;
            if (!write_param) continue;
            float mhat = cb[q] * s_new;
            float sigma = sig_b;
            if (r != 0) {
                const float prod = r[row] * k[col];
                const float v = prod * inv_rbar;
                float h = sqrtf(v * bc2);
                h = h + eps;
                sigma = (1.0f / h) * bc1_recip;
                if (v == 0.0f) mhat = 0.0f;
                if (++col == ncols) { col = 0; row++; }
            }
            const float step = (mhat * sigma) * lr;
            const float decayed = round_to(load(param, pdt, idx) * decay, pdt);
            store(param, pdt, idx, decayed - step);
        }
        scale[blk] = s_new;
    }
}

/* The quantized Muon momentum of blocks [first, stop) (gefen_kernels/ops/muon_momentum.py
 * muon_momentum_reference): codes and scales in place, the dense momentum in out (gdt).
 * cb_out is the codebook rounded to the gradient dtype. */
static inline __attribute__((always_inline)) void muon_blocks(
                    const void *grad, const int gdt, uint8_t *codes, float *scale, int64_t first,
                    int64_t stop, int64_t period, void *out, const float *cb,
                    const float *cb_out, const int32_t *table, float b, float omb, int maximize,
                    int stochastic, uint64_t seed, int nesterov) {
    for (int64_t blk = first; blk < stop; blk++) {
        const int64_t base = blk * period;
        const float s_old = scale[blk];
        const float s_new = block_max(grad, gdt, codes, base, period, s_old, cb, b, omb,
                                      maximize);
        const int positive = s_new > 0.0f;
        for (int64_t i = 0; i < period; i++) {
            const int64_t idx = base + i;
            float g = load(grad, gdt, idx);
            if (maximize) g = -g;
            const float m = ema(b, omb, s_old, cb[codes[idx]], g);
            const float z = positive ? m / s_new : 0.0f;
            const float u = stochastic ? sr_uniform(seed, idx) : 0.0f;
            const int q = quantize(z, g == 0.0f, stochastic, u, cb, table);
            codes[idx] = (uint8_t)q;
            float value = round_to(cb_out[q] * s_new, gdt);
            if (nesterov) {
                const float look = round_to(value * b, gdt);
                const float a = omb * g;
                value = a + look;
            }
            store(out, gdt, idx, value);
        }
        scale[blk] = s_new;
    }
}

#define STEP_CASE(P, G) if (pdt == P && gdt == G) { step_blocks(param, P, grad, G, codes, scale, \
    first, stop, period, sigma_block, r, k, ncols, inv_rbar, cb, table, b1, omb1, eps, lr, bc2, \
    bc1_recip, decay, maximize, stochastic, seed, write_param); return; }

/* Entry points: one instance of the loops per dtype pair (dtypes known at compile time). */
void gefen_cpu_step(void *param, int pdt, const void *grad, int gdt, uint8_t *codes,
                    float *scale, int64_t first, int64_t stop, int64_t period,
                    const float *sigma_block, const float *r, const float *k, int64_t ncols,
                    float inv_rbar, const float *cb, const int32_t *table, float b1, float omb1,
                    float eps, float lr, float bc2, float bc1_recip, float decay, int maximize,
                    int stochastic, uint64_t seed, int write_param) {
    STEP_CASE(0, 0) STEP_CASE(0, 1) STEP_CASE(0, 2)
    STEP_CASE(1, 0) STEP_CASE(1, 1) STEP_CASE(1, 2)
    STEP_CASE(2, 0) STEP_CASE(2, 1) STEP_CASE(2, 2)
}

#define MUON_CASE(G) if (gdt == G) { muon_blocks(grad, G, codes, scale, first, stop, period, out, \
    cb, cb_out, table, b, omb, maximize, stochastic, seed, nesterov); return; }

void gefen_cpu_muon(const void *grad, int gdt, uint8_t *codes, float *scale, int64_t first,
                    int64_t stop, int64_t period, void *out, const float *cb,
                    const float *cb_out, const int32_t *table, float b, float omb, int maximize,
                    int stochastic, uint64_t seed, int nesterov) {
    MUON_CASE(0) MUON_CASE(1) MUON_CASE(2)
}
