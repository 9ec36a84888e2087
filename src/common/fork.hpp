// Mutexes a fork() must hold: a child that copied a mutex while another thread of its parent held
// it would wait on it forever (a prefork server, Python multiprocessing). The fork handlers take
// every registered mutex before the fork and release them after it, in the parent and in the
// child, in this order: the long-lived ones (hold_across_fork) in the order they were registered,
// then the stores' (hold_while_alive, in any order: none is held while another is taken), then
// the leaves (hold_across_fork_last), which are held while no other mutex is taken. The price: a
// fork waits for whichever thread holds one (a log line written to a full pipe delays it).
#pragma once

#include <cstdint>
#include <mutex>
#include <shared_mutex>

namespace moejit::detail {

// For a mutex that lives as long as the process (there is no unregistering) and is never held
// while one registered later (or a store's) is taken the other way round.
void hold_across_fork(std::mutex* mutex);
void hold_across_fork(std::shared_mutex* mutex);

// For an object's mutex, from its constructor to its destructor; no other registered mutex is
// taken while it is held, except leaves.
void hold_while_alive(std::mutex* mutex);
void release_while_alive(std::mutex* mutex);

// For a mutex that lives as long as the process and under which no other registered mutex is
// ever taken (a leaf: the logger's console sinks, the tables that only look up or insert). It
// may be registered while any other registered mutex is held.
void hold_across_fork_last(std::mutex* mutex);
void hold_across_fork_last(std::shared_mutex* mutex);

// This process's fork generation: a counter that a fork increments in the child only. A value
// recorded in memory that a fork later copied is therefore equal to it in the process that
// recorded it and smaller in every process forked from that one. Why not the pid: a pid is reused
// once its process has exited, so a descendant (a grandchild, after the parent exited) can hold
// a copy of a record made under its own pid.
uint64_t fork_generation();

}  // namespace moejit::detail
