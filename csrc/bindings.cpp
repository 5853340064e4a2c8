// Python bindings of the C++ CPU ops (module specengine._C). The host wrappers in
// specengine/ validate arguments; these bindings only check what pybind11 cannot.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>
#include <utility>

#include "blocks.h"
#include "decoder.h"
#include "gemm.h"
#include "gemm_blocks.h"
#include "layers.h"
#include "cpu_features.h"
#include "linear.h"
#include "ngram.h"
#include "philox.h"
#include "verify.h"

namespace py = pybind11;

namespace {

py::array_t<int64_t> ngram_propose_py(
    py::array_t<int64_t, py::array::c_style | py::array::forcecast> tokens, int64_t min_n,
    int64_t max_n, int64_t max_drafts) {
  if (tokens.ndim() != 1) throw std::invalid_argument("tokens must be one-dimensional");
  if (min_n < 1 || max_n < min_n || max_drafts < 0)
    throw std::invalid_argument("need 1 <= min_n <= max_n and max_drafts >= 0");
  std::vector<int64_t> drafts;
  {
    py::gil_scoped_release release;
    drafts = specengine::ngram_propose(tokens.data(), tokens.shape(0), min_n, max_n, max_drafts);
  }
  py::array_t<int64_t> out(static_cast<py::ssize_t>(drafts.size()));
  std::copy(drafts.begin(), drafts.end(), out.mutable_data());
  return out;
}

// uniforms[b, k] for (seeds[b], positions[b, k], stream).
py::array_t<float> philox_uniforms_py(
    py::array_t<int64_t, py::array::c_style | py::array::forcecast> seeds,
    py::array_t<int64_t, py::array::c_style | py::array::forcecast> positions, int64_t stream) {
  if (seeds.ndim() != 1 || positions.ndim() != 2 || positions.shape(0) != seeds.shape(0))
    throw std::invalid_argument("need seeds [B] and positions [B, K]");
  const py::ssize_t B = positions.shape(0), K = positions.shape(1);
  py::array_t<float> out({B, K});
  const int64_t* s = seeds.data();
  const int64_t* p = positions.data();
  float* o = out.mutable_data();
  {
    py::gil_scoped_release release;
    for (py::ssize_t b = 0; b < B; ++b)
      for (py::ssize_t k = 0; k < K; ++k)
        o[b * K + k] = specengine::philox_uniform(static_cast<uint64_t>(s[b]),
                                                  static_cast<uint64_t>(p[b * K + k]),
                                                  static_cast<uint32_t>(stream));
  }
  return out;
}

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// Raw data pointers of CPU tensors, validated by specengine/ops/verify.py (never call directly).
void verify_py(uintptr_t target_logits, uintptr_t draft_logits, int dtype, int64_t B, int64_t G, int64_t V,
               int64_t target_stride_b, int64_t target_stride_g, int64_t draft_stride_b,
               int64_t draft_stride_g, uintptr_t draft_tokens, uintptr_t num_drafts, uintptr_t temperature,
               uintptr_t top_k, uintptr_t top_p, uintptr_t min_p, uintptr_t seeds, uintptr_t positions,
               uintptr_t u_accept, uintptr_t u_sample, uintptr_t emitted, uintptr_t num_emitted,
               uintptr_t target_lengths, uintptr_t draft_lengths) {
  if (dtype < 0 || dtype > 2) throw std::invalid_argument("dtype code must be 0, 1 or 2");
  specengine::VerifyArgs args{
      ptr<const void>(target_logits), ptr<const void>(draft_logits),
      static_cast<specengine::LogitDtype>(dtype), B, G, V, target_stride_b, target_stride_g,
      draft_stride_b, draft_stride_g, ptr<const int64_t>(draft_tokens), ptr<const int64_t>(num_drafts),
      ptr<const float>(temperature), ptr<const int64_t>(top_k), ptr<const float>(top_p),
      ptr<const float>(min_p), ptr<const int64_t>(seeds), ptr<const int64_t>(positions),
      ptr<const float>(u_accept), ptr<const float>(u_sample), ptr<int64_t>(emitted),
      ptr<int64_t>(num_emitted), ptr<int64_t>(target_lengths), ptr<int64_t>(draft_lengths)};
  py::gil_scoped_release release;
  specengine::verify_cpu(args);
}

// Raw data pointers of CPU tensors, validated by specengine/ops/linear.py (never call directly).
void linear_bf16_weight_py(uintptr_t x, uintptr_t weight, uintptr_t bias, uintptr_t out, int64_t R, int64_t K,
                           int64_t N) {
  if (R < 0 || K < 0 || N < 0) throw std::invalid_argument("R, K and N must be >= 0");
  py::gil_scoped_release release;
  specengine::linear_blocks(ptr<const float>(x), specengine::bf16_matrix(ptr<const uint16_t>(weight), K, N),
                            ptr<const float>(bias), ptr<float>(out), R);
}

void gemm_bf16_weight_amx_py(uintptr_t x, uintptr_t weight, uintptr_t bias, uintptr_t out, int64_t R, int64_t K,
                             int64_t N) {
  if (R < 0 || K < 0 || N < 0) throw std::invalid_argument("R, K and N must be >= 0");
  if (!specengine::gemm_amx_available())
    throw std::invalid_argument("gemm_bf16_weight_amx: this CPU (or the instruction-set limit) has no AMX");
  py::gil_scoped_release release;
  specengine::gemm_bf16_weight_amx(ptr<const float>(x), ptr<const uint16_t>(weight), ptr<const float>(bias),
                                   ptr<float>(out), R, K, N);
}

// Raw data pointers of CPU tensors, validated by specengine/ops/attention.py (never call directly).
void cached_attention_py(uintptr_t q, uintptr_t k, uintptr_t v, int64_t q_token_stride, int64_t k_token_stride,
                         int64_t v_token_stride, uintptr_t cos, uintptr_t sin, uintptr_t positions,
                         uintptr_t cache_k, uintptr_t cache_v, uintptr_t out, int64_t B, int64_t T, int64_t H,
                         int64_t Hkv, int64_t D, int64_t capacity, int64_t cache_row_stride, int64_t kv_len,
                         int64_t window) {
  if (B < 0 || T < 0 || H < 1 || Hkv < 1 || H % Hkv != 0 || D < 1 || capacity < 1 || kv_len < 1 ||
      kv_len > capacity || window < 0 || q_token_stride < H * D || k_token_stride < Hkv * D ||
      v_token_stride < Hkv * D)
    throw std::invalid_argument("cached_attention: inconsistent sizes");
  py::gil_scoped_release release;
  specengine::cached_attention(ptr<const float>(q), ptr<const float>(k), ptr<const float>(v), q_token_stride,
                               k_token_stride, v_token_stride, ptr<const float>(cos),
                               ptr<const float>(sin), ptr<const int64_t>(positions), ptr<float>(cache_k),
                               ptr<float>(cache_v), ptr<float>(out), B, T, H, Hkv, D, capacity, cache_row_stride,
                               kv_len, window);
}

// Raw data pointers of CPU tensors, validated by specengine/ops/attention.py (never call directly);
// k, v and bias_table may be 0 (none).
void relative_attention_py(uintptr_t q, int64_t q_token_stride, uintptr_t k, uintptr_t v, int64_t k_token_stride,
                           int64_t v_token_stride, uintptr_t positions, uintptr_t cache_k, uintptr_t cache_v,
                           int64_t capacity, int64_t cache_row_stride, int64_t kv_len, uintptr_t bias_table,
                           uintptr_t out, int64_t B, int64_t T, int64_t H, int64_t D) {
  if (B < 0 || T < 0 || H < 1 || D < 1 || kv_len < 1 || q_token_stride < H * D ||
      (k != 0 && (k_token_stride < H * D || v_token_stride < H * D || capacity < kv_len)))
    throw std::invalid_argument("relative_attention: inconsistent sizes");
  py::gil_scoped_release release;
  specengine::relative_attention(ptr<const float>(q), q_token_stride, ptr<const float>(k), ptr<const float>(v),
                                 k_token_stride, v_token_stride, ptr<const int64_t>(positions), ptr<float>(cache_k),
                                 ptr<float>(cache_v), capacity, cache_row_stride, kv_len,
                                 ptr<const float>(bias_table), ptr<float>(out), B, T, H, D);
}

// Raw data pointers of CPU tensors, validated by specengine/ops/norm.py (never call directly).
void rms_norm_py(uintptr_t x, uintptr_t weight, uintptr_t out, int64_t R, int64_t N, double eps) {
  if (R < 0 || N < 1) throw std::invalid_argument("rms_norm: need R >= 0 and N >= 1");
  specengine::rms_norm(ptr<const float>(x), ptr<const float>(weight), ptr<float>(out), R, N, static_cast<float>(eps));
}

// A Matrix from its flat descriptor (specengine/ops/blocks_cpp.py's matrix_descriptor):
// [in_features, part_count, type0, data0, rows0, type1, data1, rows1, ...], read from the sequence
// in place (no copy through pybind11's casters): a small product costs only microseconds
// (bench/results/host-overheads-2026-11-29-to-12-03.md).
specengine::Matrix matrix_from(py::handle descriptor) {
  PyObject* fast = PySequence_Fast(descriptor.ptr(), "a matrix descriptor must be a sequence of ints");
  if (fast == nullptr) throw py::error_already_set();
  py::object owner = py::reinterpret_steal<py::object>(fast);
  const Py_ssize_t length = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  auto item = [&](Py_ssize_t i) -> int64_t {
    const long long v = PyLong_AsLongLong(items[i]);
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    return v;
  };
  specengine::Matrix m{};
  if (length < 2) throw std::invalid_argument("matrix descriptor: need [in_features, part_count, ...]");
  m.in_features = item(0);
  m.part_count = item(1);
  if (m.in_features < 0 || m.part_count < 1 || m.part_count > specengine::kMaxMatrixParts ||
      length != 2 + 3 * m.part_count)
    throw std::invalid_argument("matrix descriptor: need 1 to 3 parts of (type, data, rows) after in_features");
  for (int64_t p = 0; p < m.part_count; ++p) {
    const int64_t type = item(2 + 3 * p), data = item(3 + 3 * p), rows = item(4 + 3 * p);
    const int64_t weights = specengine::block_weights(type);
    if (weights == 0 || m.in_features % weights != 0 || rows < 0 || (data == 0 && rows > 0))
      throw std::invalid_argument("matrix descriptor: part " + std::to_string(p) + " has an unknown type, rows < 0, "
                                  "no data, or in_features not a whole number of its blocks");
    m.parts[p] = {static_cast<specengine::WeightType>(type), ptr<const uint8_t>(static_cast<uintptr_t>(data)), rows};
  }
  return m;
}

// Raw data pointers of CPU tensors, validated by specengine/ops/blocks.py (never call directly).
void linear_blocks_py(uintptr_t x, py::handle matrix, uintptr_t bias, uintptr_t out, int64_t R) {
  if (R < 0) throw std::invalid_argument("linear_blocks: R must be >= 0");
  const specengine::Matrix m = matrix_from(matrix);
  py::gil_scoped_release release;
  specengine::linear_blocks(ptr<const float>(x), m, ptr<const float>(bias), ptr<float>(out), R);
}

void gemm_blocks_py(uintptr_t x, py::handle matrix, uintptr_t bias, uintptr_t out, int64_t R, int64_t out_stride) {
  const specengine::Matrix m = matrix_from(matrix);
  if (R < 0) throw std::invalid_argument("gemm_blocks: R must be >= 0");
  if (out_stride < m.out_features()) throw std::invalid_argument("gemm_blocks: out_stride must be >= out_features");
  py::gil_scoped_release release;
  specengine::gemm_blocks(ptr<const float>(x), m, ptr<const float>(bias), ptr<float>(out), R, out_stride);
}

void dequantize_rows_py(py::handle matrix, int64_t row_begin, int64_t row_end, uintptr_t out) {
  const specengine::Matrix m = matrix_from(matrix);
  if (row_begin < 0 || row_end < row_begin || row_end > m.out_features())
    throw std::invalid_argument("dequantize_rows: need 0 <= row_begin <= row_end <= out_features");
  py::gil_scoped_release release;
  specengine::dequantize_rows(m, row_begin, row_end, ptr<float>(out));
}

void gather_rows_py(py::handle matrix, uintptr_t ids, int64_t count, uintptr_t out) {
  const specengine::Matrix m = matrix_from(matrix);
  if (count < 0) throw std::invalid_argument("gather_rows: count must be >= 0");
  const int64_t* rows = ptr<const int64_t>(ids);
  const int64_t N = m.out_features();
  for (int64_t i = 0; i < count; ++i)  // a row past the matrix would be read from past its parts
    if (rows[i] < 0 || rows[i] >= N)
      throw std::invalid_argument("gather_rows: id " + std::to_string(rows[i]) + " is outside [0, " +
                                  std::to_string(N) + ")");
  py::gil_scoped_release release;
  specengine::gather_rows(m, ptr<const int64_t>(ids), count, ptr<float>(out));
}

// Raw data pointers of CPU tensors, validated by specengine/ops/decoder_layer.py (never call directly).
void decoder_layer_py(uintptr_t x, uintptr_t input_norm, py::handle qkv, uintptr_t qkv_bias, uintptr_t q_norm,
                      uintptr_t k_norm, py::handle o, uintptr_t o_bias, uintptr_t post_norm, py::handle gate_up,
                      uintptr_t gate_up_bias, py::handle down, uintptr_t down_bias, int64_t hidden, int64_t H,
                      int64_t Hkv, int64_t D, int64_t intermediate, double eps, uintptr_t cos, uintptr_t sin,
                      uintptr_t positions, uintptr_t cache_k, uintptr_t cache_v, int64_t B, int64_t T,
                      int64_t capacity, int64_t cache_row_stride, int64_t kv_len, int64_t window) {
  if (B < 0 || T < 0 || hidden < 1 || H < 1 || Hkv < 1 || H % Hkv != 0 || D < 1 || intermediate < 1 ||
      capacity < 1 || kv_len < 1 || kv_len > capacity || window < 0 || (q_norm == 0) != (k_norm == 0))
    throw std::invalid_argument("decoder_layer: inconsistent sizes");
  const specengine::DecoderLayerWeights weights{
      ptr<const float>(input_norm), matrix_from(qkv), ptr<const float>(qkv_bias),
      ptr<const float>(q_norm), ptr<const float>(k_norm), matrix_from(o), ptr<const float>(o_bias),
      ptr<const float>(post_norm), matrix_from(gate_up), ptr<const float>(gate_up_bias),
      matrix_from(down), ptr<const float>(down_bias), hidden, H, Hkv, D, intermediate,
      static_cast<float>(eps)};
  // The matrices' shapes, as the layer reads and writes them (a mismatch would reach past them).
  auto shaped = [](const specengine::Matrix& m, int64_t out, int64_t in) {
    return m.out_features() == out && m.in_features == in;
  };
  if (!shaped(weights.qkv, (H + 2 * Hkv) * D, hidden) || !shaped(weights.o, hidden, H * D) ||
      !shaped(weights.gate_up, 2 * intermediate, hidden) || !shaped(weights.down, hidden, intermediate))
    throw std::invalid_argument("decoder_layer: a matrix's shape does not match the layer's sizes");
  const specengine::AttentionStep step{ptr<const float>(cos), ptr<const float>(sin),
                                       ptr<const int64_t>(positions), ptr<float>(cache_k), ptr<float>(cache_v),
                                       B, T, capacity, cache_row_stride, kv_len, window};
  py::gil_scoped_release release;
  specengine::decoder_layer(weights, step, ptr<float>(x));
}

void t5_decoder_block_py(uintptr_t x, uintptr_t self_norm, uintptr_t qkv, uintptr_t self_o, uintptr_t cross_norm,
                         uintptr_t cross_q, uintptr_t cross_o, uintptr_t ff_norm, uintptr_t wi, uintptr_t wo,
                         int64_t hidden, int64_t H, int64_t D, int64_t d_ff, int64_t activation, bool gated,
                         double eps, uintptr_t positions, uintptr_t cache_k, uintptr_t cache_v,
                         uintptr_t bias_table, uintptr_t source_last, uintptr_t cross_k, uintptr_t cross_v, int64_t B,
                         int64_t T, int64_t capacity, int64_t cache_row_stride, int64_t kv_len,
                         int64_t cross_row_stride, int64_t source_capacity) {
  if (B < 0 || T < 0 || hidden < 1 || H < 1 || D < 1 || d_ff < 1 || activation < 0 || activation > 3 ||
      capacity < 1 || kv_len < 1 || kv_len > capacity || source_capacity < 1 || bias_table == 0)
    throw std::invalid_argument("t5_decoder_block: inconsistent sizes");
  const specengine::T5BlockWeights weights{
      ptr<const float>(self_norm), ptr<const uint16_t>(qkv), ptr<const uint16_t>(self_o),
      ptr<const float>(cross_norm), ptr<const uint16_t>(cross_q), ptr<const uint16_t>(cross_o),
      ptr<const float>(ff_norm), ptr<const uint16_t>(wi), ptr<const uint16_t>(wo), hidden, H, D, d_ff,
      static_cast<specengine::T5Activation>(activation), gated, static_cast<float>(eps)};
  const specengine::T5Step step{ptr<const int64_t>(positions), ptr<float>(cache_k), ptr<float>(cache_v),
                                ptr<const float>(bias_table), ptr<const int64_t>(source_last), ptr<float>(cross_k),
                                ptr<float>(cross_v), B, T, capacity, cache_row_stride, kv_len, cross_row_stride,
                                source_capacity};
  py::gil_scoped_release release;
  specengine::t5_decoder_block(weights, step, ptr<float>(x));
}

}  // namespace

