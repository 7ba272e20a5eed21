/* A Mamba2 mixer's sequential part (kernels/mamba2.py): the causal depthwise convolution over
 * the x, B, C channels with its state, the selective state-space recurrence (SSD, one token at
 * a time), and the gated, grouped RMSNorm; the in and out projections around it are the
 * model's linear layers.
 *
 * Every output and every state value is computed by a fixed sequence of float32 operations
 * over its own sequence's earlier tokens (no FMA contraction, sums in a fixed order), token after
 * token: a prompt fed in chunks gives the bits of one pass (the states between chunks are the
 * float32 values the next token reads anyway), and a sequence's rows do not depend on which
 * other sequences share the call. That is what makes prefix reuse from a saved state, chunked
 * prefill and batching exact for these layers.
 *
 * Layout, per call of S sequences over T rows (sequence s owns rows starts[s] .. starts[s] +
 * lens[s]):
 *   proj  (T, I + CD + H)  the in projection's rows: gate z, then x B C (CD channels), then dt
 *   conv_state (slots, CD, K - 1)  the K - 1 last inputs of each channel, oldest first
 *   ssm_state  (slots, H, P, N)    the recurrent state, float32
 *   xbc (T, CD) scratch: the convolution's outputs after SiLU
 *   out (T, I)  the normalized, gated scan outputs (the out projection's input)
 * Checkpoints: for each j in save_starts[s] .. save_starts[s + 1], sequence s copies its
 * states after its first saved[j] rows (non-decreasing, 1 .. its row count) into slot
 * save_slots[j] of both pools (a slot no sequence of the call runs in nor another save names).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {                   /* a layer's constants, fixed at load */
    int64_t heads, head_dim, state, groups, kernel;   /* H, P, N, G, K */
    int64_t inner;                 /* I = H * P */
    const float *conv_weight;      /* (CD, K) */
    const float *conv_bias;        /* (CD,) or NULL */
    const float *dt_bias, *A, *D;  /* (H,) each; A = -exp(A_log) */
    const float *norm_weight;      /* (I,) */
    float norm_eps, dt_min, dt_max;
} mamba2_layer;

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* sum of a[n] * b[n]: 8 chains (chain l takes n = l, l + 8, ...), added as the tree
 * ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7)): a fixed order the compiler may vectorize */
static inline float dot8(const float *a, const float *b, int64_t n) {
    float c[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) {
            const float prod = a[i + l] * b[i + l];
            c[l] = c[l] + prod;
        }
    for (int l = 0; i < n; i++, l++) {
        const float prod = a[i] * b[i];
        c[l] = c[l] + prod;
    }
    return ((c[0] + c[1]) + (c[2] + c[3])) + ((c[4] + c[5]) + (c[6] + c[7]));
}

/* torch's softplus (beta 1, threshold 20) */
static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

static void convolve(const mamba2_layer *m, int64_t S, const int64_t *starts, const int64_t *lens,
                     const int64_t *slots,
                     const float *proj, float *conv_state, float *xbc, const int64_t *save_starts,
                     const int64_t *saved, const int64_t *save_slots) {
    const int64_t H = m->heads, I = m->inner, K = m->kernel;
    const int64_t CD = I + 2 * m->groups * m->state, width = I + CD + H;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t s = 0; s < S; s++) {
        for (int64_t c = 0; c < CD; c++) {
            float window[K];   /* the K inputs ending at the current token, oldest first */
            float *state = conv_state + (slots[s] * CD + c) * (K - 1);
            const float *w = m->conv_weight + c * K;
            memcpy(window, state, (size_t)(K - 1) * sizeof(float));
            int64_t next_save = save_starts[s];
            for (int64_t t = starts[s]; t < starts[s] + lens[s]; t++) {
                window[K - 1] = proj[t * width + I + c];
                float acc = m->conv_bias ? m->conv_bias[c] : 0.0f;
                for (int64_t k = 0; k < K; k++) {
                    const float term = w[k] * window[k];
                    acc = acc + term;
                }
                xbc[t * CD + c] = silu(acc);
                memmove(window, window + 1, (size_t)(K - 1) * sizeof(float));
                while (next_save < save_starts[s + 1] && saved[next_save] == t - starts[s] + 1) {
                    memcpy(conv_state + (save_slots[next_save] * CD + c) * (K - 1), window,
                           (size_t)(K - 1) * sizeof(float));
                    next_save++;
                }
            }
            memcpy(state, window, (size_t)(K - 1) * sizeof(float));
        }
    }
}

