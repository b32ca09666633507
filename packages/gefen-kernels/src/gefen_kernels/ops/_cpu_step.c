/* The native CPU step of gefen_kernels (docs/algorithm.md#step): the element-wise part of the
 * block and factored steps and of the quantized Muon momentum, in one pass per block for the
 * block max and one for the re-quantisation and the parameter write. One call steps a whole
 * list of tensors (gefen_tensor descriptors), split over threads once.
 *
 * The loops are written for the compiler's vectoriser: chunks of CHUNK elements, no early
 * exits, selects instead of branches, the codebook search as one probe of the bucket table
 * (gather) whose rare multi-codeword buckets are redone by the scalar search afterwards.
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
#include <stdlib.h>
#if defined(_OPENMP)
#include <omp.h>
#elif !defined(_WIN32)
#include <pthread.h>
#endif

#define NUM_CODEWORDS 256
#define BINS 4096
#define CHUNK 256
#define MAX_THREADS 256

static inline float from_bits(uint32_t w) { union { uint32_t u; float f; } v; v.u = w; return v.f; }
static inline uint32_t to_bits(float f) { union { float f; uint32_t u; } v; v.f = f; return v.u; }

static inline float bf16_to_f32(uint16_t h) { return from_bits((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
    /* round to nearest even, as c10::BFloat16 */
    uint32_t w = to_bits(f);
    w += 0x7FFFu + ((w >> 16) & 1u);
    return f != f ? (uint16_t)0x7FC0 : (uint16_t)(w >> 16);
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
static inline int bucket_of(float x) {
    float t = floorf((x + 1.0f) * (float)(BINS / 2));
    t = t >= 0.0f ? t : 0.0f;                       /* NaN -> 0 */
    t = t > (float)(BINS - 1) ? (float)(BINS - 1) : t;
    return (int)t;
}

static inline int lower_bound(float x, const float *cb, const int32_t *table) {
    const int b = bucket_of(x);
    int j = table[b];
    const int end = table[b + 1];
    while (j < end && cb[j] < x) j++;
    return j;
}

/* docs/algorithm.md#quantizer, #stochastic-rounding and #toward-zero-rounding given the
 * lower bound: the reference is gefen_kernels/ops/_quant_ref.py round_codes. */
static inline int choose(float x, int lb, int zero_grad, int stochastic, float u,
                         const float *cb) {
    const int right = lb > NUM_CODEWORDS - 1 ? NUM_CODEWORDS - 1 : lb;
    const int left = right > 0 ? right - 1 : 0;
    const float c_left = cb[left], c_right = cb[right];
    const float d_left = fabsf(x - c_left), d_right = fabsf(x - c_right);
    /* toward zero (zero gradient) */
    const int straddle = (c_left < 0.0f) & (c_right > 0.0f);
    const int floor_left = (c_right > x) & (x > 0.0f);
    const int zero_left = straddle ? (d_left <= d_right) : floor_left;
    /* stochastic (x is not NaN here, so the clamp is fminf(fmaxf(x, c_left), c_right)) */
    const float width = c_right - c_left;
    float clamped = x < c_left ? c_left : x;
    clamped = clamped > c_right ? c_right : clamped;
    const float p_up = width > 0.0f ? (clamped - c_left) / width : 0.0f;
    const int sr_left = !(u < p_up);
    /* nearest */
    const int nearest_left = (x > cb[NUM_CODEWORDS - 1]) ? 0 : !(d_left > d_right);
    const int go_left = zero_grad ? zero_left : (stochastic ? sr_left : nearest_left);
    const int q = go_left ? left : right;
    return x != x ? 0 : q;
}

static inline int quantize(float x, int zero_grad, int stochastic, float u, const float *cb,
                           const int32_t *table) {
    return choose(x, lower_bound(x, cb, table), zero_grad, stochastic, u, cb);
}

/* m = f32(f32(b1 * f32(s * c[q])) + f32(omb1 * g)) (gefen_kernels._numerics.momentum_ema). */
static inline float ema(float b1, float omb1, float s_old, float cw, float g) {
    const float dequant = s_old * cw;
    const float a = b1 * dequant;
    const float b = omb1 * g;
    return a + b;
}

