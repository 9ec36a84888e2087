// Captures what the library's "moejit" logger emits at warn and above while alive, or watches for
// one debug line (tests only).
#pragma once

#include <spdlog/sinks/base_sink.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/log.hpp"

namespace moejit::test {

// `sink` attached to the library's logger, which runs at `at_least` or finer, for the holder's
// lifetime; then the logger's level as it was. Attach and detach while no other thread logs:
// spdlog's sink list is not guarded.
class AttachedSink {
 public:
  AttachedSink(std::shared_ptr<spdlog::sinks::sink> sink, spdlog::level::level_enum at_least)
      : sink_(std::move(sink)), previous_(detail::log().level()) {
    detail::log().sinks().push_back(sink_);
    if (previous_ > at_least) detail::log().set_level(at_least);
  }
  ~AttachedSink() {
    auto& sinks = detail::log().sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
    detail::log().set_level(previous_);
  }
  AttachedSink(const AttachedSink&) = delete;
  AttachedSink& operator=(const AttachedSink&) = delete;

 private:
  std::shared_ptr<spdlog::sinks::sink> sink_;
  spdlog::level::level_enum previous_;
};

class WarningCapture {
 public:
  WarningCapture() : sink_(std::make_shared<Sink>()), attached_(sink_, spdlog::level::warn) {}
  WarningCapture(const WarningCapture&) = delete;
  WarningCapture& operator=(const WarningCapture&) = delete;

  // Every warning so far, in order.
  std::vector<std::string> messages() const {
    std::lock_guard<std::mutex> guard(sink_->lines_mutex);
    return sink_->lines;
  }
  // Whether one warning line contains every one of `parts`.
  bool warned(const std::vector<std::string>& parts) const {
    for (const std::string& line : messages()) {
      if (std::all_of(parts.begin(), parts.end(),
                      [&](const std::string& p) { return line.find(p) != std::string::npos; })) {
        return true;
      }
    }
    return false;
  }
  std::size_t warning_count() const { return messages().size(); }
  std::string all() const {
    std::string text;
    for (const std::string& line : messages()) text += line + "\n";
    return text;
  }

 private:
  struct Sink : spdlog::sinks::base_sink<std::mutex> {
    mutable std::mutex lines_mutex;
    std::vector<std::string> lines;
    void sink_it_(const spdlog::details::log_msg& msg) override {
      if (msg.level < spdlog::level::warn) return;
      std::lock_guard<std::mutex> guard(lines_mutex);
      lines.emplace_back(msg.payload.data(), msg.payload.size());
    }
    void flush_() override {}
  };
  std::shared_ptr<Sink> sink_;
  AttachedSink attached_;
};

// Whether the logger emitted a line containing `text` (any level) while alive; the logger runs at
// debug meanwhile (its other sinks print those lines too). Construct and destroy it while no other
// thread logs.
class LogWatch {
 public:
  explicit LogWatch(std::string text)
      : sink_(std::make_shared<Sink>(std::move(text))), attached_(sink_, spdlog::level::debug) {}
  LogWatch(const LogWatch&) = delete;
  LogWatch& operator=(const LogWatch&) = delete;

  bool seen() const { return sink_->seen.load(); }

 private:
  struct Sink : spdlog::sinks::base_sink<std::mutex> {
    explicit Sink(std::string t) : text(std::move(t)) {}
    const std::string text;
    std::atomic<bool> seen{false};
    void sink_it_(const spdlog::details::log_msg& msg) override {
      if (std::string(msg.payload.data(), msg.payload.size()).find(text) != std::string::npos) {
        seen.store(true);
      }
    }
    void flush_() override {}
  };
  std::shared_ptr<Sink> sink_;
  AttachedSink attached_;
};

}  // namespace moejit::test
