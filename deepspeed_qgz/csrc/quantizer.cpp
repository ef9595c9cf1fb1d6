// Copyright (c) Microsoft Corporation.
// SPDX-License-Identifier: Apache-2.0

// DeepSpeed Team

/*
CPU implementation of the ZeRO++ quantizer ops: quantize, swizzle_quant, quantized_reduction,
dequantize and dequantize_fp32, with the Python signatures, output shapes, dtypes and numerics of
the CUDA binding
(csrc/quantization/pt_binding.cpp). deepspeed_qgz/qgz/qgz_reference.py states those numerics
in PyTorch and is the specification this file is tested against, bit for bit.

ZeRO-3's qgZ and qwZ call these functions as they call the CUDA op (deepspeed_qgz/cpu_quantizer.py);
this package's tests and benchmarks call them through ContractCheckedQuantizer
(deepspeed_qgz/qgz/qgz_contract.py), which checks every call against the whole kernel contract
first. The TORCH_CHECKs here keep this file's own memory accesses in bounds and, as the contract
does, refuse quantized_reduction launches of fewer threads than a warp (undefined on CUDA, so never
computed here either).

Work is split over quantization groups with at::parallel_for. A group is processed in blocks of 8
values, the width of the kernels' 16-byte vectors; with F16C/AVX2 a block is one vector. Defining
QGZ_SCALAR selects the portable path on any machine (the tests build it too).
*/

// ATen and the Python binding only: torch/extension.h, which adds the whole C++ frontend, took
// most of the build's time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__) && !defined(QGZ_SCALAR)
#include <immintrin.h>
#define QGZ_AVX2 1
#endif

namespace {

enum class QuantType { Symmetric, Asymmetric };

constexpr int64_t kBlock = 8;  // values per 16-byte fp16 vector

// ---------------------------------------------------------------------------------------------
// fp16 <-> fp32 over one block of 8 values
// ---------------------------------------------------------------------------------------------

inline void half_block_to_float(const uint16_t* src, float* dst)
{
#ifdef QGZ_AVX2
    _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
#else
    for (int i = 0; i < kBlock; ++i) dst[i] = c10::detail::fp16_ieee_to_fp32_value(src[i]);
#endif
}

// Rounds each value to the nearest fp16 (ties to even) and stores the fp16 bits.
inline void float_block_to_half(const float* src, uint16_t* dst)
{
#ifdef QGZ_AVX2
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src), _MM_FROUND_TO_NEAREST_INT));
#else
    for (int i = 0; i < kBlock; ++i) dst[i] = c10::detail::fp16_ieee_from_fp32_value(src[i]);
#endif
}

// Rounds each value to the nearest fp16 and back, in place.
inline void round_block_to_half(float* values)
{
    uint16_t bits[kBlock];
    float_block_to_half(values, bits);
    half_block_to_float(bits, values);
}

// ---------------------------------------------------------------------------------------------
// Group statistics and parameters (GroupStats / Params in quantization_utils.h)
// ---------------------------------------------------------------------------------------------

// Running max and min that skip NaN, as __hmax2/fmaxf do: a NaN operand yields the other one.
struct Stats {
#ifdef QGZ_AVX2
    __m256 max8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 min8 = _mm256_set1_ps(std::numeric_limits<float>::infinity());
#endif
    float max = -std::numeric_limits<float>::infinity();
    float min = std::numeric_limits<float>::infinity();

    void fold_block(const float* v, bool asymmetric)
    {
#ifdef QGZ_AVX2
        __m256 x = _mm256_loadu_ps(v);
        if (!asymmetric) x = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);  // |x|
        // max_ps(a, b) returns b when either is NaN; the accumulators never hold NaN.
        max8 = _mm256_max_ps(x, max8);
        min8 = _mm256_min_ps(x, min8);
#else
        for (int i = 0; i < kBlock; ++i) {
            const float x = asymmetric ? v[i] : std::fabs(v[i]);
            max = x > max ? x : max;
            min = x < min ? x : min;
        }
#endif
    }

    // Folds the vector lanes into max/min; call once after the last fold_block.
    void finish()
    {
#ifdef QGZ_AVX2
        float lanes[kBlock];
        _mm256_storeu_ps(lanes, max8);
        for (float x : lanes) max = std::max(max, x);
        _mm256_storeu_ps(lanes, min8);
        for (float x : lanes) min = std::min(min, x);
#endif
    }

    // Idle lanes of the launch load zero-filled vectors.
    void fold_zero()
    {
        max = std::max(max, 0.0f);
        min = std::min(min, 0.0f);
    }
};