/* The codebook and the options every tensor of a call shares. */
typedef struct {
    const float *cb;          /* fp32 [256] */
    const float *cb_out;      /* Muon: the codebook rounded to the gradient dtype */
    const int32_t *table;     /* int32 [BINS + 1] */
    float b1, omb1, eps;
    int32_t maximize, stochastic, nesterov;
    /* Filled by gefen_cpu_run from cb and table: per bucket b, (L[b] | multi << 16) in the low
     * 32 bits (multi: the bucket holds more than one codeword) and the bit pattern of c[L[b]]
     * (+inf for an empty bucket: never below x) in the high 32; per R, c[max(R - 1, 0)] (low)
     * and c[R] (high): one gather each instead of five. */
    const uint64_t *probe, *pairs;
} gefen_shared;

/* One tensor of a step (mirrored by _cpu_step.py's ctypes Structure). */
typedef struct {
    void *param;              /* fp32/bf16/fp16 [num_blocks * period]; Muon: the output */
    const void *grad;
    uint8_t *codes;           /* [num_blocks, period] */
    float *scale;             /* [num_blocks] */
    const float *sqrt_v;      /* block mode: torch.sqrt of the second moment per block */
    const float *r, *k;       /* factored mode: row [rows] and column [ncols] statistics */
    const float *r_total;     /* factored: 0-dim sum of r (inv_rbar computed here), or NULL */
    int64_t num_blocks, period, rows, ncols;
    int32_t pdt, gdt, factored, write_param;
    float lr, bc2, bc1_recip, decay, inv_rbar;
    uint64_t seed;
} gefen_tensor;

/* New block scale: max |m| over the block, NaN if any m is NaN. The max is taken over the
 * bit patterns of |m| (monotone for non-negative floats; a NaN's pattern exceeds +inf's).
 * With `keep`, the momenta m and the (sign-applied) gradients g go to mc and gc
 * [0 .. period) for the second pass. */
static inline __attribute__((always_inline)) float block_max_as(
        const void *grad, const int gdt, const uint8_t *codes, int64_t base, int64_t period,
        float s_old, const gefen_shared *sh, const int keep, float *restrict mc,
        float *restrict gc) {
    const float *cb = sh->cb;
    const float b1 = sh->b1, omb1 = sh->omb1;
    const int maximize = sh->maximize;
    uint32_t mx = 0;
    for (int64_t i = 0; i < period; i++) {
        float g = load(grad, gdt, base + i);
        g = maximize ? -g : g;
        const float m = ema(b1, omb1, s_old, cb[codes[base + i]], g);
        if (keep) { mc[i] = m; gc[i] = g; }
        const uint32_t a = to_bits(m) & 0x7FFFFFFFu;
        mx = a > mx ? a : mx;
    }
    return mx > 0x7F800000u ? NAN : from_bits(mx);
}

/* Blocks of up to MOMENTUM_CACHE elements keep their momenta between the two passes (no
 * second codebook gather); longer ones recompute them chunk by chunk (momentum()). */
#define MOMENTUM_CACHE 4096

static float block_max(const void *grad, int gdt, const uint8_t *codes, int64_t base,
                       int64_t period, float s_old, const gefen_shared *sh, float *mc,
                       float *gc) {
    const int keep = period <= MOMENTUM_CACHE;
    if (gdt == 0) return keep ? block_max_as(grad, 0, codes, base, period, s_old, sh, 1, mc, gc)
                              : block_max_as(grad, 0, codes, base, period, s_old, sh, 0, mc, gc);
    if (gdt == 1) return keep ? block_max_as(grad, 1, codes, base, period, s_old, sh, 1, mc, gc)
                              : block_max_as(grad, 1, codes, base, period, s_old, sh, 0, mc, gc);
    return keep ? block_max_as(grad, 2, codes, base, period, s_old, sh, 1, mc, gc)
                : block_max_as(grad, 2, codes, base, period, s_old, sh, 0, mc, gc);
}

/* The momenta and gradients of elements [idx, idx + n), as block_max_as keeps them. */
static inline __attribute__((always_inline)) void momentum_as(
        const void *grad, const int gdt, const uint8_t *codes, int64_t idx, int64_t n,
        float s_old, const gefen_shared *sh, float *restrict mc, float *restrict gc) {
    const float *cb = sh->cb;
    const float b1 = sh->b1, omb1 = sh->omb1;
    const int maximize = sh->maximize;
    for (int64_t i = 0; i < n; i++) {
        float g = load(grad, gdt, idx + i);
        g = maximize ? -g : g;
        mc[i] = ema(b1, omb1, s_old, cb[codes[idx + i]], g);
        gc[i] = g;
    }
}

