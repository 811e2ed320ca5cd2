/* A stand-in for libcudnn, on host memory, for tests/test_cudnn.py: the functions
 * netdsl.backends.cudnn declares, with cuDNN's own prototypes (cudnn_graph.h, cudnn_cnn.h
 * of cuDNN 9), computing the three convolutions by their definitions. It checks what a
 * caller can get wrong without a GPU: the argument order, the descriptors, alpha and
 * beta, the workspace given for the algorithm chosen, and that a tensor-op algorithm is
 * never run on a convolution set to FMA math.
 *
 * Its algorithm ranking, for every convolution: a tensor-op entry first (algorithm 2), a
 * default-math one that has no FMA form (3), then algorithm 1 (needs a workspace of the
 * input's bytes), then algorithm 0 (none). fake_last_algo() tells the tests which ran.
 *
 * Build: cc -shared -fPIC -O1 -o libfakecudnn.so fake_cudnn.c
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

typedef int cudnnStatus_t;
enum { OK = 0, BAD_PARAM = 3, NOT_SUPPORTED = 9, EXECUTION_FAILED = 8 };
enum { FLOAT = 0, DOUBLE = 1 };
enum { DEFAULT_MATH = 0, TENSOR_OP_MATH = 1, FMA_MATH = 3 };

typedef struct { int n, c, h, w, dtype, set; } tensor_t;
typedef struct { int k, c, h, w, dtype, set; } filter_t;
typedef struct { int ph, pw, sh, sw, dh, dw, mode, dtype, groups, math; } conv_t;
typedef struct { int algo; int status; float time; size_t memory; int determinism;
                 int mathType; int reserved[3]; } perf_t;

static int last_algo = -1;
static void *last_stream = NULL;

int fake_last_algo(void) { return last_algo; }
void *fake_last_stream(void) { return last_stream; }

size_t cudnnGetVersion(void) { return 91900; }
const char *cudnnGetErrorString(cudnnStatus_t s) {
    switch (s) {
    case OK: return "CUDNN_STATUS_SUCCESS";
    case BAD_PARAM: return "CUDNN_STATUS_BAD_PARAM";
    case NOT_SUPPORTED: return "CUDNN_STATUS_NOT_SUPPORTED";
    default: return "CUDNN_STATUS_EXECUTION_FAILED";
    }
}
cudnnStatus_t cudnnCreate(void **h) { *h = malloc(1); return OK; }
cudnnStatus_t cudnnSetStream(void *h, void *stream) {
    if (!h) return BAD_PARAM;
    last_stream = stream;
    return OK;
}
cudnnStatus_t cudnnCreateTensorDescriptor(void **d) { *d = calloc(1, sizeof(tensor_t)); return OK; }
cudnnStatus_t cudnnCreateFilterDescriptor(void **d) { *d = calloc(1, sizeof(filter_t)); return OK; }
cudnnStatus_t cudnnCreateConvolutionDescriptor(void **d) {
    conv_t *c = calloc(1, sizeof(conv_t));
    c->groups = 1;
    *d = c;
    return OK;
}
cudnnStatus_t cudnnSetTensor4dDescriptor(void *d, int format, int dtype, int n, int c, int h, int w) {
    tensor_t *t = d;
    if (format != 0 || (dtype != FLOAT && dtype != DOUBLE) || n <= 0 || c <= 0 || h <= 0 || w <= 0)
        return BAD_PARAM;
    t->n = n; t->c = c; t->h = h; t->w = w; t->dtype = dtype; t->set = 1;
    return OK;
}
cudnnStatus_t cudnnSetFilter4dDescriptor(void *d, int dtype, int format, int k, int c, int h, int w) {
    filter_t *f = d;
    if (format != 0 || (dtype != FLOAT && dtype != DOUBLE) || k <= 0 || c <= 0 || h <= 0 || w <= 0)
        return BAD_PARAM;
    f->k = k; f->c = c; f->h = h; f->w = w; f->dtype = dtype; f->set = 1;
    return OK;
}
cudnnStatus_t cudnnSetConvolution2dDescriptor(void *d, int ph, int pw, int sh, int sw, int dh,
                                              int dw, int mode, int dtype) {
    conv_t *c = d;
    if (ph < 0 || pw < 0 || sh <= 0 || sw <= 0 || dh <= 0 || dw <= 0 || mode != 1) return BAD_PARAM;
    c->ph = ph; c->pw = pw; c->sh = sh; c->sw = sw; c->dh = dh; c->dw = dw;
    c->mode = mode; c->dtype = dtype;
    return OK;
}
cudnnStatus_t cudnnSetConvolutionGroupCount(void *d, int g) {
    if (g <= 0) return BAD_PARAM;
    ((conv_t *)d)->groups = g;
    return OK;
}
cudnnStatus_t cudnnSetConvolutionMathType(void *d, int m) { ((conv_t *)d)->math = m; return OK; }

/* the shapes agree with each other and with the convolution */
static int consistent(const tensor_t *x, const filter_t *w, const conv_t *c, const tensor_t *y) {
    if (!x->set || !w->set || !y->set) return 0;
    if (x->dtype != w->dtype || x->dtype != y->dtype || x->dtype != c->dtype) return 0;
    if (x->c != w->c * c->groups || w->k % c->groups || y->c != w->k || y->n != x->n) return 0;
    int ho = (x->h + 2 * c->ph - c->dh * (w->h - 1) - 1) / c->sh + 1;
    int wo = (x->w + 2 * c->pw - c->dw * (w->w - 1) - 1) / c->sw + 1;
    return ho == y->h && wo == y->w;
}