struct Params {
    float scale;   // multiplier applied before rounding
    float offset;  // asymmetric only

    static Params from_stats(const Stats& stats, int num_bits, QuantType type)
    {
        const float levels = static_cast<float>(1 << num_bits);
        if (type == QuantType::Asymmetric) {
            const float scale = stats.max == stats.min ? 1.0f : levels / (stats.max - stats.min);
            return {scale, (stats.max + stats.min) / 2};
        }
        return {stats.max == 0 ? 1.0f : levels / (2 * stats.max), 0.0f};
    }

    void store(float* dst, QuantType type) const
    {
        dst[0] = 1 / scale;
        if (type == QuantType::Asymmetric) dst[1] = offset;
    }
};

// Quantizes one block, rint((x - offset) * scale) with NaN -> 0 clamped to the code range, and
// packs it: one code per byte for int8, two per byte for int4 (the first in the high nibble).
inline void quantize_block(const float* v,
                           const Params& p,
                           QuantType type,
                           int num_bits,
                           int8_t* out)
{
    const float q_max = static_cast<float>((1 << (num_bits - 1)) - 1);
    const float q_min = -q_max - 1;
#ifdef QGZ_AVX2
    __m256 x = _mm256_loadu_ps(v);
    if (type == QuantType::Asymmetric) x = _mm256_sub_ps(x, _mm256_set1_ps(p.offset));
    x = _mm256_mul_ps(x, _mm256_set1_ps(p.scale));
    x = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_and_ps(x, _mm256_cmp_ps(x, x, _CMP_ORD_Q));  // NaN -> 0
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(q_min)), _mm256_set1_ps(q_max));
    const __m256i codes = _mm256_cvtps_epi32(x);
    if (num_bits == 8) {
        const __m128i words =
            _mm_packs_epi32(_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(words, words));
        return;
    }
    // nibble pairs: (even << 4) + odd, summed pairwise within each 128-bit half
    const __m256i nibbles = _mm256_and_si256(codes, _mm256_set1_epi32(0xF));
    const __m256i shifted = _mm256_sllv_epi32(nibbles, _mm256_setr_epi32(4, 0, 4, 0, 4, 0, 4, 0));
    const __m256i pairs = _mm256_hadd_epi32(shifted, _mm256_setzero_si256());
    const __m128i bytes4 =
        _mm_unpacklo_epi64(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
    const __m128i words = _mm_packus_epi32(bytes4, bytes4);
    const int32_t packed = _mm_cvtsi128_si32(_mm_packus_epi16(words, words));
    std::memcpy(out, &packed, sizeof(packed));
#else
    int32_t codes[kBlock];
    for (int i = 0; i < kBlock; ++i) {
        float x = v[i];
        if (type == QuantType::Asymmetric) x -= p.offset;
        x = std::nearbyint(x * p.scale);
        if (std::isnan(x)) x = 0.0f;
        codes[i] = static_cast<int32_t>(std::min(std::max(x, q_min), q_max));
    }
    if (num_bits == 8) {
        for (int i = 0; i < kBlock; ++i) out[i] = static_cast<int8_t>(codes[i]);
        return;
    }
    for (int i = 0; i < kBlock / 2; ++i) {
        const uint32_t high = static_cast<uint32_t>(codes[2 * i]) & 0xF;
        const uint32_t low = static_cast<uint32_t>(codes[2 * i + 1]) & 0xF;
        out[i] = static_cast<int8_t>(static_cast<uint8_t>((high << 4) | low));
    }
#endif
}