void set_cpu_isa_limit_py(const std::string& isa) {
  static const std::pair<const char*, specengine::CpuIsa> names[] = {
      {"portable", specengine::CpuIsa::portable}, {"avx2", specengine::CpuIsa::avx2},
      {"avx512", specengine::CpuIsa::avx512}, {"amx", specengine::CpuIsa::amx}};
  for (const auto& [name, level] : names)
    if (isa == name) {
      specengine::isa_limit() = static_cast<int>(level);
      return;
    }
  throw std::invalid_argument("cpu isa must be 'amx', 'avx512', 'avx2' or 'portable', not '" + isa + "'");
}

std::string cpu_isa_py() {
  return specengine::use_amx()      ? "amx"
         : specengine::use_avx512() ? "avx512"
         : specengine::use_avx2()   ? "avx2"
                                    : "portable";
}

// blocks.h's kWeightTypes, one dict per type with kernels/weight_types.py's field names.
py::list weight_type_traits_py() {
  py::list types;
  for (const specengine::WeightTypeLayout& t : specengine::kWeightTypes) {
    py::dict entry;
    entry["name"] = t.name;
    entry["type_id"] = static_cast<int64_t>(t.type);
    entry["block_size"] = t.block_weights;
    entry["block_bytes"] = t.block_bytes;
    entry["d"] = t.d;
    entry["m"] = t.m;
    entry["scales"] = t.scales;
    entry["qh"] = t.qh;
    entry["qs"] = t.qs;
    types.append(entry);
  }
  return types;
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "specengine C++ CPU ops";
  m.def("ngram_propose", &ngram_propose_py, py::arg("tokens"), py::arg("min_n"), py::arg("max_n"),
        py::arg("max_drafts"),
        "Tokens that followed the most recent earlier occurrence of the longest re-occurring "
        "suffix n-gram (min_n <= n <= max_n), at most max_drafts of them.");
  m.def("verify", &verify_py, "Fused verify step on CPU tensors (use specengine.ops.verify).",
        py::arg("target_logits"), py::arg("draft_logits"), py::arg("dtype"), py::arg("B"), py::arg("G"),
        py::arg("V"), py::arg("target_stride_b"), py::arg("target_stride_g"), py::arg("draft_stride_b"),
        py::arg("draft_stride_g"), py::arg("draft_tokens"), py::arg("num_drafts"), py::arg("temperature"),
        py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("seeds"), py::arg("positions"),
        py::arg("u_accept"), py::arg("u_sample"), py::arg("emitted"), py::arg("num_emitted"),
        py::arg("target_lengths"), py::arg("draft_lengths"));
  m.def("linear_bf16_weight", &linear_bf16_weight_py,
        "out [R, N] = x [R, K] float32 @ weight [N, K] bfloat16 ^T + bias (use specengine.ops.linear).",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"), py::arg("R"), py::arg("K"), py::arg("N"));
  m.def("linear_blocks", &linear_blocks_py,
        "out [R, N] = x [R, K] float32 @ matrix [N, K] (ggml blocks, a descriptor) ^T + bias (use "
        "specengine.ops.blocks).",
        py::arg("x"), py::arg("matrix"), py::arg("bias"), py::arg("out"), py::arg("R"));
  m.def("gemm_blocks", &gemm_blocks_py,
        "out [R, out_stride] columns [0, N) = x [R, K] float32 @ matrix [N, K] (a descriptor) ^T + bias, for "
        "prompt-sized R: float32 FMA chains over k, each output's bits independent of the other rows (use "
        "specengine.ops.blocks).",
        py::arg("x"), py::arg("matrix"), py::arg("bias"), py::arg("out"), py::arg("R"), py::arg("out_stride"));
  m.def("dequantize_rows", &dequantize_rows_py,
        "out = the exact float32 weights of rows [row_begin, row_end) of a matrix descriptor (use "
        "specengine.ops.blocks).",
        py::arg("matrix"), py::arg("row_begin"), py::arg("row_end"), py::arg("out"));
  m.def("weight_type_traits", &weight_type_traits_py,
        "The weight types the block ops take, as csrc/blocks.h lays them out: a dict per type (name, type_id, "
        "block_size, block_bytes and the byte offsets d, m, scales, qh, qs; -1 where absent).");
  m.def("gather_rows", &gather_rows_py,
        "out [count, K] = the exact float32 weights of rows ids [count] int64 of a matrix descriptor (use "
        "specengine.ops.blocks).",
        py::arg("matrix"), py::arg("ids"), py::arg("count"), py::arg("out"));
  m.def("gemm_bf16_weight_amx", &gemm_bf16_weight_amx_py,
        "out [R, N] = x [R, K] float32 @ weight [N, K] bfloat16 ^T + bias on AMX tiles, for prompt-sized R "
        "(use specengine.ops.linear).",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"), py::arg("R"), py::arg("K"), py::arg("N"));
  m.def("cached_attention", &cached_attention_py,
        "Rotary, KV-cache write and attention of one layer on CPU tensors (use specengine.ops.attention).",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("q_token_stride"), py::arg("k_token_stride"),
        py::arg("v_token_stride"), py::arg("cos"), py::arg("sin"), py::arg("positions"),
        py::arg("cache_k"), py::arg("cache_v"), py::arg("out"), py::arg("B"), py::arg("T"), py::arg("H"),
        py::arg("Hkv"), py::arg("D"), py::arg("capacity"), py::arg("cache_row_stride"), py::arg("kv_len"),
        py::arg("window"));
  m.def("relative_attention", &relative_attention_py,
        "T5 attention of one layer over a static cache, with its relative position bias, on CPU tensors "
        "(use specengine.ops.attention).",
        py::arg("q"), py::arg("q_token_stride"), py::arg("k"), py::arg("v"), py::arg("k_token_stride"),
        py::arg("v_token_stride"), py::arg("positions"), py::arg("cache_k"), py::arg("cache_v"), py::arg("capacity"),
        py::arg("cache_row_stride"), py::arg("kv_len"), py::arg("bias_table"), py::arg("out"), py::arg("B"),
        py::arg("T"), py::arg("H"), py::arg("D"));
  m.def("decoder_layer", &decoder_layer_py,
        "One Llama decoder layer, in place on x [B * T, hidden] float32, matrices as descriptors of ggml "
        "blocks (use specengine.ops.decoder_layer).",
        py::arg("x"), py::arg("input_norm"), py::arg("qkv"), py::arg("qkv_bias"), py::arg("q_norm"),
        py::arg("k_norm"), py::arg("o"), py::arg("o_bias"), py::arg("post_norm"), py::arg("gate_up"),
        py::arg("gate_up_bias"), py::arg("down"), py::arg("down_bias"), py::arg("hidden"), py::arg("H"),
        py::arg("Hkv"), py::arg("D"), py::arg("intermediate"), py::arg("eps"), py::arg("cos"), py::arg("sin"),
        py::arg("positions"), py::arg("cache_k"), py::arg("cache_v"), py::arg("B"), py::arg("T"),
        py::arg("capacity"), py::arg("cache_row_stride"), py::arg("kv_len"), py::arg("window"));
  m.def("t5_decoder_block", &t5_decoder_block_py,
        "One T5 decoder block, in place on x [B * T, hidden] float32, bfloat16 matrices (use "
        "specengine.ops.decoder_layer).",
        py::arg("x"), py::arg("self_norm"), py::arg("qkv"), py::arg("self_o"), py::arg("cross_norm"),
        py::arg("cross_q"), py::arg("cross_o"), py::arg("ff_norm"), py::arg("wi"), py::arg("wo"), py::arg("hidden"),
        py::arg("H"), py::arg("D"), py::arg("d_ff"), py::arg("activation"), py::arg("gated"), py::arg("eps"),
        py::arg("positions"), py::arg("cache_k"), py::arg("cache_v"), py::arg("bias_table"), py::arg("source_last"),
        py::arg("cross_k"), py::arg("cross_v"), py::arg("B"), py::arg("T"), py::arg("capacity"),
        py::arg("cache_row_stride"), py::arg("kv_len"), py::arg("cross_row_stride"), py::arg("source_capacity"));
  m.def("rms_norm", &rms_norm_py, "Llama RMSNorm of float32 rows (use specengine.ops.norm).",
        py::arg("x"), py::arg("weight"), py::arg("out"), py::arg("R"), py::arg("N"), py::arg("eps"));
  m.def("set_cpu_isa_limit", &set_cpu_isa_limit_py, py::arg("isa"),
        "The widest instruction set the C++ ops may use: 'amx' (the default), 'avx512', 'avx2' or "
        "'portable' (tests of the narrower paths on a CPU that has the wider ones).");
  m.def("cpu_isa", &cpu_isa_py, "The widest instruction set the C++ ops take now: amx, avx512, avx2 or portable.");
  m.def("philox_uniforms", &philox_uniforms_py, py::arg("seeds"), py::arg("positions"),
        py::arg("stream"),
        "Uniforms [B, K] in [0, 1) keyed by (seeds[b], positions[b, k], stream), Philox4x32-10.");
}
