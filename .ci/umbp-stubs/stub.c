/* A stand-in for a ROCm runtime library on a machine without an AMD GPU.
 *
 * Built twice by .ci/umbp-setup.sh: once as libamdhip64.so.7, once as libhsa-runtime64.so.1,
 * with -DSYMBOLS naming the symbol list (libamdhip64.syms or libhsa-runtime64.syms) and
 * -DSTUB_ERROR the error every function answers: hipErrorNoDevice (100) for HIP,
 * HSA_STATUS_ERROR (0x1000) for HSA. The symbol versions come from the version script the
 * setup writes from the same list.
 *
 * mori's UMBP client asks hipGetDeviceCount once and hipPointerGetAttributes /
 * hipGetLastError per buffer; "no device" makes it treat every buffer as host memory, which is
 * what the tests want. Nothing here is a GPU runtime: a caller that needed one gets an error.
 */
#define STUB(name, version) \
    __attribute__((visibility("default"))) long name(void) { return STUB_ERROR; }
#include SYMBOLS