// Dequantizes the 8 values packed at `in` (8 or 4 bytes) to fp32: q * scale, or fma(q, scale,
// offset) for asymmetric parameters (nvcc contracts the multiply-add into one rounding).
inline void dequantize_block(const int8_t* in,
                             const float* params,
                             QuantType type,
                             int num_bits,
                             float* out)
{
#ifdef QGZ_AVX2
    __m256i codes;
    if (num_bits == 8) {
        codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in)));
    } else {
        int32_t packed;
        std::memcpy(&packed, in, sizeof(packed));
        // [b0 b0 b1 b1 b2 b2 b3 b3], sign-extended; even lanes keep the high nibble, odd the low.
        const __m128i bytes = _mm_cvtsi32_si128(packed);
        codes = _mm256_cvtepi8_epi32(_mm_unpacklo_epi8(bytes, bytes));
        codes = _mm256_srai_epi32(
            _mm256_sllv_epi32(codes, _mm256_setr_epi32(24, 28, 24, 28, 24, 28, 24, 28)), 28);
    }
    const __m256 values = _mm256_cvtepi32_ps(codes);
    const __m256 scale = _mm256_set1_ps(params[0]);
    _mm256_storeu_ps(out,
                     type == QuantType::Asymmetric
                         ? _mm256_fmadd_ps(values, scale, _mm256_set1_ps(params[1]))
                         : _mm256_mul_ps(values, scale));
#else
    float codes[kBlock];
    if (num_bits == 8) {
        for (int i = 0; i < kBlock; ++i) codes[i] = static_cast<float>(in[i]);
    } else {
        for (int i = 0; i < kBlock / 2; ++i) {
            const int32_t byte = static_cast<int32_t>(in[i]);  // sign-extended
            codes[2 * i] = static_cast<float>(byte >> 4);
            const int32_t low = byte & 0xF;
            codes[2 * i + 1] = static_cast<float>(low >= 8 ? low - 16 : low);
        }
    }
    const float scale = params[0];
    if (type == QuantType::Asymmetric) {
        for (int i = 0; i < kBlock; ++i) out[i] = std::fma(codes[i], scale, params[1]);
    } else {
        for (int i = 0; i < kBlock; ++i) out[i] = codes[i] * scale;
    }
#endif
}

// acc = fp16(acc + fp16(dequantized block)): quantized_reduction's per-device step. The fp32 sum
// of two fp16 values is exact, so rounding it once is the fp16 add.
inline void accumulate_block(const int8_t* in,
                             const float* params,
                             QuantType type,
                             int num_bits,
                             float* acc)
{
    float block[kBlock];
    dequantize_block(in, params, type, num_bits, block);
#ifdef QGZ_AVX2
    const auto to_half_and_back = [](__m256 x) {
        return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    };
    const __m256 sum =
        _mm256_add_ps(_mm256_loadu_ps(acc), to_half_and_back(_mm256_loadu_ps(block)));
    _mm256_storeu_ps(acc, to_half_and_back(sum));
#else
    round_block_to_half(block);
    for (int i = 0; i < kBlock; ++i) acc[i] += block[i];
    round_block_to_half(acc);
#endif
}

// ---------------------------------------------------------------------------------------------
// Launch geometry of the CUDA kernels, for the statistics' idle lanes. qgz_contract.py states the
// same geometry; tests/unit/ops/quantizer checks the two agree for every group size it allows.
// ---------------------------------------------------------------------------------------------

constexpr int64_t kWarpSize = 32;
constexpr int64_t kQuantizeMaxThreads = 256;
constexpr int64_t kQuantizeSubblockMaxElems = 128;
constexpr int64_t kSwizzleMinThreads = 32;
constexpr int64_t kSwizzleMaxThreads = 512;
constexpr int64_t kReduceMaxThreads = 1024;

int64_t next_pow2(int64_t v)
{
    int64_t p = 1;
    while (p < v) p <<= 1;
    return p;
}

// (threads, chunks per thread) of swizzled_quant_kernel for a group of `elems` values.
std::pair<int64_t, int64_t> swizzle_launch(int64_t elems)
{
    const int64_t threads =
        std::min(std::max(next_pow2((elems + 2 * kBlock - 1) / (2 * kBlock)), kSwizzleMinThreads),
                 kSwizzleMaxThreads);
    const int64_t chunks = threads < kSwizzleMaxThreads
                               ? 2
                               : 2 * ((elems + threads * 2 * kBlock - 1) / (threads * 2 * kBlock));
    return {threads, chunks};
}