static void momentum(const void *grad, int gdt, const uint8_t *codes, int64_t idx, int64_t n,
                     float s_old, const gefen_shared *sh, float *mc, float *gc) {
    if (gdt == 0) momentum_as(grad, 0, codes, idx, n, s_old, sh, mc, gc);
    else if (gdt == 1) momentum_as(grad, 1, codes, idx, n, s_old, sh, mc, gc);
    else momentum_as(grad, 2, codes, idx, n, s_old, sh, mc, gc);
}

/* The new codes of elements [idx, idx + n) of a block (n <= CHUNK) from their momenta mc and
 * gradients gc: q[i] and the codeword cq[i] = cb[q[i]]. One probe of the bucket table for
 * every element (vectorised), then the scalar search for the elements whose bucket holds more
 * than one codeword. */
static inline __attribute__((always_inline)) void codes_of_as(
        const float *restrict mc, const float *restrict gc, int64_t idx, int n, float s_new,
        const gefen_shared *sh, const int stochastic, uint64_t seed, int32_t *restrict q,
        float *restrict cq) {
    const float *cb = sh->cb;
    const int32_t *table = sh->table;
    const uint64_t *probe = sh->probe, *pairs = sh->pairs;
    const int positive = s_new > 0.0f;
    const float cmax = cb[NUM_CODEWORDS - 1], c0 = cb[0];
    float zs[CHUNK];
    int32_t redo[CHUNK];
    int any = 0;
    for (int i = 0; i < n; i++) {
        const float ratio = mc[i] / s_new;
        zs[i] = positive ? ratio : 0.0f;
    }
    for (int i = 0; i < n; i++) {
        const float x = zs[i];
        const uint64_t e = probe[bucket_of(x)];
        const int j = (int)(e & 0x1FFu);
        const int multi = (int)((e >> 16) & 1u);
        const float cj = from_bits((uint32_t)(e >> 32));
        const int lb = j + (cj < x);
        /* choose(), inlined with the same operations */
        const int right = lb > NUM_CODEWORDS - 1 ? NUM_CODEWORDS - 1 : lb;
        const int left = right > 0 ? right - 1 : 0;
        const uint64_t pair = pairs[right];
        const float c_left = from_bits((uint32_t)pair);
        const float c_right = from_bits((uint32_t)(pair >> 32));
        const float d_left = fabsf(x - c_left), d_right = fabsf(x - c_right);
        /* 0/1 integers and masks instead of nested conditionals (vectorisable) */
        const int zero_grad = gc[i] == 0.0f;
        const int straddle = (c_left < 0.0f) & (c_right > 0.0f);
        const int floor_left = (c_right > x) & (x > 0.0f);
        const int le = d_left <= d_right;
        const int zero_left = (straddle & le) | ((1 - straddle) & floor_left);
        int other_left;
        if (stochastic) {
            const float u = sr_uniform(seed, idx + i);
            const float width = c_right - c_left;
            float clamped = x < c_left ? c_left : x;
            clamped = clamped > c_right ? c_right : clamped;
            const float frac = (clamped - c_left) / width;
            const float p_up = width > 0.0f ? frac : 0.0f;
            other_left = 1 - (u < p_up);
        } else {
            other_left = (1 - (x > cmax)) & (1 - (d_left > d_right));
        }
        const int go_left = (zero_grad & zero_left) | ((1 - zero_grad) & other_left);
        const int nan = x != x;
        q[i] = nan ? 0 : (go_left ? left : right);
        cq[i] = nan ? c0 : (go_left ? c_left : c_right);
        const int r = multi & !nan;
        redo[i] = r;
        any |= r;
    }
    if (!any) return;
    for (int i = 0; i < n; i++) {
        if (!redo[i]) continue;
        const float u = stochastic ? sr_uniform(seed, idx + i) : 0.0f;
        const int qi = quantize(zs[i], gc[i] == 0.0f, stochastic, u, cb, table);
        q[i] = qi;
        cq[i] = cb[qi];
    }
}

static void store_codes(uint8_t *restrict codes, const int32_t *restrict q, int64_t n) {
    for (int64_t i = 0; i < n; i++) codes[i] = (uint8_t)q[i];
}

