/* DRIFT's mix (eq. 14), θ_k = Σ_j ρ̂_kj θ_j for every client at once, over column chunks: each
 * upload's chunk is read from memory once and stays in cache while every output's chunk is
 * written; sums in float64, rounded once to float32; the outputs are written with non-temporal
 * stores where the CPU has AVX-512 (nothing here reads them again, and a store that skips the
 * cache does not first read the line). Built and loaded by fedsweep/kernels/__init__.py. */
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

enum { CHUNK = 2048 };

static void store(float *out, const double *acc, int64_t m) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i < m && ((uintptr_t)(out + i) & 63) != 0; i++)
        out[i] = (float)acc[i];
    for (; i + 16 <= m; i += 16) {
        __m256 lo = _mm512_cvtpd_ps(_mm512_loadu_pd(acc + i));
        __m256 hi = _mm512_cvtpd_ps(_mm512_loadu_pd(acc + i + 8));
        _mm512_stream_ps(out + i, _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1));
    }
#endif
    for (; i < m; i++)
        out[i] = (float)acc[i];
}

/* Tensors t0..t1-1. Output k takes the terms offsets[k]..offsets[k+1]-1: upload src_index[·]
 * with weight[·]. src[t * n_src + s]: upload s's tensor t (float32, contiguous); dst[t * n_out + k]:
 * output k's tensor t; size[t]: its entries. */
void drift_mix(int n_out, int n_src, const int32_t *offsets, const int32_t *src_index, const double *weight,
               const int64_t *src, const int64_t *dst, const int64_t *size, int t0, int t1) {
    double acc[CHUNK];
    for (int t = t0; t < t1; t++) {
        for (int64_t c = 0; c < size[t]; c += CHUNK) {
            int64_t m = size[t] - c < CHUNK ? size[t] - c : CHUNK;
            for (int k = 0; k < n_out; k++) {
                for (int j = offsets[k]; j < offsets[k + 1]; j++) {
                    const float *x = (const float *)(intptr_t)src[t * n_src + src_index[j]] + c;
                    double w = weight[j];
                    if (j == offsets[k])
                        for (int64_t i = 0; i < m; i++) acc[i] = w * (double)x[i];
                    else
                        for (int64_t i = 0; i < m; i++) acc[i] += w * (double)x[i];
                }
                store((float *)(intptr_t)dst[t * n_out + k] + c, acc, m);
            }
        }
    }
#ifdef __AVX512F__
    _mm_sfence();
#endif
}
