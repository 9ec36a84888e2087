#include "support/support.hpp"

#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <catch2/catch.hpp>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

#include "driver/driver.hpp"
#include "plan/moe_plan.hpp"

namespace moejit::test {

TempDir::TempDir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "moejit-test-XXXXXX").string();
  if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = pattern;
}

TempDir::~TempDir() {
  std::error_code ec;
  // Restore write permission on anything a test made read-only, then remove it all.
  for (auto it = std::filesystem::recursive_directory_iterator(path_, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    std::filesystem::permissions(it->path(), std::filesystem::perms::owner_all,
                                 std::filesystem::perm_options::add, ec);
  }
  std::filesystem::permissions(path_, std::filesystem::perms::owner_all,
                               std::filesystem::perm_options::add, ec);
  std::filesystem::remove_all(path_, ec);
}

bool gpu_available(std::string* why) {
  const detail::DriverApi* api = detail::try_driver(why);
  if (api == nullptr) return false;
  int count = 0;
  if (api->cuDeviceGetCount(&count) != CUDA_SUCCESS || count == 0) {
    *why = "the driver reports no CUDA device";
    return false;
  }
  return true;
}

std::string shapes_dir() {
  const char* dir = std::getenv("MOEJIT_TEST_SHAPES_DIR");
  if (dir == nullptr) throw std::runtime_error("MOEJIT_TEST_SHAPES_DIR is not set (run via ctest)");
  return dir;
}

std::vector<ModelShape> reference_shapes() {
  const std::string path = shapes_dir() + "/reference.json";
  if (!std::filesystem::exists(path)) {
    throw std::runtime_error("the reference shapes file " + path + " does not exist");
  }
  return load_shapes_file(path);
}

std::vector<ModelShape> public_shapes() {
  const std::string path = shapes_dir() + "/public.json";
  if (!std::filesystem::exists(path)) {
    throw std::runtime_error("the public shapes file " + path + " does not exist");
  }
  return load_shapes_file(path);
}

const ModelShape& find_shape(const std::vector<ModelShape>& shapes, const std::string& name) {
  for (const ModelShape& shape : shapes) {
    if (shape.name == name) return shape;
  }
  throw std::runtime_error("no reference shape named " + name);
}

double expected_touched(int experts, int top_k, int tokens) {
  const double e = experts;
  return e * (1.0 - std::pow(1.0 - std::min(1.0, top_k / e), static_cast<double>(tokens)));
}

namespace {
long long routed_rows(const ModelShape& shape, int tokens, int rows_per_expert) {
  return static_cast<long long>(rows_per_expert) *
             std::max(shape.num_experts, shape.global_experts) -
         static_cast<long long>(tokens) * shape.top_k;
}
}  // namespace

bool small_blocks_expected(const ModelShape& shape, int tokens) {
  return tokens >= 3 && routed_rows(shape, tokens, 5) >= 0;
}

namespace {
// 128-row CTAs (four per SM) for a GEMM of 8-row blocks over `rows` weight rows: 1.5 waves.
bool tall_expected(const ModelShape& shape, int tokens, int rows) {
  if (!small_blocks_expected(shape, tokens)) return false;
  const int tiles = (rows + 127) / 128;
  // 1.5 waves of four 128-row CTAs per SM on 132 SMs (the 792 CTAs of the first measurement).
  return expected_touched(shape.num_experts, shape.top_k, tokens) * tiles >= 1.5 * 4 * 132;
}

BucketTiles bucket_tiles(const ModelShape& shape, int rows) {
  BucketTiles out;
  for (int t = 3; t <= shape.max_tokens && small_blocks_expected(shape, t); ++t) {
    if (tall_expected(shape, t, rows)) {
      out.tall = true;
    } else {
      (small_block_wave_expected(shape, t, rows) ? out.wave : out.base) = true;
    }
  }
  return out;
}
}  // namespace

bool fc1_tall_expected(const ModelShape& shape, int tokens) {
  return tall_expected(shape, tokens, 2 * shape.intermediate);
}

bool fc2_short_k_expected(const ModelShape& shape) { return shape.intermediate <= 768; }

bool fc2_mid_short_k_expected(const ModelShape& shape) {
  if (!fc2_short_k_expected(shape)) return false;
  // The first T of 16-row blocks: experts average more than 5 rows.
  const long long routed = std::max(shape.num_experts, shape.global_experts);
  const int first = static_cast<int>(5 * routed / shape.top_k + 1);
  const int tiles = (shape.hidden + 255) / 256;
  // Four waves of three 256-row CTAs per SM on 132 SMs.
  return expected_touched(shape.num_experts, shape.top_k, first) * tiles >= 4 * 3 * 132;
}

bool fc2_tall_expected(const ModelShape& shape, int tokens) {
  return !fc2_short_k_expected(shape) && tall_expected(shape, tokens, shape.hidden);
}

bool small_block_wave_expected(const ModelShape& shape, int tokens, int rows) {
  if (!small_blocks_expected(shape, tokens)) return false;
  const int tiles = (rows + 63) / 64;
  return expected_touched(shape.num_experts, shape.top_k, tokens) * tiles >= 4 * 132;
}

BucketTiles fc1_bucket_tiles(const ModelShape& shape) {
  return bucket_tiles(shape, 2 * shape.intermediate);
}

BucketTiles fc2_bucket_tiles(const ModelShape& shape) {
  return fc2_short_k_expected(shape) ? BucketTiles{} : bucket_tiles(shape, shape.hidden);
}

MidBucketTiles mid_bucket_tiles(const ModelShape& shape) {
  MidBucketTiles out;
  for (int t = 3; t <= std::min(512, shape.max_tokens); ++t) {
    if (small_blocks_expected(shape, t)) continue;
    const int wgmma_rows = shape.hidden % 256 == 0 ? 14 : 12;  // FC1's wide-K tile: 14
    (routed_rows(shape, t, wgmma_rows) <= 0 ? out.wgmma : out.mma) = true;
  }
  return out;
}

int wide_wgmma_n(const ModelShape& shape, int tokens) {
  if (routed_rows(shape, tokens, 56) > 0) return 64;
  // N = 256: 64-row blocks, and both GEMMs 40 K tiles or more.
  const bool long_k = std::min(shape.hidden, shape.intermediate) > 39 * 64;
  return tokens > 1024 && long_k && routed_rows(shape, tokens, 384) <= 0 ? 256 : 128;
}

WideTiles wide_tiles(const ModelShape& shape, int first, int last) {
  WideTiles out;
  for (int t = first; t <= std::min(last, shape.max_tokens); ++t) {
    const int n = wide_wgmma_n(shape, t);
    (n == 64 ? out.n64 : n == 128 ? out.n128 : out.n256) = true;
  }
  return out;
}

int planned_marlin_kernels(const ModelShape& shape, bool sm90a) {
  int kernels = 10;
  if (sm90a) {
    const MidBucketTiles mid = mid_bucket_tiles(shape);
    // FC1 and FC2 each plan both tiles, but FC2 keeps its short-K tile beside the warpgroup FC1.
    if (mid.mma && mid.wgmma) kernels += fc2_mid_short_k_expected(shape) ? 1 : 2;
    for (const auto& [first, last] : {std::pair{513, 1024}, std::pair{1025, INT_MAX}}) {
      kernels += 2 * (wide_tiles(shape, first, last).count() - 1);
    }
  }
  // (The five tiles count one FC1 and one FC2 kernel for 8-row blocks.)
  const int fc1 = fc1_bucket_tiles(shape).count();
  const int fc2 = fc2_bucket_tiles(shape).count();
  return kernels + std::max(fc1 - 1, 0) + std::max(fc2 - 1, 0) +
         static_cast<int>(fc2_split_kernels(shape).size());
}

std::vector<MarlinMoeParams> fc2_split_kernels(const ModelShape& shape) {
  std::vector<MarlinMoeParams> out;
  for (int t = 1; t <= std::min(shape.max_tokens, 300); ++t) {
    const MarlinMoeParams fc2 = detail::choose_moe_config(shape, t).fc2;
    if (fc2.k_splits > 1 && std::find(out.begin(), out.end(), fc2) == out.end()) out.push_back(fc2);
  }
  return out;
}

int fc2_split_combines(const ModelShape& shape) {
  std::vector<MoeCombineParams> out;
  for (int t = 1; t <= std::min(shape.max_tokens, 300); ++t) {
    const MoeCombineParams combine = detail::choose_moe_config(shape, t).combine;
    if (combine.k_splits > 1 && std::find(out.begin(), out.end(), combine) == out.end()) {
      out.push_back(combine);
    }
  }
  return static_cast<int>(out.size());
}

int run_command(const std::string& command, std::string* output) {
  std::string full = command + " 2>&1";
  FILE* pipe = popen(full.c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error("popen failed: " + command);
  std::array<char, 4096> buffer{};
  output->clear();
  size_t n = 0;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0) {
    output->append(buffer.data(), n);
  }
  int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

bool started_by_parent(const char* tag, const char* parent) {
  const char* value = std::getenv(kChildCaseVariable);
  if (value != nullptr && std::string(value) == tag) return true;
  WARN("SKIPPED: the hidden case [" << tag << "] is the child half of \"" << parent
                                    << "\", which runs it in a process of its own; run that case");
  return false;
}

detail::GeneratedSource copy_ring_source(const std::string& file_name, const std::string& copy) {
  detail::GeneratedSource src;
  src.file_name = file_name;
  src.name_expression = "&moejit_test::copy_ring";
  src.source =
      "#include <moejit/kern/moe/ptx.cuh>\n"
      "namespace moejit_test {\n"
      "namespace kp = moejit::kern::moe::ptx;\n"
      "__global__ void copy_ring(const unsigned char* src, unsigned* out, int slots) {\n"
      "  extern __shared__ __align__(128) unsigned char smem[];\n"
      "  const unsigned base = kp::smem_u32(smem);\n"
      "  const unsigned long long pol = kp::policy_evict_first();\n"
      "  for (int s = 0; s < slots; ++s) {\n"
      "    const unsigned dst = base + (s % 4) * 4096 + threadIdx.x * 16;\n"
      "    const unsigned char* from = src + s * 4096 + threadIdx.x * 16;\n"
      "    " +
      copy +
      "\n"
      "    kp::cp_async_commit();\n"
      "  }\n"
      "  kp::cp_async_wait<0>();\n"
      "  __syncthreads();\n"
      "  const unsigned* ring = reinterpret_cast<const unsigned*>(smem);\n"
      "  for (int i = threadIdx.x; i < 4096; i += blockDim.x) out[i] = ring[i];\n"
      "}\n"
      "}  // namespace moejit_test\n";
  return src;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

void write_text(const std::string& path, const std::string& text) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.flush();
  if (!out) throw std::runtime_error("cannot write " + path);
}

bool forked_child_passes(const std::function<bool()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(10);
    bool ok = false;
    try {
      ok = body();
    } catch (...) {
    }
    ::_exit(ok ? 0 : 1);
  }
  if (pid < 0) return false;
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return false;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

int children_failing_under(const std::function<void()>& hammer, const std::function<bool()>& child,
                           int children) {
  std::atomic<bool> stop{false};
  std::thread thread([&] {
    while (!stop) hammer();
  });
  int failed = 0;
  for (int i = 0; i < children; ++i) {
    if (!forked_child_passes(child)) ++failed;
  }
  stop = true;
  thread.join();
  return failed;
}

std::string elf_image(const std::vector<ElfSection>& sections) {
  const auto put = [](std::string& image, std::size_t at, auto value) {
    std::memcpy(image.data() + at, &value, sizeof(value));
  };
  std::string image(64, '\0');
  image.replace(0, 4,
                "\x7f"
                "ELF");
  image[4] = 2;                                       // ELFCLASS64
  image[5] = 1;                                       // ELFDATA2LSB
  image[6] = 1;                                       // EV_CURRENT
  std::vector<std::pair<uint64_t, uint64_t>> placed;  // offset, size
  for (const ElfSection& s : sections) {
    placed.emplace_back(image.size(), s.bytes.size());
    image += s.bytes;
  }
  const uint64_t table = image.size();
  image.append(64 * (sections.size() + 1), '\0');
  for (std::size_t i = 0; i < sections.size(); ++i) {
    const std::size_t header = table + 64 * (i + 1);
    put(image, header + 4, sections[i].type);
    put(image, header + 8, sections[i].flags);
    put(image, header + 24, placed[i].first);
    put(image, header + 32, placed[i].second);
  }
  put(image, 0x28, table);
  put(image, 0x3A, uint16_t{64});
  put(image, 0x3C, static_cast<uint16_t>(sections.size() + 1));
  return image;
}

std::string cubin_image(const std::string& payload) {
  constexpr uint32_t kProgbits = 1;
  constexpr uint64_t kAlloc = 0x2;
  return elf_image({{kProgbits, kAlloc, payload}});
}

}  // namespace moejit::test