// (threads per group, groups per block, chunks per thread) of quantize for a group of `elems`
// values.
std::tuple<int64_t, int64_t, int64_t> quantize_launch(int64_t elems)
{
    if (elems <= kQuantizeSubblockMaxElems) {
        const int64_t threads = next_pow2((elems + kBlock - 1) / kBlock);
        return {threads, (kQuantizeMaxThreads + threads - 1) / threads, 1};
    }
    const int64_t threads =
        std::min(next_pow2((elems + 2 * kBlock - 1) / (2 * kBlock)), kQuantizeMaxThreads);
    return {threads, 1, 2 * ((elems + threads * 2 * kBlock - 1) / (threads * 2 * kBlock))};
}

int64_t reduce_load_bytes(int num_bits) { return num_bits == 4 ? 4 : 8; }

// (threads, chunks per thread) of dequant_reduce for an output group of `bytes` bytes.
std::pair<int64_t, int64_t> reduce_launch(int64_t bytes, int num_bits)
{
    const int64_t load = reduce_load_bytes(num_bits);
    const int64_t threads = std::min(next_pow2((bytes + load - 1) / load), kReduceMaxThreads);
    int64_t chunks = (bytes + threads * load - 1) / (threads * load);
    if (chunks >= 4) chunks += chunks % 2;
    return {threads, chunks};
}

// Whether the launch has more lanes than the group has values (idle lanes load zeros).
bool swizzle_has_idle_lanes(int64_t elems)
{
    const auto launch = swizzle_launch(elems);
    return launch.first * launch.second * kBlock > elems;
}

bool quantize_has_idle_lanes(int64_t elems)
{
    const auto launch = quantize_launch(elems);
    return std::get<0>(launch) * std::get<2>(launch) * kBlock > elems;
}

bool reduce_has_idle_lanes(int64_t bytes, int num_bits)
{
    const auto launch = reduce_launch(bytes, num_bits);
    return launch.first * launch.second * kBlock > bytes * (8 / num_bits);
}

int64_t param_width(QuantType type) { return type == QuantType::Asymmetric ? 2 : 1; }

void check_bits(int num_bits)
{
    TORCH_CHECK(num_bits == 4 || num_bits == 8, "num_bits must be 4 or 8, got ", num_bits);
}

// Quantizes `elems` fp32 values (holding fp16 values) as one group, writing packed codes and
// params.
void quantize_group(const float* values,
                    int64_t elems,
                    bool idle_lanes,
                    int num_bits,
                    QuantType type,
                    int8_t* out,
                    float* params_out)
{
    Stats stats;
    for (int64_t i = 0; i < elems; i += kBlock)
        stats.fold_block(values + i, type == QuantType::Asymmetric);
    stats.finish();
    if (idle_lanes) stats.fold_zero();
    const Params params = Params::from_stats(stats, num_bits, type);
    params.store(params_out, type);

    const int64_t bytes_per_block = kBlock * num_bits / 8;
    for (int64_t i = 0; i < elems; i += kBlock) {
        quantize_block(values + i, params, type, num_bits, out + (i / kBlock) * bytes_per_block);
    }
}

// Quantizes the fp16 input's num_groups groups, group g into output group out_group(g): the loop
// quantize (out_group the identity) and swizzle_quant (the swizzle order) share.
template <typename OutGroup>
std::vector<at::Tensor> quantize_groups(const at::Tensor& input,
                                        at::IntArrayRef output_sizes,
                                        int64_t num_groups,
                                        bool idle_lanes,
                                        int num_bits,
                                        QuantType type,
                                        OutGroup out_group)
{
    const int64_t elems = input.numel() / num_groups;
    const int64_t bytes_per_group = elems * num_bits / 8;
    auto output = at::empty(output_sizes, input.options().dtype(at::kChar));
    auto params = at::empty({num_groups, param_width(type)}, input.options().dtype(at::kFloat));
    const auto* src = reinterpret_cast<const uint16_t*>(input.data_ptr<at::Half>());
    auto* dst = output.data_ptr<int8_t>();
    auto* params_dst = params.data_ptr<float>();

    at::parallel_for(0, num_groups, 16, [&](int64_t begin, int64_t end) {
        std::vector<float> values(elems);
        for (int64_t group = begin; group < end; ++group) {
            for (int64_t i = 0; i < elems; i += kBlock)
                half_block_to_float(src + group * elems + i, values.data() + i);
            const int64_t out = out_group(group);
            quantize_group(values.data(),
                           elems,
                           idle_lanes,
                           num_bits,
                           type,
                           dst + out * bytes_per_group,
                           params_dst + out * param_width(type));
        }
    });
    return {output, params};
}

}  // namespace