static void codes_of(const float *mc, const float *gc, int64_t idx, int n, float s_new,
                     const gefen_shared *sh, uint64_t seed, int32_t *q, float *cq) {
    if (sh->stochastic) codes_of_as(mc, gc, idx, n, s_new, sh, 1, seed, q, cq);
    else codes_of_as(mc, gc, idx, n, s_new, sh, 0, seed, q, cq);
}

/* The parameter write of elements [idx, idx + n) of a block (one row in factored mode):
 * p = f32(f32(p * decay) - f32(f32(mhat * sigma) * lr)), mhat = cq * s_new. */
static inline __attribute__((always_inline)) void write_as(
        const gefen_tensor *t, const int pdt, const int factored, int64_t idx, int64_t n,
        const float *cq, float s_new, float sig_b, float rr, const float *kk, float inv_rbar,
        float eps) {
    void *param = t->param;
    const float lr = t->lr, bc2 = t->bc2, bc1_recip = t->bc1_recip, decay = t->decay;
    for (int64_t i = 0; i < n; i++) {
        float mhat = cq[i] * s_new;
        float sigma = sig_b;
        if (factored) {
            const float prod = rr * kk[i];
            const float v = prod * inv_rbar;
            float h = sqrtf(v * bc2);
            h = h + eps;
            sigma = (1.0f / h) * bc1_recip;
            mhat = v == 0.0f ? 0.0f : mhat;
        }
        const float step = (mhat * sigma) * lr;
        const float decayed = round_to(load(param, pdt, idx + i) * decay, pdt);
        store(param, pdt, idx + i, decayed - step);
    }
}

static void write_params(const gefen_tensor *t, int64_t idx, int64_t n, const float *cq,
                         float s_new, float sig_b, float rr, const float *kk, float inv_rbar,
                         float eps) {
#define WRITE(P) \
    if (t->pdt == P) { \
        if (t->factored) write_as(t, P, 1, idx, n, cq, s_new, sig_b, rr, kk, inv_rbar, eps); \
        else write_as(t, P, 0, idx, n, cq, s_new, sig_b, rr, kk, inv_rbar, eps); \
        return; }
    WRITE(0) WRITE(1) WRITE(2)
#undef WRITE
}

/* The Gefen step of blocks [first, stop) of one tensor (block_step / factored_step,
 * gefen_kernels/ops/_step_ref.py run_step). Block mode: sigma of block b from sqrt_v[b];
 * factored mode: sigma of element (i, j) from r[i], k[j] and inv_rbar. */
static void step_blocks(const gefen_tensor *t, const gefen_shared *sh, int64_t first,
                        int64_t stop) {
    const int64_t period = t->period, ncols = t->ncols;
    const int factored = t->factored;
    const float eps = sh->eps;
    float inv_rbar = t->inv_rbar;
    if (factored && t->r_total != 0) {
        /* f32(1 / max(f32(total / f32(R)), FLT_MIN)), NaN kept (torch.clamp) */
        float mean = *t->r_total / (float)t->rows;
        mean = mean < 0x1.0p-126f ? 0x1.0p-126f : mean;
        inv_rbar = 1.0f / mean;
    }
    int32_t q[CHUNK];
    float cq[CHUNK];
    float mc[MOMENTUM_CACHE], gc[MOMENTUM_CACHE];
    for (int64_t blk = first; blk < stop; blk++) {
        const int64_t base = blk * period;
        const float s_old = t->scale[blk];
        const float s_new = block_max(t->grad, t->gdt, t->codes, base, period, s_old, sh, mc,
                                      gc);
        const int kept = period <= MOMENTUM_CACHE;
        float sig_b = 0.0f;
        if (!factored) {
            float h = t->sqrt_v[blk] * t->bc2;
            h = h + eps;
            sig_b = (1.0f / h) * t->bc1_recip;
        }
        int64_t off = 0;
        while (off < period) {
            const int64_t idx = base + off;
            int64_t n = period - off < CHUNK ? period - off : CHUNK;
            int64_t row = 0, col = 0;
            if (factored) {
                row = idx / ncols;
                col = idx - row * ncols;
                if (ncols - col < n) n = ncols - col;   /* one row per chunk */
            }
            const float *m = mc + off, *g = gc + off;
            if (!kept) {
                momentum(t->grad, t->gdt, t->codes, idx, n, s_old, sh, mc, gc);
                m = mc;
                g = gc;
            }
            codes_of(m, g, idx, (int)n, s_new, sh, t->seed, q, cq);
            store_codes(t->codes + idx, q, n);
            if (t->write_param)
                write_params(t, idx, n, cq, s_new, sig_b, factored ? t->r[row] : 0.0f,
                             factored ? t->k + col : 0, inv_rbar, eps);
            off += n;
        }
        t->scale[blk] = s_new;
    }
}