static void scan(const mamba2_layer *m, int64_t S, const int64_t *starts, const int64_t *lens,
                 const int64_t *slots,
                 const float *proj, float *ssm_state, const float *xbc, float *out,
                 const int64_t *save_starts, const int64_t *saved, const int64_t *save_slots) {
    const int64_t H = m->heads, P = m->head_dim, N = m->state, G = m->groups, I = m->inner;
    const int64_t CD = I + 2 * G * N, width = I + CD + H, heads_per_group = H / G;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t s = 0; s < S; s++) {
        for (int64_t h = 0; h < H; h++) {
            float *state = ssm_state + (slots[s] * H + h) * P * N;
            const int64_t g = h / heads_per_group;
            const float A = m->A[h], D = m->D[h];
            int64_t next_save = save_starts[s];
            for (int64_t t = starts[s]; t < starts[s] + lens[s]; t++) {
                float dt = softplus(proj[t * width + I + CD + h] + m->dt_bias[h]);
                dt = fminf(fmaxf(dt, m->dt_min), m->dt_max);
                const float decay = expf(dt * A);
                const float *x = xbc + t * CD + h * P;
                const float *B = xbc + t * CD + I + g * N;
                const float *C = xbc + t * CD + I + G * N + g * N;
                float *y = out + t * I + h * P;
                for (int64_t p = 0; p < P; p++) {
                    const float xdt = x[p] * dt;
                    float *row = state + p * N;
                    for (int64_t n = 0; n < N; n++) {
                        const float kept = row[n] * decay, added = B[n] * xdt;
                        row[n] = kept + added;
                    }
                    y[p] = dot8(row, C, N) + D * x[p];
                }
                while (next_save < save_starts[s + 1] && saved[next_save] == t - starts[s] + 1) {
                    memcpy(ssm_state + (save_slots[next_save] * H + h) * P * N, state,
                           (size_t)(P * N) * sizeof(float));
                    next_save++;
                }
            }
        }
    }
}

/* out = weight * rms_norm_per_group(y * silu(z)), in place over out's rows */
static void gated_norm(const mamba2_layer *m, int64_t T, const float *proj, float *out) {
    const int64_t I = m->inner, G = m->groups, size = I / G;
    const int64_t width = I + (I + 2 * G * m->state) + m->heads;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t g = 0; g < G; g++) {
            float *y = out + t * I + g * size;
            const float *z = proj + t * width + g * size;
            const float *w = m->norm_weight + g * size;
            float squares = 0.0f;
            for (int64_t i = 0; i < size; i++) {
                y[i] = y[i] * silu(z[i]);
                const float sq = y[i] * y[i];
                squares = squares + sq;
            }
            const float inv = 1.0f / sqrtf(squares / (float)size + m->norm_eps);
            for (int64_t i = 0; i < size; i++) {
                const float normed = y[i] * inv;
                y[i] = w[i] * normed;
            }
        }
    }
}

void rtpkv_mamba2_mix(const mamba2_layer *m, int64_t T, int64_t S, const int64_t *starts,
                      const int64_t *lens, const int64_t *slots, const float *proj,
                      float *conv_state, float *ssm_state, float *xbc, float *out, const int64_t *save_starts,
                      const int64_t *saved, const int64_t *save_slots) {
    convolve(m, S, starts, lens, slots, proj, conv_state, xbc, save_starts, saved, save_slots);
    scan(m, S, starts, lens, slots, proj, ssm_state, xbc, out, save_starts, saved, save_slots);
    gated_norm(m, T, proj, out);
}
