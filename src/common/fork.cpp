#include "common/fork.hpp"

#include <pthread.h>

#include <unordered_set>
#include <vector>

namespace moejit::detail {
namespace {

// Why a process-wide registry: the pthread_atfork handlers are registered once and can't be
// removed.
struct ForkGuard {
  struct Held {
    void* mutex;
    void (*lock)(void*);
    void (*unlock)(void*);
  };
  std::mutex held_mutex;  // guards `held` and `last`; taken first
  std::vector<Held> held;
  std::mutex alive_mutex;  // guards `alive`; taken after `held`, before any of `alive`
  std::unordered_set<std::mutex*> alive;
  std::vector<std::mutex*> last;
};

ForkGuard& fork_guard() {
  // Why never destroyed: a fork may happen while static destructors run.
  static ForkGuard* guard = new ForkGuard;
  return *guard;
}

void fork_prepare() {
  ForkGuard& g = fork_guard();
  g.held_mutex.lock();
  for (const ForkGuard::Held& h : g.held) h.lock(h.mutex);
  g.alive_mutex.lock();
  for (std::mutex* m : g.alive) m->lock();
  for (std::mutex* m : g.last) m->lock();
}

void fork_release() {  // in the parent and in the child: the thread that forked holds them
  ForkGuard& g = fork_guard();
  for (auto m = g.last.rbegin(); m != g.last.rend(); ++m) (*m)->unlock();
  for (std::mutex* m : g.alive) m->unlock();
  g.alive_mutex.unlock();
  for (auto h = g.held.rbegin(); h != g.held.rend(); ++h) h->unlock(h->mutex);
  g.held_mutex.unlock();
}

ForkGuard& installed_guard() {
  static std::once_flag once;
  std::call_once(once, [] { ::pthread_atfork(fork_prepare, fork_release, fork_release); });
  return fork_guard();
}

template <class Mutex>
void hold(Mutex* mutex) {
  ForkGuard& g = installed_guard();
  std::lock_guard<std::mutex> lock(g.held_mutex);
  g.held.push_back({mutex, [](void* m) { static_cast<Mutex*>(m)->lock(); },
                    [](void* m) { static_cast<Mutex*>(m)->unlock(); }});
}

}  // namespace

void hold_across_fork(std::mutex* mutex) { hold(mutex); }
void hold_across_fork(std::shared_mutex* mutex) { hold(mutex); }

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
  ForkGuard& g = installed_guard();
  std::lock_guard<std::mutex> lock(g.held_mutex);
  g.last.push_back(mutex);
}

}  // namespace moejit::detail