/* The Muon momentum value of elements [idx, idx + n) (gdt): round(cb_out[q] * s_new), with
 * Nesterov f32(f32(omb * g) + round(round(value) * b)). */
static inline __attribute__((always_inline)) void muon_write_as(
        const gefen_tensor *t, const int gdt, const gefen_shared *sh, int64_t idx, int64_t n,
        const int32_t *restrict q, const float *restrict g, float s_new) {
    const float *cb_out = sh->cb_out;
    const float b = sh->b1, omb = sh->omb1;
    const int nesterov = sh->nesterov;
    void *out = t->param;
    for (int64_t i = 0; i < n; i++) {
        float value = round_to(cb_out[q[i]] * s_new, gdt);
        const float look = round_to(value * b, gdt);
        const float a = omb * g[i];
        value = nesterov ? a + look : value;
        store(out, gdt, idx + i, value);
    }
}

/* The quantized Muon momentum of blocks [first, stop) (gefen_kernels/ops/muon_momentum.py
 * muon_momentum_reference): codes and scales in place, the dense momentum in t->param (gdt).
 * sh->b1 / sh->omb1 hold beta / 1 - beta. */
static void muon_blocks(const gefen_tensor *t, const gefen_shared *sh, int64_t first,
                        int64_t stop) {
    const int64_t period = t->period;
    int32_t q[CHUNK];
    float cq[CHUNK];
    float mc[MOMENTUM_CACHE], gc[MOMENTUM_CACHE];
    for (int64_t blk = first; blk < stop; blk++) {
        const int64_t base = blk * period;
        const float s_old = t->scale[blk];
        const float s_new = block_max(t->grad, t->gdt, t->codes, base, period, s_old, sh, mc,
                                      gc);
        const int kept = period <= MOMENTUM_CACHE;
        for (int64_t off = 0; off < period; off += CHUNK) {
            const int64_t idx = base + off;
            const int64_t n = period - off < CHUNK ? period - off : CHUNK;
            const float *m = mc + off, *g = gc + off;
            if (!kept) {
                momentum(t->grad, t->gdt, t->codes, idx, n, s_old, sh, mc, gc);
                m = mc;
                g = gc;
            }
            codes_of(m, g, idx, (int)n, s_new, sh, t->seed, q, cq);
            store_codes(t->codes + idx, q, n);
            if (t->gdt == 0) muon_write_as(t, 0, sh, idx, n, q, g, s_new);
            else if (t->gdt == 1) muon_write_as(t, 1, sh, idx, n, q, g, s_new);
            else muon_write_as(t, 2, sh, idx, n, q, g, s_new);
        }
        t->scale[blk] = s_new;
    }
}

static void step_tensor(const gefen_tensor *t, const gefen_shared *sh, int64_t first,
                        int64_t stop, int muon) {
    if (muon) muon_blocks(t, sh, first, stop);
    else step_blocks(t, sh, first, stop);
}

/* A thread's share: blocks from (t0, b0) up to, not including, (t1, b1). */
typedef struct {
    const gefen_tensor *ts;
    const gefen_shared *sh;
    int64_t t0, b0, t1, b1;
    int muon;
} gefen_range;

static void run_range(const gefen_range *w) {
    for (int64_t i = w->t0; i <= w->t1 && i >= 0; i++) {
        const int64_t first = i == w->t0 ? w->b0 : 0;
        const int64_t stop = i == w->t1 ? w->b1 : w->ts[i].num_blocks;
        if (stop > first) step_tensor(&w->ts[i], w->sh, first, stop, w->muon);
    }
}

#if !defined(_OPENMP) && !defined(_WIN32)
static void *run_thread(void *arg) {
    run_range((const gefen_range *)arg);
    return 0;
}
#endif

/* The block position (tensor, block) where element offset `target` of the concatenated
 * tensors falls, rounded up to a block boundary. */
