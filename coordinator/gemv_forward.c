/* cblas_sgemm with one row forwarded to cblas_sgemv; preloaded before OpenBLAS (coordinator/blas.py).
 *
 * MLX's CPU backend computes every matmul with cblas_sgemm. For a one-token decode step each
 * product is one row times a weight matrix, and OpenBLAS (before 0.3.28, and still on x86_64)
 * packs the whole weight into its GEMM layout first: three passes over the weights where a
 * matrix-vector product makes one. OpenBLAS 0.3.28 forwards such calls to GEMV itself on ARM64;
 * this does the same here. Every other call goes to the next cblas_sgemm (OpenBLAS's).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);

/* Calls forwarded so far: what a test reads to see the forwarding happen. */
long metal_cluster_gemv_forwarded = 0;

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
  static sgemm_fn next_sgemm;
  static sgemv_fn sgemv;
  if (!next_sgemm) {
    sgemv = (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
    next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
  }
  int plain = (trans_a == NO_TRANS || trans_a == TRANS) && (trans_b == NO_TRANS || trans_b == TRANS);
  if (order == ROW_MAJOR && m == 1 && n > 0 && k > 0 && plain && sgemv) {
    /* c[1, n] = alpha * op(a)[1, k] @ op(b)[k, n] + beta * c: op(b)'s columns dotted with a's row. */
    int incx = trans_a == NO_TRANS ? 1 : lda;
    if (beta == 0.0f) memset(c, 0, (size_t)n * sizeof(float)); /* c may be uninitialised: no 0 * NaN */
    if (trans_b == TRANS)
      sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, incx, beta, c, 1);
    else
      sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, incx, beta, c, 1);
    __atomic_add_fetch(&metal_cluster_gemv_forwarded, 1, __ATOMIC_RELAXED);
    return;
  }
  next_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
