/* minillm's C decode kernels (quant_matvec.c) as PyTorch operators implemented in C++.
 *
 * A compiled decode step calls one of these per quantized layer. Implemented in Python, each call
 * crosses into the interpreter and back through ctypes, a few microseconds that a small model's
 * step (25 such calls) feels; registered here, the dispatcher calls the C function directly.
 * The schemas are declared by minillm.compression.cpu_kernels (one place), and so is a Python
 * implementation, used where this file cannot be built. `build` names the build of the C kernels
 * (kernels.native) the layer's kernel was made with: a slot that cpu_kernels fills with its
 * functions' addresses through minillm_set_build. The slot, not an address, is what a compiled
 * graph holds, so the same graph compiles to the same code in every process (Inductor's caches).
 */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

using q8_float = void (*)(const float *, int64_t, int64_t, const int8_t *, const float *, int64_t, float *, int);
using q8_integer = int (*)(const float *, int64_t, int64_t, const int8_t *, const float *, int64_t, float *, int);
using q4_float = int (*)(const float *, int64_t, int64_t, const uint8_t *, const uint16_t *, const uint8_t *,
                         int64_t, int64_t, int64_t, float *, int);

struct Build {
    q8_float q8_f32;
    q8_integer q8_i8;
    q4_float q4_f32;
};
constexpr int64_t BUILDS = 16;
static Build builds[BUILDS];

extern "C" int minillm_set_build(int64_t slot, void *q8_f32, void *q8_i8, void *q4_f32) {
    if (slot < 0 || slot >= BUILDS || !q8_f32 || !q8_i8 || !q4_f32) return 1;
    builds[slot] = {reinterpret_cast<q8_float>(q8_f32), reinterpret_cast<q8_integer>(q8_i8),
                    reinterpret_cast<q4_float>(q4_f32)};
    return 0;
}

static const Build &build_in(int64_t slot) {
    TORCH_CHECK(slot >= 0 && slot < BUILDS && builds[slot].q8_f32, "minillm's C kernels: no build in slot ", slot);
    return builds[slot];
}

static void check(const at::Tensor &t, at::ScalarType dtype, const char *name, const char *dtype_name) {
    TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous(), "minillm's C kernels: ", name, " must be a contiguous ",
                dtype_name, " tensor, got ", t.scalar_type(), t.is_contiguous() ? "" : " (not contiguous)");
}

static void check_call(const at::Tensor &x, const at::Tensor &w) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "minillm's C kernels: x and w must be matrices, got ", x.dim(), " and ",
                w.dim(), " dimensions");
}

/* x (M, K) float, w int8 (N, K), s fp32 (N,) -> (M, N) in x's dtype; integer: W8A8 */
static at::Tensor q8_matvec(const at::Tensor &x, const at::Tensor &w, const at::Tensor &s, int64_t build,
                            bool integer) {
    check_call(x, w);
    check(w, at::kChar, "w", "int8");
    check(s, at::kFloat, "s", "fp32");
    at::Tensor xf = x.to(at::kFloat).contiguous();
    int64_t m = xf.size(0), k = xf.size(1), n = w.size(0);
    TORCH_CHECK(w.size(1) == k && s.numel() == n, "minillm's C kernels: x, w and s do not match");
    at::Tensor y = at::empty({m, n}, xf.options());
    const float *xp = xf.const_data_ptr<float>(), *sp = s.const_data_ptr<float>();
    const int8_t *wp = w.const_data_ptr<int8_t>();
    int nt = at::get_num_threads();
    if (integer) {
        int status = build_in(build).q8_i8(xp, m, k, wp, sp, n, y.data_ptr<float>(), nt);
        TORCH_CHECK(status == 0, "the C kernel q8_i8 could not allocate its scratch buffers");
    } else {
        build_in(build).q8_f32(xp, m, k, wp, sp, n, y.data_ptr<float>(), nt);
    }
    return y.to(x.scalar_type());
}

/* x (M, K) float, w uint8 (N, G * g / 2) packed codes, s fp16 scales and z uint8 zero points (N, G)
 * -> (M, N) in x's dtype */
static at::Tensor q4_matvec(const at::Tensor &x, const at::Tensor &w, const at::Tensor &s, const at::Tensor &z,
                            int64_t group_size, int64_t build) {
    check_call(x, w);
    check(w, at::kByte, "w", "uint8");
    check(s, at::kHalf, "s", "fp16");
    check(z, at::kByte, "z", "uint8");
    at::Tensor xf = x.to(at::kFloat).contiguous();
    int64_t m = xf.size(0), k = xf.size(1), n = w.size(0), kp = w.size(1) * 2;
    TORCH_CHECK(kp >= k && group_size > 0 && group_size % 32 == 0 && kp % group_size == 0 &&
                    s.numel() == n * (kp / group_size) && z.numel() == s.numel(),
                "minillm's C kernels: x, w, s and z do not match (int4 groups of ", group_size, ")");
    at::Tensor y = at::empty({m, n}, xf.options());
    int status = build_in(build).q4_f32(
        xf.const_data_ptr<float>(), m, k, w.const_data_ptr<uint8_t>(),
        reinterpret_cast<const uint16_t *>(s.const_data_ptr<at::Half>()), z.const_data_ptr<uint8_t>(), n, kp,
        group_size, y.data_ptr<float>(), at::get_num_threads());
    TORCH_CHECK(status == 0, "the C kernel q4_f32 could not allocate its scratch buffers");
    return y.to(x.scalar_type());
}

TORCH_LIBRARY_IMPL(minillm, CPU, m) {
    m.impl("q8_matvec_cpu", &q8_matvec);
    m.impl("q4_matvec_cpu", &q4_matvec);
}