static void locate(const gefen_tensor *ts, int64_t n, int64_t target, int64_t *ti,
                   int64_t *bi) {
    int64_t start = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t size = ts[i].num_blocks * ts[i].period;
        if (target < start + size) {
            *ti = i;
            *bi = (target - start + ts[i].period - 1) / ts[i].period;
            return;
        }
        start += size;
    }
    *ti = n - 1;
    *bi = n > 0 ? ts[n - 1].num_blocks : 0;
}

/* Entry point: step every tensor of ts[0 .. n), the blocks split over `threads` threads in
 * contiguous ranges of about equal element counts (the calling thread takes the first). */
void gefen_cpu_run(const gefen_tensor *ts, int64_t n, const gefen_shared *shared,
                   int threads, int muon) {
    if (n <= 0) return;
    uint64_t probe[BINS], pairs[NUM_CODEWORDS];
    gefen_shared local = *shared;
    const gefen_shared *sh = &local;
    for (int b = 0; b < BINS; b++) {
        const int32_t j = shared->table[b], end = shared->table[b + 1];
        const float c = j < end ? shared->cb[j] : INFINITY;
        probe[b] = (uint64_t)((uint32_t)j | ((uint32_t)(end - j > 1) << 16))
                   | ((uint64_t)to_bits(c) << 32);
    }
    for (int r = 0; r < NUM_CODEWORDS; r++)
        pairs[r] = (uint64_t)to_bits(shared->cb[r > 0 ? r - 1 : 0])
                   | ((uint64_t)to_bits(shared->cb[r]) << 32);
    local.probe = probe;
    local.pairs = pairs;
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) total += ts[i].num_blocks * ts[i].period;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    gefen_range ranges[MAX_THREADS];
    for (int k = 0; k < threads; k++) {
        gefen_range *w = &ranges[k];
        w->ts = ts; w->sh = sh; w->muon = muon;
        locate(ts, n, total / threads * k + (total % threads) * k / threads, &w->t0, &w->b0);
        if (k == threads - 1) { w->t1 = n - 1; w->b1 = ts[n - 1].num_blocks; }
    }
    for (int k = 0; k + 1 < threads; k++) {
        ranges[k].t1 = ranges[k + 1].t0;
        ranges[k].b1 = ranges[k + 1].b0;
    }
#if defined(_OPENMP)
    /* The process's OpenMP pool: torch's own when this library resolves the libgomp torch
     * loaded (the same soname), so the worker that torch's last parallel region left spinning
     * takes a share at once instead of competing with a thread of ours for its core. */
    #pragma omp parallel num_threads(threads)
    {
        const int got = omp_get_num_threads();
        for (int k = omp_get_thread_num(); k < threads; k += got) run_range(&ranges[k]);
    }
#elif !defined(_WIN32)
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS];
    for (int k = 1; k < threads; k++)
        started[k] = pthread_create(&ids[k], 0, run_thread, &ranges[k]) == 0;
    run_range(&ranges[0]);
    for (int k = 1; k < threads; k++) {
        if (started[k]) pthread_join(ids[k], 0);
        else run_range(&ranges[k]);
    }
#else
    for (int k = 0; k < threads; k++) run_range(&ranges[k]);
#endif
}

/* Block second moment (docs/algorithm.md#block-second-moment step 2, as _second_moment):
 * v = f32(f32(b2 * v) + f32(omb2 * f32(sumsq / f32(P)))), n blocks. */
void gefen_cpu_block_v(float *v, const float *sumsq, int64_t n, int64_t period, float b2,
                       float omb2) {
    const float p = (float)period;
    for (int64_t i = 0; i < n; i++) {
        const float mean = sumsq[i] / p;
        const float a = b2 * v[i];
        const float b = omb2 * mean;
        v[i] = a + b;
    }
}

/* Factored EMA (docs/algorithm.md#factored-second-moment step 1, as factored_step._ema):
 * s = f32(f32(s * b2) + f32(f32(total * inv) * omb2)), n entries. */
void gefen_cpu_factored_ema(float *s, const float *total, int64_t n, float inv, float b2,
                            float omb2) {
    for (int64_t i = 0; i < n; i++) {
        const float a = s[i] * b2;
        const float mean = total[i] * inv;
        const float b = mean * omb2;
        s[i] = a + b;
    }
}
