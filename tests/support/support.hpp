// Helpers shared by the tests.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "codegen/codegen.hpp"
#include "moejit/shape.hpp"

namespace moejit::test {

// A fresh private temporary directory, removed by the destructor.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A kernel `moejit_test::copy_ring(const unsigned char* src, unsigned* out, int slots)` for one
// CTA of 256 threads and 16 KB of dynamic shared memory, slots <= 4: a loop of one 16-byte
// cp.async a thread into 4 KB slot s (at (s % 4) * 4096, a uniform offset known only at run time,
// plus the thread's), `copy` being the statement that issues it (it sees dst, from and pol); then
// out[i] = the ring's word i for i < 4096, so out = src[0, 4096 * slots) where slots = 4.
// ptxas 13.0 encodes its cache-hinted copies for sm_90a in the [R+UR] LDGSTS form that faults
// (src/compile/cubin_check.hpp).
detail::GeneratedSource copy_ring_source(const std::string& file_name, const std::string& copy);
// The copy statement of kernels/moe/ptx.cuh (hinted unless MOEJIT_NO_L2_CACHE_HINT).
inline const char* const kRingLibraryCopy = "kp::cp_async_16_stream(dst, from, 16u, pol);";
// A copy that keeps its L2 hint whatever the macro says.
inline const char* const kRingHintedCopy =
    "asm volatile(\"cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, 16, %2;\""
    " :: \"r\"(dst), \"l\"(from), \"l\"(pol) : \"memory\");";

// A little-endian ELF64 image as the cubin checks read one (src/compile/cubin_check.hpp): the
// header, each section's bytes, then the section table (entry 0 the null section, as ELF has it).
struct ElfSection {
  uint32_t type;      // SHT_*
  uint64_t flags;     // SHF_*
  std::string bytes;  // the section's contents
};
std::string elf_image(const std::vector<ElfSection>& sections);
// A whole ELF64 image carrying `payload` as its one data section: the cubin of a made-up cache
// entry (the disk cache stores and serves whole ELF images only).
std::string cubin_image(const std::string& payload);

// A whole file's bytes ("" when it can't be read).
std::string read_text(const std::string& path);
// Writes `text` as the whole file, creating its parent directories; throws std::runtime_error
// naming the path when it can't.
void write_text(const std::string& path, const std::string& text);

// Whether a CUDA device can be used (driver loads, at least one device); else why not.
bool gpu_available(std::string* why);

// The bundled shape files (tools/shapes), from the test environment.
std::string shapes_dir();

// The bundled reference shapes (shapes_dir() + "/reference.json"); throws std::runtime_error
// naming the path when the file is missing.
std::vector<ModelShape> reference_shapes();

// tools/shapes/public.json: public MoE models beyond the reference models, for the planner's and
// the kernels' generality.
std::vector<ModelShape> public_shapes();

// The shape named `name` in `shapes`; throws std::runtime_error naming it when absent.
const ModelShape& find_shape(const std::vector<ModelShape>& shapes, const std::string& name);

// Experts of a rank that uniform top-k routing of `tokens` tokens touches, expected (the
// planners' estimate, restated): E (1 - (1 - k / E)^T).
double expected_touched(int experts, int top_k, int tokens);

// marlin_moe's planner rules, restated for the tests.
// Route blocks of 8 rows from T = 3 while T * K <= 5 x the routed experts of all ranks (experts
// average at most 5 rows), whatever T.
bool small_blocks_expected(const ModelShape& shape, int tokens);
// FC1 with 8-row blocks takes 128-row CTAs (four per SM) where uniform top-k routing's expected
// touched experts, E (1 - (1 - k/E)^T), times the 128-row tiles of FC1's 2I rows reach 1.5 waves
// of 4 x 132 CTA slots (792 CTAs).
bool fc1_tall_expected(const ModelShape& shape, int tokens);
// FC2 with 8-row blocks takes the same 128-row CTAs by the same rule over H rows, where its K is
// long (I > 768; the short-K tile otherwise).
bool fc2_short_k_expected(const ModelShape& shape);
bool fc2_tall_expected(const ModelShape& shape, int tokens);
// Whether FC2 with 16-row blocks takes the short-K tile (256 rows, four warps of four atoms):
// I <= 768 and its CTAs at the bucket's first T fill four waves of 3 x 132.
bool fc2_mid_short_k_expected(const ModelShape& shape);
// Below that, the 8-row bucket's 64-row tile takes its wave variant (three stages, five CTAs per
// SM) where the expected touched experts times its tiles of `rows` weight rows fill one wave of
// 4 x 132 CTAs.
bool small_block_wave_expected(const ModelShape& shape, int tokens, int rows);
// Which tiles the T of 8-row blocks (up to max_tokens) use: the bucket's 64-row one, its wave
// variant, the tall one; for FC1 (2I rows) or FC2 (H rows; none for short-K shapes).
struct BucketTiles {
  bool base = false;
  bool wave = false;
  bool tall = false;
  int count() const { return (base ? 1 : 0) + (wave ? 1 : 0) + (tall ? 1 : 0); }
};
BucketTiles fc1_bucket_tiles(const ModelShape& shape);
BucketTiles fc2_bucket_tiles(const ModelShape& shape);
// Which tiles the T of 16-row blocks (past the 8-row ones, up to 512 and max_tokens) use on
// sm_90a: the mma.sync one below 12 rows per routed expert (14 where H is a multiple of 256),
// the warpgroup one from there.
struct MidBucketTiles {
  bool mma = false;
  bool wgmma = false;
};
MidBucketTiles mid_bucket_tiles(const ModelShape& shape);
// Which warpgroup tiles T = first..last (up to max_tokens) use on sm_90a from T = 513 (32-row
// blocks to 1024, 64-row above): N = 64 below 56 rows per routed expert, N = 128 from 56, and
// with 64-row blocks N = 256 from 384 where min(H, I) spans 40 K tiles of 64 or more.
struct WideTiles {
  bool n64 = false;
  bool n128 = false;
  bool n256 = false;
  int count() const { return static_cast<int>(n64) + n128 + n256; }
};
WideTiles wide_tiles(const ModelShape& shape, int first, int last);
// The warpgroup tile's N at T (from 513) by the same rule: 64, 128 or 256.
int wide_wgmma_n(const ModelShape& shape, int tokens);
// The marlin_moe kernels prewarm plans for the shape, from the rules above: five tiles (T = 1,
// 8-row blocks, 16-row blocks, 32-row, 64-row), FC1 and FC2 each; two more for each block size
// whose T take two tiles on sm_90a (mma.sync and warpgroup, or two warpgroup widths) and four
// where 64-row blocks take all three widths; one
// more FC1 or FC2 for each further tile the T of 8-row blocks take (fc1_bucket_tiles,
// fc2_bucket_tiles); and each FC2 kernel that splits K (fc2_split_kernels).
int planned_marlin_kernels(const ModelShape& shape, bool sm90a);
// The distinct FC2 kernels that split K (MarlinMoeParams::k_splits > 1) over T = 1..300, as
// choose_moe_config picks them, and the distinct combine kernels that add their row sets.
std::vector<MarlinMoeParams> fc2_split_kernels(const ModelShape& shape);
int fc2_split_combines(const ModelShape& shape);

// Run a shell command, returning its exit status and its output (stdout and stderr).
int run_command(const std::string& command, std::string* output);

// The variable a parent case sets, in the environment of the process it starts for one of this
// binary's hidden cases, to that case's tag (without brackets).
inline const char* const kChildCaseVariable = "MOEJIT_TEST_CHILD_CASE";

// Whether the hidden case `tag` runs in the process its parent case `parent` started for it
// (kChildCaseVariable is `tag`). Why ask: a test spec that names a hidden case runs it in the
// caller's process, where it finds that process's state (kernels loaded, another environment)
// and may fail falsely or, ending the process with status 0, cut the run short so that it reads
// as passed. Otherwise warns "SKIPPED", naming the parent, and returns false.
bool started_by_parent(const char* tag, const char* parent);

// Whether a child forked now passes: it runs `body` with 10 s to live (SIGALRM) and exits 0 only
// when `body` returns true (an exception fails it). False too when the fork or the wait fails.
bool forked_child_passes(const std::function<bool()>& body);

// What a prefork server or Python multiprocessing does while other threads use the library:
// forks `children` children one after another (forked_child_passes(child)) while a thread of
// this process runs `hammer` (which must not throw) in a loop, and returns how many failed or
// blocked. The thread is stopped and joined before it returns.
int children_failing_under(const std::function<void()>& hammer, const std::function<bool()>& child,
                           int children = 100);

}  // namespace moejit::test
