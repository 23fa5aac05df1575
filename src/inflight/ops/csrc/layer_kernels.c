/* A Llama-family decoder in one call: the embedding lookup; for each layer,
 * residual add + RMSNorm, the fused q/k/v projection, rotary embedding, the KV
 * cache write, paged attention, the output projection, residual add + RMSNorm,
 * the fused gate/up projection, SiLU-and-multiply and the down projection;
 * then the final residual add + RMSNorm. Each step goes through the kernels
 * of the other C sources (linear layers on float32, bf16 or quantized panels;
 * a float32 or bf16 KV cache).
 *
 * It computes what the model's modules compute through those same kernels one
 * call at a time; run from Python, the calls cost more than the arithmetic
 * of a decode step (a few microseconds each, a dozen per layer, and several
 * times that once the step's weights have pushed Python out of the caches).
 */
#include <omp.h>
#include <stddef.h>
#include <string.h>

#include "kernels.h"

/* A linear layer's weight as packed at load. */
typedef struct {
    int64_t format;      /* -1: float32 panels; else the format's code (quant_kernels.c) */
    const void *data;    /* the panels */
    const float *scale;  /* int8 and W8A8 column scales, or NULL */
    const float *bias;   /* or NULL */
    int64_t out_features, in_features;
} inflight_linear;

typedef struct {
    inflight_linear qkv, o, gate_up, down;
    const float *input_norm, *post_norm;  /* RMSNorm weights */
    void *k_cache, *v_cache;              /* [kv_heads, num_blocks, block_size, head_dim] */
    int64_t window;                       /* sliding window, 0: none */
} inflight_layer;

typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t num_blocks, block_size;
    int64_t kv_bf16;  /* the KV caches' elements: 0 float32, 1 bf16 */
    float eps, scale;
    const float *cos, *sin;  /* rotary tables [max_positions, head_dim / 2] */
    /* The token embedding: a float32 table [vocab, hidden] (format -1), or
     * panels of another format (in_features = hidden): its own, or those of
     * the output layer it is tied to. */
    inflight_linear embedding;
    const float *final_norm;  /* RMSNorm weight after the last layer */
} inflight_model;

/* One step's tokens: their ids, positions and cache slots, the attention
 * layout (as for inflight_paged_attention), scratch rows for each stage,
 * and where to add the seconds spent in linear layers, in attention (with the
 * KV writes) and in the rest (NULL: not timed). */
typedef struct {
    int64_t num_tokens;
    const int64_t *input_ids, *positions, *slots;
    const int64_t *block_table, *row_tables, *seq_lens;
    int64_t max_blocks;
    float *qkv, *attn, *normed, *gate_up, *act;
    double *seconds;
} inflight_step;

enum { TIME_LINEAR, TIME_ATTENTION, TIME_OTHER };

/* Adds the time since *mark to seconds[what] and moves the mark. */
static inline void lap(double *seconds, int what, double *mark)
{
    if (seconds == NULL)
        return;
    const double now = omp_get_wtime();
    seconds[what] += now - *mark;
    *mark = now;
}

/* y = x W^T (+ bias) for m rows, its time added as a linear layer's. */
static int run_linear(const inflight_linear *w, const float *x, float *y, int64_t m,
                      double *seconds, double *mark)
{
    int status = 0;
    if (w->format < 0)
        inflight_linear_f32(x, w->data, w->bias, y, m, w->out_features, w->in_features);
    else
        status = inflight_quant_linear(w->format, x, w->data, w->scale, w->bias, y, m,
                                       w->out_features, w->in_features);
    lap(seconds, TIME_LINEAR, mark);
    return status;
}

/* out [T, hidden]: the final hidden states (normed). x and residual [T,
 * hidden] are scratch: each layer's output and the residual stream. Returns 0,
 * or the first failing kernel's status. */
int inflight_decoder_layers(const inflight_model *m, const inflight_layer *layers,
                            int64_t num_layers, const inflight_step *s, float *x,
                            float *residual, float *out)
{
    const int64_t t = s->num_tokens, d = m->head_dim;
    const int64_t q_size = m->num_heads * d, kv_size = m->num_kv_heads * d;
    const int64_t width = q_size + 2 * kv_size;
    double *seconds = s->seconds, mark = seconds ? omp_get_wtime() : 0.0;
    int status;
    const inflight_linear *e = &m->embedding;
    if (e->format < 0) {
        for (int64_t i = 0; i < t; i++)
            memcpy(x + i * m->hidden, (const float *)e->data + s->input_ids[i] * m->hidden,
                   (size_t)m->hidden * sizeof(float));
    } else {
        inflight_quant_embedding(e->format, s->input_ids, t, e->data, e->scale, x, m->hidden);
    }
    memset(residual, 0, (size_t)(t * m->hidden) * sizeof(float));
    lap(seconds, TIME_OTHER, &mark);
    for (int64_t l = 0; l < num_layers; l++) {
        const inflight_layer *layer = &layers[l];
        inflight_add_rms_norm_f32(x, residual, layer->input_norm, s->normed, t, m->hidden,
                                  m->eps);
        lap(seconds, TIME_OTHER, &mark);
        if ((status = run_linear(&layer->qkv, s->normed, s->qkv, t, seconds, &mark)) != 0)
            return status;
        inflight_rotary_f32(s->qkv, t, width, m->num_heads + m->num_kv_heads, d, s->positions,
                            m->cos, m->sin);
        lap(seconds, TIME_OTHER, &mark);
        inflight_write_kv(s->qkv + q_size, width, s->qkv + q_size + kv_size, width,
                          layer->k_cache, layer->v_cache, m->kv_bf16, s->slots, t,
                          m->num_kv_heads, m->num_blocks * m->block_size, d);
        status = inflight_paged_attention(
            s->qkv, width, s->attn, q_size, t, layer->k_cache, layer->v_cache, m->kv_bf16,
            m->num_blocks, m->block_size, s->block_table, s->row_tables, s->max_blocks,
            s->seq_lens, m->num_heads, m->num_kv_heads, d, m->scale, layer->window,
            0.0f /* the Llama family's logits are not soft-capped */);
        if (status != 0)
            return status;
        lap(seconds, TIME_ATTENTION, &mark);
        if ((status = run_linear(&layer->o, s->attn, x, t, seconds, &mark)) != 0)
            return status;
        inflight_add_rms_norm_f32(x, residual, layer->post_norm, s->normed, t, m->hidden,
                                  m->eps);
        lap(seconds, TIME_OTHER, &mark);
        if ((status = run_linear(&layer->gate_up, s->normed, s->gate_up, t, seconds,
                                 &mark)) != 0)
            return status;
        inflight_silu_and_mul_f32(s->gate_up, s->act, t, m->intermediate);
        lap(seconds, TIME_OTHER, &mark);
        if ((status = run_linear(&layer->down, s->act, x, t, seconds, &mark)) != 0)
            return status;
    }
    inflight_add_rms_norm_f32(x, residual, m->final_norm, out, t, m->hidden, m->eps);
    lap(seconds, TIME_OTHER, &mark);
    return 0;
}
