/* A stand-in libcuda.so.1 for running SGLang on a machine without a GPU (test support only).
 *
 * sgl_kernel's common_ops links against libcuda.so.1 but, on the CPU paths the tests use, only
 * resolves cuPointerGetAttribute from it (nm -D --undefined-only). This library exports that
 * one symbol, answering CUDA_ERROR_NO_DEVICE, so `import sgl_kernel` loads while
 * torch.cuda.is_available() stays False. Built by tests/sglang_cpu/build_venv.sh. */
typedef int CUresult;
#define CUDA_ERROR_NO_DEVICE 100

CUresult cuPointerGetAttribute(void *data, int attribute, unsigned long long ptr) {
    (void)data;
    (void)attribute;
    (void)ptr;
    return CUDA_ERROR_NO_DEVICE;
}
