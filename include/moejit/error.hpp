// libmoejit: the one error type every API throws.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace moejit {

// What went wrong, coarse enough to branch on.
enum class ErrorCode {
  kInvalidDescriptor,  // a shape file or shape value breaks a rule
  kInvalidArgument,    // an op was called with bad tensors or sizes
  kUnsupported,        // valid, but no kernel serves it (the message says why)
  kCompileFailed,      // NVRTC refused the generated source
  kCacheCorrupt,       // an entry failed verification and could not be healed
  kCache,              // the cache directory could not be used as asked
  kDriver,             // a CUDA driver call failed, or no driver is present
  kCaptureMiss,        // a kernel not loaded in this process was needed during stream capture
  kIo,                 // a file could not be read or written
  kInternal,           // a bug in libmoejit
};

const char* error_code_name(ErrorCode code) noexcept;

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

// A descriptor refused before anything compiled: where, and which rule.
class DescriptorError : public Error {
 public:
  DescriptorError(const std::string& message, std::string file, int line, int column,
                  std::string pointer)
      : Error(ErrorCode::kInvalidDescriptor, message),
        file_(std::move(file)),
        line_(line),
        column_(column),
        pointer_(std::move(pointer)) {}
  const std::string& file() const noexcept { return file_; }
  int line() const noexcept { return line_; }        // 1-based; 0 when unknown
  int column() const noexcept { return column_; }    // 1-based; 0 when unknown
  const std::string& pointer() const noexcept { return pointer_; }  // JSON pointer, "" = root

 private:
  std::string file_;
  int line_;
  int column_;
  std::string pointer_;
};

// NVRTC refused a kernel: everything needed to reproduce it.
class CompileError : public Error {
 public:
  CompileError(const std::string& message, std::string kernel, std::vector<std::string> options,
               std::string log, std::string source_path)
      : Error(ErrorCode::kCompileFailed, message),
        kernel_(std::move(kernel)),
        options_(std::move(options)),
        log_(std::move(log)),
        source_path_(std::move(source_path)) {}
  const std::string& kernel() const noexcept { return kernel_; }
  const std::vector<std::string>& options() const noexcept { return options_; }
  const std::string& log() const noexcept { return log_; }
  const std::string& source_path() const noexcept { return source_path_; }  // "" if not saved

 private:
  std::string kernel_;
  std::vector<std::string> options_;
  std::string log_;
  std::string source_path_;
};

}  // namespace moejit