std::vector<at::Tensor> quantize(at::Tensor& input, int num_groups, int num_bits, QuantType type)
{
    check_bits(num_bits);
    TORCH_CHECK(
        input.device().is_cpu() && input.scalar_type() == at::kHalf && input.is_contiguous(),
        "quantize: input must be a contiguous float16 CPU tensor, got ",
        input.scalar_type(),
        " on ",
        input.device());
    const int64_t numel = input.numel();
    TORCH_CHECK(num_groups > 0 && numel % num_groups == 0 && (numel / num_groups) % kBlock == 0,
                "quantize: layout outside the kernel contract");
    const int64_t elems = numel / num_groups;
    const int64_t threads = std::get<0>(quantize_launch(elems));
    TORCH_CHECK(elems <= kQuantizeSubblockMaxElems || threads >= kWarpSize,
                "quantize: groups of ",
                elems,
                " elements launch ",
                threads,
                " threads, fewer than a warp (",
                kWarpSize,
                "): the CUDA kernel's warp shuffles would read lanes that do not exist");
    auto sizes = input.sizes().vec();
    sizes.back() /= 8 / num_bits;
    auto result = quantize_groups(input,
                                  sizes,
                                  num_groups,
                                  quantize_has_idle_lanes(elems),
                                  num_bits,
                                  type,
                                  [](int64_t group) { return group; });
    // The params flat, unlike the CUDA op's [groups, width]: ZeRO-3's quantized gathers all-gather
    // them into a flat buffer, which gloo refuses from another shape (NCCL counts elements).
    result[1] = result[1].view({-1});
    return result;
}

std::vector<at::Tensor> swizzle_quant(at::Tensor& input,
                                      int num_groups,
                                      int num_bits,
                                      QuantType type,
                                      int pipeline_size,
                                      int num_nodes,
                                      int local_world_size)
{
    check_bits(num_bits);
    TORCH_CHECK(
        input.device().is_cpu() && input.scalar_type() == at::kHalf && input.is_contiguous(),
        "swizzle_quant: input must be a contiguous float16 CPU tensor, got ",
        input.scalar_type(),
        " on ",
        input.device());
    const int64_t numel = input.numel();
    const int64_t partitions = static_cast<int64_t>(num_nodes) * local_world_size;
    TORCH_CHECK(num_groups > 0 && partitions > 0 && pipeline_size > 0 && numel % num_groups == 0 &&
                    num_groups % (partitions * pipeline_size) == 0 &&
                    (numel / num_groups) % kBlock == 0,
                "swizzle_quant: layout outside the kernel contract");
    const int64_t elems = numel / num_groups;
    const int64_t per_stage = num_groups / (partitions * pipeline_size);
    const int64_t groups_per_partition = num_groups / partitions;
    // The swizzle order (qgz_contract.swizzle_slot), pipeline stages outermost.
    auto out_group = [=](int64_t group) {
        const int64_t partition = group / groups_per_partition;
        const int64_t in_partition = group % groups_per_partition;
        const int64_t slot =
            (partition % local_world_size) * num_nodes + partition / local_world_size;
        return ((in_partition / per_stage) * partitions + slot) * per_stage +
               in_partition % per_stage;
    };
    return quantize_groups(input,
                           {numel * num_bits / 8},
                           num_groups,
                           swizzle_has_idle_lanes(elems),
                           num_bits,
                           type,
                           out_group);
}

