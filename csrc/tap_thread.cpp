// The taps' worker thread (tap_thread.h).
#include "tap_thread.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

namespace lightning_cafin {
namespace {

std::atomic<bool> g_on{false};
std::atomic<int64_t> g_jobs{0};  // run by the worker, ever (tests and diagnostics)

// One worker, started on first use (and again in a forked child, which has none); never
// destroyed, so that no thread is left to join at exit.
struct Worker {
  std::mutex mu;
  std::condition_variable work_ready, idle;
  std::deque<std::function<void()>> queue;
  bool busy = false;
  std::exception_ptr error;  // the first since the last drain
  pid_t pid = 0;

  void start_if_needed() {  // (mu held)
    if (pid == getpid()) return;
    pid = getpid();
    std::thread([this] { loop(); }).detach();
  }

  void loop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mu);
        work_ready.wait(lock, [this] { return !queue.empty(); });
        job = std::move(queue.front());
        queue.pop_front();
        busy = true;
      }
      try {
        job();
        g_jobs.fetch_add(1, std::memory_order_relaxed);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
      }
      job = nullptr;  // (its tensors let go before the drain returns)
      std::lock_guard<std::mutex> lock(mu);
      busy = false;
      if (queue.empty()) idle.notify_all();
    }
  }

  void drain() {
    std::exception_ptr failed;
    {
      std::unique_lock<std::mutex> lock(mu);
      idle.wait(lock, [this] { return queue.empty() && !busy; });
      std::swap(failed, error);
    }
    if (failed) std::rethrow_exception(failed);
  }
};

Worker& worker() {
  static Worker* w = new Worker();
  return *w;
}

}  // namespace

void set_tap_thread(bool on) { g_on.store(on, std::memory_order_relaxed); }

bool tap_thread() { return g_on.load(std::memory_order_relaxed); }

int64_t tap_thread_jobs() { return g_jobs.load(std::memory_order_relaxed); }

void run_tap_work(const at::Tensor& like, std::function<void()> work) {
  // (outside a backward pass no final callback would wait for it: run it now)
  if (!tap_thread() || torch::autograd::get_current_graph_task_id() < 0) {
    work();
    return;
  }
  std::optional<c10::cuda::CUDAStream> stream;
  if (like.defined() && like.is_cuda()) stream = c10::cuda::getCurrentCUDAStream(like.device().index());
  auto job = [stream, work = std::move(work)]() {
    const at::NoGradGuard no_grad;
    std::optional<c10::cuda::CUDAStreamGuard> on_stream;
    if (stream) on_stream.emplace(*stream);
    work();
  };
  Worker& w = worker();
  {
    std::lock_guard<std::mutex> lock(w.mu);
    w.start_if_needed();
    w.queue.push_back(std::move(job));
  }
  w.work_ready.notify_one();
  // the backward waits for it at its end (a no-op after the first of its taps' callbacks)
  torch::autograd::Engine::get_default_engine().queue_callback([] { worker().drain(); });
}

void tap_thread_drain() {
  if (PyGILState_Check()) {
    const pybind11::gil_scoped_release no_gil;  // (the worker may need it to free a tensor)
    worker().drain();
  } else {
    worker().drain();
  }
}

}  // namespace lightning_cafin
