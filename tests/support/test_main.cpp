// Catch2 main shared by the test binaries. The GPU binary exits with 77 (ctest: Skipped) and
// prints why when no usable CUDA device is present.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>
#include <string>

#include "support/support.hpp"

int main(int argc, char** argv) {
#ifdef MOEJIT_TEST_NEEDS_GPU
  std::string why;
  if (!moejit::test::gpu_available(&why)) {
    std::printf("SKIPPED: GPU tests need a CUDA device: %s\n", why.c_str());
    return 77;
  }
#endif
  return Catch::Session().run(argc, argv);
}