std::vector<at::Tensor> quantized_reduction(at::Tensor& input,
                                            at::Tensor& input_scales,
                                            int in_groups,
                                            int out_groups,
                                            int num_bits,
                                            QuantType type,
                                            int local_world_size)
{
    check_bits(num_bits);
    TORCH_CHECK(
        input.device().is_cpu() && input.scalar_type() == at::kChar && input.is_contiguous(),
        "quantized_reduction: input must be a contiguous int8 CPU tensor, got ",
        input.scalar_type(),
        " on ",
        input.device());
    TORCH_CHECK(input_scales.device().is_cpu() && input_scales.scalar_type() == at::kFloat &&
                    input_scales.is_contiguous(),
                "quantized_reduction: scales must be a contiguous float32 CPU tensor, got ",
                input_scales.scalar_type(),
                " on ",
                input_scales.device());
    const int64_t numel = input.numel();
    TORCH_CHECK(local_world_size > 0 && in_groups > 0 && out_groups > 0 &&
                    numel % local_world_size == 0 && in_groups % local_world_size == 0 &&
                    input_scales.numel() == in_groups * param_width(type),
                "quantized_reduction: layout outside the kernel contract");
    const int64_t bytes_per_tensor = numel / local_world_size;
    const int64_t groups_per_tensor = in_groups / local_world_size;
    const int64_t load = reduce_load_bytes(num_bits);
    TORCH_CHECK(bytes_per_tensor % groups_per_tensor == 0 && bytes_per_tensor % out_groups == 0 &&
                    (bytes_per_tensor / groups_per_tensor) % load == 0 &&
                    (bytes_per_tensor / out_groups) % load == 0,
                "quantized_reduction: layout outside the kernel contract");
    const int64_t bytes_per_in_group = bytes_per_tensor / groups_per_tensor;
    const int64_t bytes_per_out_group = bytes_per_tensor / out_groups;
    const int64_t values_per_out_group = bytes_per_out_group * 8 / num_bits;
    const int64_t bytes_per_block = kBlock * num_bits / 8;
    const int64_t threads = reduce_launch(bytes_per_out_group, num_bits).first;
    TORCH_CHECK(threads >= kWarpSize,
                "quantized_reduction: out-groups of ",
                values_per_out_group,
                " elements launch ",
                threads,
                " threads, fewer than a warp (",
                kWarpSize,
                "): the CUDA kernel's warp shuffles would read lanes that do not exist");
    const bool idle_lanes = reduce_has_idle_lanes(bytes_per_out_group, num_bits);

    auto sizes = input.sizes().vec();
    sizes.back() /= local_world_size;
    auto output = at::empty(sizes, input.options());
    auto params = at::empty({out_groups, param_width(type)}, input_scales.options());
    const int8_t* src = input.data_ptr<int8_t>();
    const float* scales = input_scales.data_ptr<float>();
    int8_t* dst = output.data_ptr<int8_t>();
    float* params_dst = params.data_ptr<float>();

    at::parallel_for(0, out_groups, 16, [&](int64_t begin, int64_t end) {
        std::vector<float> sum(values_per_out_group);
        for (int64_t group = begin; group < end; ++group) {
            for (int64_t b = 0; b < values_per_out_group / kBlock; ++b) {
                const int64_t offset = group * bytes_per_out_group + b * bytes_per_block;
                const int64_t in_group = offset / bytes_per_in_group;
                float* acc = sum.data() + b * kBlock;
                std::fill(acc, acc + kBlock, 0.0f);  // +0, as the kernel's accumulator starts
                for (int64_t device = 0; device < local_world_size; ++device) {
                    // Device j's parameters start j * groups_per_tensor floats in, whatever their
                    // width: for asymmetric pairs that reads shifted pairs past device 0, as the
                    // CUDA kernel does (a defect of the kernel, reproduced; qgZ is symmetric).
                    const float* device_params =
                        scales + device * groups_per_tensor + in_group * param_width(type);
                    accumulate_block(src + device * bytes_per_tensor + offset,
                                     device_params,
                                     type,
                                     num_bits,
                                     acc);
                }
            }
            quantize_group(sum.data(),
                           values_per_out_group,
                           idle_lanes,
                           num_bits,
                           type,
                           dst + group * bytes_per_out_group,
                           params_dst + group * param_width(type));
        }
    });
    return {output, params};
}