static size_t need(int algo, const tensor_t *x) {
    size_t item = x->dtype == DOUBLE ? 8 : 4;
    return algo == 1 ? (size_t)x->n * x->c * x->h * x->w * item : 0;
}

static cudnnStatus_t ranking(const tensor_t *x, const filter_t *w, const conv_t *c,
                             const tensor_t *y, int requested, int *returned, perf_t *perf) {
    if (!consistent(x, w, c, y)) return BAD_PARAM;
    perf_t all[4] = {{2, OK, 0.1f, 0, 1, TENSOR_OP_MATH, {0}},
                     {3, OK, 0.1f, 0, 1, DEFAULT_MATH, {0}},
                     {1, OK, 0.2f, need(1, x), 1, FMA_MATH, {0}},
                     {0, OK, 0.3f, 0, 1, FMA_MATH, {0}}};
    int n = requested < 4 ? requested : 4;
    memcpy(perf, all, n * sizeof(perf_t));
    *returned = n;
    return OK;
}

static cudnnStatus_t workspace(const tensor_t *x, const filter_t *w, const conv_t *c,
                               const tensor_t *y, int algo, size_t *size) {
    if (!consistent(x, w, c, y)) return BAD_PARAM;
    if (algo >= 2 && c->math == FMA_MATH) return NOT_SUPPORTED;  /* no FMA form */
    if (algo < 0 || algo > 3) return BAD_PARAM;
    *size = need(algo, x);
    return OK;
}

cudnnStatus_t cudnnGetConvolutionForwardAlgorithmMaxCount(void *h, int *n) { *n = 4; return OK; }
cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithmMaxCount(void *h, int *n) { *n = 4; return OK; }
cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(void *h, int *n) { *n = 4; return OK; }

cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(void *h, void *x, void *w, void *c, void *y,
                                                     int req, int *ret, perf_t *perf) {
    return ranking(x, w, c, y, req, ret, perf);
}
cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithm_v7(void *h, void *w, void *dy, void *c,
                                                          void *dx, int req, int *ret, perf_t *perf) {
    return ranking(dx, w, c, dy, req, ret, perf);
}
cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithm_v7(void *h, void *x, void *dy, void *c,
                                                            void *dw, int req, int *ret, perf_t *perf) {
    return ranking(x, dw, c, dy, req, ret, perf);
}
cudnnStatus_t cudnnGetConvolutionForwardWorkspaceSize(void *h, void *x, void *w, void *c, void *y,
                                                      int algo, size_t *size) {
    return workspace(x, w, c, y, algo, size);
}
cudnnStatus_t cudnnGetConvolutionBackwardDataWorkspaceSize(void *h, void *w, void *dy, void *c,
                                                           void *dx, int algo, size_t *size) {
    return workspace(dx, w, c, dy, algo, size);
}
cudnnStatus_t cudnnGetConvolutionBackwardFilterWorkspaceSize(void *h, void *x, void *dy, void *c,
                                                             void *dw, int algo, size_t *size) {
    return workspace(x, dw, c, dy, algo, size);
}

static double get(const void *p, int dtype, size_t i) {
    return dtype == DOUBLE ? ((const double *)p)[i] : ((const float *)p)[i];
}
static double scalar(const void *p, int dtype) { return get(p, dtype, 0); }
static void put(void *p, int dtype, size_t i, double v) {
    if (dtype == DOUBLE) ((double *)p)[i] = v; else ((float *)p)[i] = (float)v;
}

