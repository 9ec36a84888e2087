// Helpers shared by the tests.
#pragma once

#include <string>

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

// Whether a CUDA device can be used (driver loads, at least one device); else why not.
bool gpu_available(std::string* why);

// The bundled shape files (tools/shapes), from the test environment.
std::string shapes_dir();

// Run a shell command, returning its exit status and its output (stdout and stderr).
int run_command(const std::string& command, std::string* output);

}  // namespace moejit::test