template <typename T>
at::Tensor dequantize(at::Tensor& input,
                      at::Tensor& params,
                      int num_groups,
                      int num_bits,
                      QuantType type)
{
    check_bits(num_bits);
    TORCH_CHECK(
        input.device().is_cpu() && input.scalar_type() == at::kChar && input.is_contiguous(),
        "dequantize: input must be a contiguous int8 CPU tensor, got ",
        input.scalar_type(),
        " on ",
        input.device());
    TORCH_CHECK(
        params.device().is_cpu() && params.scalar_type() == at::kFloat && params.is_contiguous(),
        "dequantize: params must be a contiguous float32 CPU tensor, got ",
        params.scalar_type(),
        " on ",
        params.device());
    const int64_t total = input.numel() * 8 / num_bits;
    TORCH_CHECK(num_groups > 0 && total % num_groups == 0 && (total / num_groups) % kBlock == 0 &&
                    params.numel() == num_groups * param_width(type),
                "dequantize: layout outside the kernel contract");
    const int64_t elems = total / num_groups;
    const int64_t bytes_per_block = kBlock * num_bits / 8;

    auto sizes = input.sizes().vec();
    sizes.back() *= 8 / num_bits;
    constexpr bool to_half = std::is_same<T, at::Half>::value;
    auto output = at::empty(sizes, input.options().dtype(to_half ? at::kHalf : at::kFloat));
    const int8_t* src = input.data_ptr<int8_t>();
    const float* group_params = params.data_ptr<float>();
    T* dst = output.data_ptr<T>();

    at::parallel_for(0, num_groups, 16, [&](int64_t begin, int64_t end) {
        float block[kBlock];
        for (int64_t group = begin; group < end; ++group) {
            for (int64_t i = 0; i < elems; i += kBlock) {
                const int64_t index = group * elems + i;
                dequantize_block(src + index / kBlock * bytes_per_block,
                                 group_params + group * param_width(type),
                                 type,
                                 num_bits,
                                 block);
                if constexpr (to_half) {
                    float_block_to_half(block, reinterpret_cast<uint16_t*>(dst + index));
                } else {
                    std::copy(block, block + kBlock, dst + index);
                }
            }
        }
    });
    return output;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    pybind11::enum_<QuantType>(m, "QuantizationType")
        .value("Symmetric", QuantType::Symmetric)
        .value("Asymmetric", QuantType::Asymmetric)
        .export_values();
    m.def("quantize", &quantize, "Quantize equal groups in place order (CPU)");
    m.def("swizzle_quant",
          &swizzle_quant,
          "Quantize and swizzle groups for the qgZ all-to-all (CPU)");
    m.def("quantized_reduction",
          &quantized_reduction,
          "Dequantize, sum over devices, requantize (CPU)");
    m.def("dequantize", &dequantize<at::Half>, "Dequantize to float16 (CPU)");
    m.def("dequantize_fp32", &dequantize<float>, "Dequantize to float32 (CPU)");
    // The CUDA module's experimental fp_quantizer helpers have no CPU implementation.
    for (const char* name :
         {"dequantize_int4_to_half_experimental", "dequantize_int8_to_half_experimental"}) {
        const std::string message = std::string(name) +
                                    " has no CPU implementation: DeepSpeed's CUDA quantizer "
                                    "(QuantizerBuilder on a CUDA accelerator) provides it";
        m.def(name, [message](pybind11::args, pybind11::kwargs) -> at::Tensor {
            TORCH_CHECK(false, message);
            return at::Tensor();
        });
    }
    // The geometry and parameter width this file assumes, for the test against qgz_contract.py.
    m.def(
        "_swizzle_launch", &swizzle_launch, "(threads, chunks) of swizzle_quant for a group size");
    m.def("_quantize_launch",
          &quantize_launch,
          "(threads, groups per block, chunks) of quantize for a group size");
    m.def("_reduce_launch",
          &reduce_launch,
          "(threads, chunks) of quantized_reduction for out-group bytes");
    m.def("_param_width", &param_width, "fp32 parameters per group for a quantization type");
}
