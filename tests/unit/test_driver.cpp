// The driver facts computed from device attributes, against a driver table whose attribute query
// is a test function (no GPU, no libcuda).
#include <catch2/catch.hpp>
#include <limits>

#include "driver/driver.hpp"

namespace {

using moejit::detail::DriverApi;
using moejit::detail::peak_dram_bytes_per_second;

// What the fake query answers, by attribute; a negative value fails the query.
int g_clock_khz = 0;
int g_bus_bits = 0;

CUresult fake_attribute(int* value, CUdevice_attribute attribute, CUdevice) {
  const int answer = attribute == CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE         ? g_clock_khz
                     : attribute == CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH ? g_bus_bits
                                                                                : -1;
  if (answer < 0) return CUDA_ERROR_INVALID_VALUE;
  *value = answer;
  return CUDA_SUCCESS;
}

}  // namespace

TEST_CASE("driver: the peak DRAM rate is twice the memory clock times the bus width", "[driver]") {
  DriverApi api;
  api.cuDeviceGetAttribute = &fake_attribute;

  // An H200's HBM3e: 3.13 GHz over 6144 bits, double data rate.
  g_clock_khz = 3130000;
  g_bus_bits = 6144;
  CHECK(peak_dram_bytes_per_second(api, 0) == 2LL * 3130000 * 1000 * 768);
  // No overflow at the largest int clock over a 16384-bit bus.
  g_clock_khz = 2147483647;
  g_bus_bits = 16384;
  CHECK(peak_dram_bytes_per_second(api, 0) == 2LL * 2147483647 * 1000 * 2048);
  // Past a long long (no such bus): saturated, never wrapped to a small or negative rate.
  g_bus_bits = 2147483647;
  CHECK(peak_dram_bytes_per_second(api, 0) == std::numeric_limits<long long>::max());

  // Unknown (not reported, or 0): 0, so nothing is paced by a made-up rate.
  g_clock_khz = 0;
  g_bus_bits = 6144;
  CHECK(peak_dram_bytes_per_second(api, 0) == 0);
  g_clock_khz = 3130000;
  g_bus_bits = 0;
  CHECK(peak_dram_bytes_per_second(api, 0) == 0);
  g_clock_khz = -1;  // the query fails
  g_bus_bits = 6144;
  CHECK(peak_dram_bytes_per_second(api, 0) == 0);
  g_clock_khz = 3130000;
  g_bus_bits = -1;
  CHECK(peak_dram_bytes_per_second(api, 0) == 0);
}
