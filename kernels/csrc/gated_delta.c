/* Gated DeltaNet (Qwen3-Next, Qwen3.5): the short causal convolution and the gated delta rule,
 * token by token, for a batch of sequences each reading and advancing its own state slot.
 *
 * Exactness: every value a token produces (its convolution output, its state update, its
 * output row) is computed by the same scalar expressions in the same order from that sequence's
 * own values, one token after another. So the state after n tokens has the same bits however
 * the tokens were split into chunks and whichever sequences shared the call; the thread split
 * (pairs of sequence and channel, then of sequence and value head) changes who computes a value,
 * never how. Loops over a row's lanes (v) carry no sum across lanes, so the compiler's vectors
 * do not change the order either. Built with -ffp-contract=off: no product is fused into a sum.
 *
 * Layouts (float32, row-major):
 *   qkv      (T, conv_dim)   the projection before the convolution: q (Hk*Dk), k (Hk*Dk), v (Hv*Dv)
 *   b, a     (T, Hv)         beta's and the decay's inputs
 *   z        (T, Hv*Dv)      the output gate
 *   conv_w   (conv_dim, K)   depthwise weights, no bias
 *   conv_st  (slots, conv_dim, K-1)  the last K-1 inputs of each channel, oldest first
 *   rec_st   (slots, Hv, Dk, Dv)     the recurrent matrix of each value head
 *   mixed    (T, conv_dim)   scratch: the convolution's outputs after SiLU
 *   out      (T, Hv*Dv)      the gated RMSNorm of each head's output
 * snap_start[i]..snap_start[i+1] index snap_tokens / snap_slots: after snap_tokens[j] tokens of
 * sequence i its state (both tensors) is copied into slot snap_slots[j].
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_DK 1024

static inline float sigmoid1(float x) { return 1.0f / (1.0f + expf(-x)); }

static inline float silu1(float x) { return x / (1.0f + expf(-x)); }

/* torch's softplus (beta 1, threshold 20) */
static inline float softplus1(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* x[0..n) scaled by 1 / sqrt(sum x^2 + 1e-6) (the l2norm of FLA and transformers), then by
 * `scale`; the sum in index order. */
static void l2norm(const float *x, float *y, int64_t n, float scale) {
    float ss = 0.0f;
    for (int64_t d = 0; d < n; d++) ss = ss + x[d] * x[d];
    const float inv = 1.0f / sqrtf(ss + 1e-6f);
    for (int64_t d = 0; d < n; d++) y[d] = (x[d] * inv) * scale;
}

static void conv_channel(const float *qkv, const float *conv_w, float *conv_st, float *mixed,
                         int64_t row0, int64_t len, int64_t c, int64_t conv_dim, int64_t K,
                         const int64_t *snap_tokens, const int64_t *snap_slots, int64_t s0,
                         int64_t s1, int64_t slot) {
    const float *w = conv_w + c * K;
    float *st = conv_st + (slot * conv_dim + c) * (K - 1);
    for (int64_t t = 0; t < len; t++) {
        const int64_t row = row0 + t;
        const float x = qkv[row * conv_dim + c];
        float acc = w[K - 1] * x;
        if (K > 1) {
            acc = w[0] * st[0];
            for (int64_t j = 1; j < K - 1; j++) acc = acc + w[j] * st[j];
            acc = acc + w[K - 1] * x;
            for (int64_t j = 0; j < K - 2; j++) st[j] = st[j + 1];
            st[K - 2] = x;
        }
        mixed[row * conv_dim + c] = silu1(acc);
        for (int64_t s = s0; s < s1; s++)
            if (snap_tokens[s] == t + 1 && K > 1)
                memcpy(conv_st + (snap_slots[s] * conv_dim + c) * (K - 1), st,
                       sizeof(float) * (K - 1));
    }
}

static void delta_head(const float *mixed, const float *b, const float *a, const float *z,
                       const float *A_log, const float *dt_bias, const float *norm_w, float eps,
                       float *rec_st, float *out, int64_t row0, int64_t len, int64_t h,
                       int64_t conv_dim, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv,
                       const int64_t *snap_tokens, const int64_t *snap_slots, int64_t s0,
                       int64_t s1, int64_t slot) {
    const int64_t g = h / (Hv / Hk), key_dim = Hk * Dk;
    const float scale = 1.0f / sqrtf((float)Dk);
    float *S = rec_st + ((slot * Hv) + h) * Dk * Dv;
    float q[MAX_DK], k[MAX_DK], mem[MAX_DK], o[MAX_DK];
    const float A = expf(A_log[h]);
    for (int64_t t = 0; t < len; t++) {
        const int64_t row = row0 + t;
        const float *x = mixed + row * conv_dim;
        l2norm(x + g * Dk, q, Dk, scale);
        l2norm(x + key_dim + g * Dk, k, Dk, 1.0f);
        const float *v = x + 2 * key_dim + h * Dv;
        const float beta = sigmoid1(b[row * Hv + h]);
        const float decay = expf(-A * softplus1(a[row * Hv + h] + dt_bias[h]));
        for (int64_t i = 0; i < Dk * Dv; i++) S[i] = S[i] * decay;
        for (int64_t e = 0; e < Dv; e++) mem[e] = 0.0f;
        for (int64_t d = 0; d < Dk; d++)
            for (int64_t e = 0; e < Dv; e++) mem[e] = mem[e] + S[d * Dv + e] * k[d];
        for (int64_t e = 0; e < Dv; e++) mem[e] = (v[e] - mem[e]) * beta;   /* the delta */
        for (int64_t d = 0; d < Dk; d++)
            for (int64_t e = 0; e < Dv; e++) S[d * Dv + e] = S[d * Dv + e] + k[d] * mem[e];
        for (int64_t e = 0; e < Dv; e++) o[e] = 0.0f;
        for (int64_t d = 0; d < Dk; d++)
            for (int64_t e = 0; e < Dv; e++) o[e] = o[e] + S[d * Dv + e] * q[d];
        float ss = 0.0f;
        for (int64_t e = 0; e < Dv; e++) ss = ss + o[e] * o[e];
        const float r = 1.0f / sqrtf(ss / (float)Dv + eps);
        const float *zr = z + row * Hv * Dv + h * Dv;
        float *y = out + row * Hv * Dv + h * Dv;
        for (int64_t e = 0; e < Dv; e++) y[e] = (norm_w[e] * (o[e] * r)) * silu1(zr[e]);
        for (int64_t s = s0; s < s1; s++)
            if (snap_tokens[s] == t + 1)
                memcpy(rec_st + ((snap_slots[s] * Hv) + h) * Dk * Dv, S, sizeof(float) * Dk * Dv);
    }
}

/* Returns 0, or -1 when a dimension is out of the kernel's range (Dk or Dv above MAX_DK). */
int rtpkv_gated_delta(const float *qkv, const float *b, const float *a, const float *z,
                      const float *conv_w, const float *A_log, const float *dt_bias,
                      const float *norm_w, float eps, int64_t num_seqs, const int64_t *starts,
                      const int64_t *lens, const int64_t *slots, const int64_t *snap_start,
                      const int64_t *snap_tokens, const int64_t *snap_slots, float *conv_st,
                      float *rec_st, float *mixed, float *out, int64_t K, int64_t Hk,
                      int64_t Hv, int64_t Dk, int64_t Dv) {
    if (Dk > MAX_DK || Dv > MAX_DK || Hk < 1 || Hv % Hk) return -1;
    const int64_t conv_dim = 2 * Hk * Dk + Hv * Dv;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_seqs * conv_dim; p++) {
            const int64_t i = p / conv_dim, c = p % conv_dim;
            conv_channel(qkv, conv_w, conv_st, mixed, starts[i], lens[i], c, conv_dim, K,
                         snap_tokens, snap_slots, snap_start[i], snap_start[i + 1], slots[i]);
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_seqs * Hv; p++) {
            const int64_t i = p / Hv, h = p % Hv;
            delta_head(mixed, b, a, z, A_log, dt_bias, norm_w, eps, rec_st, out, starts[i],
                       lens[i], h, conv_dim, Hk, Hv, Dk, Dv, snap_tokens, snap_slots,
                       snap_start[i], snap_start[i + 1], slots[i]);
        }
    }
    return 0;
}

/* The gated attention's output (Qwen3-Next, Qwen3.5): x (T, H, D) times sigmoid of the gate
 * beside each query head in q_proj's rows (gate row t, head h at gate + t * row_stride
 * + h * head_stride), in place; each value on its own, so a row's bits do not depend on the
 * rows beside it. */
void rtpkv_sigmoid_gate(float *x, const float *gate, int64_t T, int64_t H, int64_t D,
                        int64_t row_stride, int64_t head_stride) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            float *xr = x + (t * H + h) * D;
            const float *g = gate + t * row_stride + h * head_stride;
            for (int64_t d = 0; d < D; d++) xr[d] = xr[d] * sigmoid1(g[d]);
        }
}
