#include "common/fork.hpp"

#include <pthread.h>

#include <atomic>
#include <unordered_set>
#include <vector>

namespace moejit::detail {
namespace {

// A registered mutex of either kind.
struct Held {
  void* mutex;
  void (*lock)(void*);
  void (*unlock)(void*);
};

template <class Mutex>
Held held(Mutex* mutex) {
  return {mutex, [](void* m) { static_cast<Mutex*>(m)->lock(); },
          [](void* m) { static_cast<Mutex*>(m)->unlock(); }};
}

// Why a process-wide registry: the pthread_atfork handlers are registered once and can't be
// removed. Each list has a mutex of its own, taken just before the list's mutexes, so that a
// thread registering a mutex of one list may hold any mutex of an earlier list (the logger is
// made, and its sink registered, under whatever lock its first line is written).
struct ForkGuard {
  std::mutex held_mutex;  // guards `held`
  std::vector<Held> held;
  std::mutex alive_mutex;  // guards `alive`
  std::unordered_set<std::mutex*> alive;
  std::mutex last_mutex;  // guards `last`
  std::vector<Held> last;
};

ForkGuard& fork_guard() {
  // Why never destroyed: a fork may happen while static destructors run.
  static ForkGuard* guard = new ForkGuard;
  return *guard;
}

void fork_prepare() {
  ForkGuard& g = fork_guard();
  g.held_mutex.lock();
  for (const Held& h : g.held) h.lock(h.mutex);
  g.alive_mutex.lock();
  for (std::mutex* m : g.alive) m->lock();
  g.last_mutex.lock();
  for (const Held& h : g.last) h.lock(h.mutex);
}

void fork_release() {  // in the parent and in the child: the thread that forked holds them
  ForkGuard& g = fork_guard();
  for (auto h = g.last.rbegin(); h != g.last.rend(); ++h) h->unlock(h->mutex);
  g.last_mutex.unlock();
  for (std::mutex* m : g.alive) m->unlock();
  g.alive_mutex.unlock();
  for (auto h = g.held.rbegin(); h != g.held.rend(); ++h) h->unlock(h->mutex);
  g.held_mutex.unlock();
}

std::atomic<uint64_t> generation{0};  // fork_generation()

void fork_child() {
  generation.fetch_add(1, std::memory_order_relaxed);
  fork_release();
}

ForkGuard& installed_guard() {
  static std::once_flag once;
  std::call_once(once, [] { ::pthread_atfork(fork_prepare, fork_release, fork_child); });
  return fork_guard();
}

// Appends `mutex` to one of the guard's lists under that list's mutex.
template <class Mutex>
void add(std::mutex ForkGuard::*guard, std::vector<Held> ForkGuard::*list, Mutex* mutex) {
  ForkGuard& g = installed_guard();
  std::lock_guard<std::mutex> lock(g.*guard);
  (g.*list).push_back(held(mutex));
}

}  // namespace

void hold_across_fork(std::mutex* mutex) { add(&ForkGuard::held_mutex, &ForkGuard::held, mutex); }
void hold_across_fork(std::shared_mutex* mutex) {
  add(&ForkGuard::held_mutex, &ForkGuard::held, mutex);
}

void hold_while_alive(std::mutex* mutex) {
  ForkGuard& g = installed_guard();
  std::lock_guard<std::mutex> lock(g.alive_mutex);
  g.alive.insert(mutex);
}

void release_while_alive(std::mutex* mutex) {
  ForkGuard& g = fork_guard();
  std::lock_guard<std::mutex> lock(g.alive_mutex);
  g.alive.erase(mutex);
}

void hold_across_fork_last(std::mutex* mutex) {
  add(&ForkGuard::last_mutex, &ForkGuard::last, mutex);
}
void hold_across_fork_last(std::shared_mutex* mutex) {
  add(&ForkGuard::last_mutex, &ForkGuard::last, mutex);
}

uint64_t fork_generation() {
  // Why install the handlers here: a fork before they are installed would not be counted.
  installed_guard();
  return generation.load(std::memory_order_relaxed);
}

}  // namespace moejit::detail
