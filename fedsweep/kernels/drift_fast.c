/* DRIFT's fast divergence pass over column blocks of the clients' uploads around a reference,
 * fused: one read of each float32 entry, u = x − x_R and e = exp(u)·w as float64 into buffers small
 * enough to stay in cache, the extremes of u and the sums Σ e, Σ w u and Σ w per row, and the
 * K×K product H += e uᵀ of the block (4 × 4 tiles, eight lanes each).
 * Built and loaded by fedsweep/kernels/__init__.py; the arithmetic and its error bound are
 * described in fedsweep/algorithms/drift/divergence.py. No OpenMP threads (callers run blocks on
 * threads); `omp simd` only asks for the loops' reductions to be vectorised in any order. */
#include <stdint.h>
#include <string.h>

/* e^v for |v| ≤ 700: v = k ln2 + r with |r| ≤ ln2/2 (Cody–Waite, ln2 in two parts), e^r by its
 * Taylor polynomial of degree 13 (truncation < 4e-18 relative), 2^k from exponent bits. Written
 * without branches or calls so the loop below vectorises; measured within 2 ulp of libm. */
static inline double exp_small(double v) {
    const double inv_ln2 = 1.4426950408889634074;
    const double ln2_hi = 6.93147180369123816490e-01, ln2_lo = 1.90821492927058770002e-10;
    const double shifter = 6755399441055744.0; /* 1.5 · 2^52: adding it rounds to an integer */
    double kd = v * inv_ln2 + shifter;
    kd -= shifter;
    double r = (v - kd * ln2_hi) - kd * ln2_lo;
    double p = 1.0 / 6227020800.0;           /* 1/13! */
    p = p * r + 1.0 / 479001600.0;
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    union { int64_t i; double d; } scale;
    scale.i = ((int64_t)kd + 1023) << 52;
    return p * scale.d;
}

/* One block. rows: k clients; ref: the reference's index among them; pieces: n_pieces runs of
 * columns, piece p taking len[p] entries from offset start[p] of tensor tensor[p] into columns
 * fill[p].. of the block; base[r * n_tensors + j]: the address of row r's tensor j (float32,
 * contiguous). m_ref: the maximum of x_R over the whole adapter (w = e^{x_R − m_ref} ≤ 1).
 * Writes u and e (row stride ld) and w; updates umax, umin, se (Σ e), h (Σ w u) per row and q
 * (Σ w). Returns 0, or 1 where an |x − x_R| or |x_R − m_ref| exceeds 700 (the caller then takes
 * the block another way; nothing it accumulated from this block is kept by the caller). */
static int drift_fast_block(int k, int ref, int n_pieces, const int32_t *tensor, const int64_t *start,
                     const int32_t *len, const int32_t *fill, const int64_t *base, int n_tensors,
                     double m_ref, double *u, double *e, int64_t ld, double *w, double *xr,
                     double *umax, double *umin, double *se, double *h, double *q) {
    int out_of_range = 0;
    double qs = 0.0;
    for (int p = 0; p < n_pieces; p++) {
        const float *src = (const float *)(intptr_t)base[ref * n_tensors + tensor[p]] + start[p];
        double *xr_p = xr + fill[p], *w_p = w + fill[p];
#pragma omp simd reduction(+ : qs) reduction(| : out_of_range)
        for (int i = 0; i < len[p]; i++) {
            double x = (double)src[i];
            double v = x - m_ref;
            out_of_range |= (v < -700.0);
            xr_p[i] = x;
            double wi = exp_small(v < -700.0 ? -700.0 : v);
            w_p[i] = wi;
            qs += wi;
        }
    }
    *q += qs;
    for (int s = 0; s < k; s++) {
        double mx = umax[s], mn = umin[s], sum_e = 0.0, sum_h = 0.0;
        double *us = u + s * ld, *es = e + s * ld;
        for (int p = 0; p < n_pieces; p++) {
            const float *src = (const float *)(intptr_t)base[s * n_tensors + tensor[p]] + start[p];
            const double *xr_p = xr + fill[p], *w_p = w + fill[p];
            double *us_p = us + fill[p], *es_p = es + fill[p];
            int bad = 0;
#pragma omp simd reduction(max : mx) reduction(min : mn) reduction(+ : sum_e, sum_h) reduction(| : bad)
            for (int i = 0; i < len[p]; i++) {
                double v = (double)src[i] - xr_p[i];
                bad |= (v > 700.0) | (v < -700.0);
                double ev = exp_small(v > 700.0 ? 700.0 : (v < -700.0 ? -700.0 : v)) * w_p[i];
                us_p[i] = v;
                es_p[i] = ev;
                mx = v > mx ? v : mx;
                mn = v < mn ? v : mn;
                sum_e += ev;
                sum_h += v * w_p[i];
            }
            out_of_range |= bad;
        }
        umax[s] = mx;
        umin[s] = mn;
        se[s] += sum_e;
        h[s] += sum_h;
    }
    return out_of_range;
}

/* H (kp × kp, row-major) += e uᵀ over the first m columns; e and u have kp rows (a multiple of
 * 4, the rows past k zero) of stride ld. Each (s, t) is summed in eight lanes, then the lanes. */
static void gram(int kp, int64_t m, const double *e, const double *u, int64_t ld, double *H) {
    for (int s0 = 0; s0 < kp; s0 += 4)
        for (int t0 = 0; t0 < kp; t0 += 4) {
            double acc[4][4][8];
            memset(acc, 0, sizeof acc);
            int64_t i = 0;
            for (; i + 8 <= m; i += 8)
                for (int a = 0; a < 4; a++)
                    for (int b = 0; b < 4; b++)
#pragma omp simd
                        for (int l = 0; l < 8; l++)
                            acc[a][b][l] += e[(s0 + a) * ld + i + l] * u[(t0 + b) * ld + i + l];
            for (int a = 0; a < 4; a++)
                for (int b = 0; b < 4; b++) {
                    double sum = 0.0;
                    for (int l = 0; l < 8; l++) sum += acc[a][b][l];
                    for (int64_t j = i; j < m; j++) sum += e[(s0 + a) * ld + j] * u[(t0 + b) * ld + j];
                    H[(s0 + a) * kp + t0 + b] += sum;
                }
        }
}

/* Blocks first..last-1 of a layout (block b: counts[b] pieces from offsets[b], widths[b] columns),
 * each as drift_fast_block and then its product into H (kp × kp, kp = k rounded up to a multiple
 * of 4; u and e have kp rows, the last kp − k zero). Returns 1 as soon as a block is out of range. */
int drift_fast_blocks(int k, int kp, int ref, int first, int last, const int64_t *offsets, const int32_t *counts,
                      const int32_t *widths, const int32_t *tensor, const int64_t *start, const int32_t *len,
                      const int32_t *fill, const int64_t *base, int n_tensors, double m_ref, double *u, double *e,
                      int64_t ld, double *w, double *xr, double *umax, double *umin, double *se, double *h,
                      double *q, double *H) {
    for (int b = first; b < last; b++) {
        int64_t o = offsets[b];
        if (drift_fast_block(k, ref, counts[b], tensor + o, start + o, len + o, fill + o, base, n_tensors, m_ref,
                             u, e, ld, w, xr, umax, umin, se, h, q))
            return 1;
        gram(kp, widths[b], e, u, ld, H);
    }
    return 0;
}