/* every (output element, tap) pair of the convolution, once: f(xi, wi, yi) */
#define FOR_TAPS(TX, TW, TC, TY, BODY)                                                    \
    for (int n = 0; n < TY->n; n++) for (int o = 0; o < TY->c; o++) {                    \
        int g = o / (TW->k / TC->groups);                                                \
        for (int i = 0; i < TY->h; i++) for (int j = 0; j < TY->w; j++) {                \
            size_t yi = (((size_t)n * TY->c + o) * TY->h + i) * TY->w + j;                \
            for (int ci = 0; ci < TW->c; ci++) for (int p = 0; p < TW->h; p++)            \
                for (int q = 0; q < TW->w; q++) {                                        \
                    int r = i * TC->sh - TC->ph + p * TC->dh;                            \
                    int s = j * TC->sw - TC->pw + q * TC->dw;                            \
                    if (r < 0 || r >= TX->h || s < 0 || s >= TX->w) continue;            \
                    size_t xi = (((size_t)n * TX->c + g * TW->c + ci) * TX->h + r) * TX->w + s; \
                    size_t wi = (((size_t)o * TW->c + ci) * TW->h + p) * TW->w + q;      \
                    BODY;                                                                \
                }                                                                        \
        }                                                                                \
    }

static cudnnStatus_t run(const tensor_t *x, const filter_t *w, const conv_t *c, const tensor_t *y,
                         int algo, void *ws, size_t ws_bytes) {
    size_t size;
    cudnnStatus_t st = workspace(x, w, c, y, algo, &size);
    if (st != OK) return st;
    if (size > ws_bytes || (size && !ws)) return BAD_PARAM;
    if (size) memset(ws, 0xab, size);  /* it is scratch: the caller must not rely on it */
    last_algo = algo;
    return OK;
}

enum { FWD, DATA, FILTER };

/* kind FWD: (a, b) = (x, w) -> y; DATA: (w, dy) -> dx; FILTER: (x, dy) -> dw */
static cudnnStatus_t convolve(int kind, tensor_t *X, filter_t *W, conv_t *C, tensor_t *Y,
                              int algo, void *ws, size_t ws_bytes, const void *alpha,
                              const void *beta, const void *a, const void *b, void *out) {
    cudnnStatus_t st = run(X, W, C, Y, algo, ws, ws_bytes);
    if (st != OK) return st;
    int dt = X->dtype;
    size_t count = kind == FWD ? (size_t)Y->n * Y->c * Y->h * Y->w
                 : kind == DATA ? (size_t)X->n * X->c * X->h * X->w
                 : (size_t)W->k * W->c * W->h * W->w;
    double *acc = calloc(count, sizeof(double));
    FOR_TAPS(X, W, C, Y,
             if (kind == FWD) acc[yi] += get(a, dt, xi) * get(b, dt, wi);
             else if (kind == DATA) acc[xi] += get(b, dt, yi) * get(a, dt, wi);
             else acc[wi] += get(b, dt, yi) * get(a, dt, xi))
    double al = scalar(alpha, dt), be = scalar(beta, dt);
    for (size_t k = 0; k < count; k++)
        put(out, dt, k, al * acc[k] + (be != 0 ? be * get(out, dt, k) : 0));
    free(acc);
    return OK;
}

cudnnStatus_t cudnnConvolutionForward(void *h, const void *alpha, void *xd, const void *x,
                                      void *wd, const void *w, void *cd, int algo, void *ws,
                                      size_t ws_bytes, const void *beta, void *yd, void *y) {
    return convolve(FWD, xd, wd, cd, yd, algo, ws, ws_bytes, alpha, beta, x, w, y);
}

cudnnStatus_t cudnnConvolutionBackwardData(void *h, const void *alpha, void *wd, const void *w,
                                           void *dyd, const void *dy, void *cd, int algo, void *ws,
                                           size_t ws_bytes, const void *beta, void *dxd, void *dx) {
    return convolve(DATA, dxd, wd, cd, dyd, algo, ws, ws_bytes, alpha, beta, w, dy, dx);
}

cudnnStatus_t cudnnConvolutionBackwardFilter(void *h, const void *alpha, void *xd, const void *x,
                                             void *dyd, const void *dy, void *cd, int algo, void *ws,
                                             size_t ws_bytes, const void *beta, void *dwd, void *dw) {
    return convolve(FILTER, xd, dwd, cd, dyd, algo, ws, ws_bytes, alpha, beta, x, dy, dw);
}
