// Norm taps' statistics at the end of their backward (deferred_norms.h).
#include "deferred_norms.h"

#include "capture_ops.h"
#include "stream_buffers.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace lightning_cafin {
namespace {

namespace ag = torch::autograd;

// One deferred call: its plan, the means its norm saved, and its bias gradient's memory
// (same_memory: held without a reference to the gradient tensor itself).  `stream`: the
// CUDA stream its backward ran on.
struct DeferredNorm {
  std::shared_ptr<const TapPlan> plan;
  at::Tensor means, bias_grad;
  cudaStream_t stream;
};

// A backward's deferred calls, owned by its final callback (a backward that never reaches
// its end drops them with its callbacks).
struct Backward {
  std::mutex mu;
  std::vector<DeferredNorm> norms;
};

std::atomic<bool>& defer_on() {
  static std::atomic<bool> on{true};
  return on;
}

// Each running backward's deferred calls by graph-task id, held weakly (its callback
// owns them); expired entries are dropped as new backwards arrive.
struct OpenBackwards {
  std::mutex mu;
  std::unordered_map<int, std::weak_ptr<Backward>> by_task;
};
OpenBackwards& open_backwards() {
  static auto* o = new OpenBackwards();  // (never freed: a callback may run at exit)
  return *o;
}

// Whether this node's bias gradient reaches the bias's AccumulateGrad unchanged and is
// then only read until the end of the backward (deferred_norms.h).
bool sole_accumulator(ag::Node& node) {
  if (node.num_outputs() < 3) return false;
  const ag::Edge& edge = node.next_edge(2);
  if (!edge.is_valid() || edge.function.use_count() != 1) return false;
  auto* acc = dynamic_cast<ag::AccumulateGrad*>(edge.function.get());
  if (acc == nullptr || !acc->variable.defined()) return false;
  return acc->pre_hooks().empty() && acc->tensor_pre_hooks().empty() && acc->post_hooks().empty() &&
         acc->retains_grad_hooks().empty() && ag::impl::post_acc_grad_hooks(acc->variable) == nullptr;
}

// A tensor on t's memory, with its sizes and strides, but a TensorImpl of its own: it keeps
// the memory alive without adding to t's use count, which AccumulateGrad reads to decide
// whether it may make t the .grad itself or must copy it.
at::Tensor same_memory(const at::Tensor& t) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set(), t.dtype());
  impl->set_storage_offset(t.storage_offset());
  impl->set_sizes_and_strides(t.sizes(), t.strides());
  return at::Tensor(std::move(impl));
}

// The end of a backward: each deferred call's (h, s) from its means and bias gradient,
// one launch per device, added to the sinks in the order the calls were deferred.
void finish(Backward& b) {
  std::vector<DeferredNorm> norms;
  {
    const std::lock_guard<std::mutex> lock(b.mu);
    norms.swap(b.norms);
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> results(norms.size());
  std::map<c10::DeviceIndex, std::vector<size_t>> on_kernels;  // device -> its calls
  for (size_t k = 0; k < norms.size(); ++k) {
    const DeferredNorm& d = norms[k];
    if (norm_stats_on_kernels(d.means, d.bias_grad)) {
      on_kernels[d.means.device().index()].push_back(k);
    } else {
      auto [h, s] = norm_stats(d.means, d.bias_grad, d.plan->mean_scale);
      results[k] = {std::move(h), std::move(s)};
    }
  }
  for (const auto& [device, calls] : on_kernels) {
    std::vector<NormInput> inputs;
    inputs.reserve(calls.size());
    for (size_t k : calls) inputs.push_back({norms[k].means, norms[k].bias_grad, norms[k].plan->mean_scale});
    auto hs = norm_stats_batch(inputs);
    const c10::cuda::CUDAStream here = c10::cuda::getCurrentCUDAStream(device);
    for (size_t i = 0; i < calls.size(); ++i) {
      const size_t k = calls[i];
      results[k] = std::move(hs[i]);
      if (norms[k].stream != here.stream()) {
        // read on this stream, made on the backward's: their memory is not reused there
        // before this stream is past the read (as the allocator does for any tensor)
        c10::cuda::CUDACachingAllocator::recordStream(norms[k].means.storage().data_ptr(), here);
        c10::cuda::CUDACachingAllocator::recordStream(norms[k].bias_grad.storage().data_ptr(), here);
      }
    }
  }
  for (size_t k = 0; k < norms.size(); ++k) {
    const TapPlan& p = *norms[k].plan;
    p.sink->add({std::move(results[k].first), p.hn, std::move(results[k].second), p.sn});
  }
}

// The deferred calls of the backward `task`, its final callback queued at the first.
std::shared_ptr<Backward> backward_of_current_task(int task) {
  OpenBackwards& o = open_backwards();
  const std::lock_guard<std::mutex> lock(o.mu);
  auto it = o.by_task.find(task);
  if (it != o.by_task.end()) {
    if (auto b = it->second.lock()) return b;
  }
  for (auto e = o.by_task.begin(); e != o.by_task.end();) {  // (backwards that ended or failed)
    e = e->second.expired() ? o.by_task.erase(e) : std::next(e);
  }
  auto b = std::make_shared<Backward>();
  o.by_task[task] = b;
  ag::Engine::get_default_engine().queue_callback([b] { finish(*b); });
  return b;
}

}  // namespace

bool set_defer_norms(bool on) { return defer_on().exchange(on); }

bool defer_norm(const std::shared_ptr<const TapPlan>& plan, ag::Node& node, at::Tensor& means,
                const at::Tensor& bias_grad) {
  if (!defer_on().load(std::memory_order_relaxed) || !means.defined() || !bias_grad.defined() ||
      at::GradMode::is_enabled()) {
    return false;
  }
  const auto* exec_info = ag::get_current_graph_task_exec_info();
  const int task = ag::get_current_graph_task_id();
  if (exec_info == nullptr || !exec_info->empty() || task < 0) return false;
  // (a plain strided tensor with memory of its own: not a wrapper subclass such as DTensor)
  if (bias_grad.layout() != at::kStrided || bias_grad.dim() != 1 || !bias_grad.has_storage() ||
      bias_grad.key_set().has(c10::DispatchKey::Python) || means.device() != bias_grad.device() ||
      !sole_accumulator(node)) {
    return false;
  }
  cudaStream_t stream = nullptr;
  if (bias_grad.is_cuda()) {
    stream = c10::cuda::getCurrentCUDAStream(bias_grad.device().index()).stream();
    if (stream_capturing(stream)) return false;
  }
  const std::shared_ptr<Backward> b = backward_of_current_task(task);
  {
    const std::lock_guard<std::mutex> lock(b->mu);
    b->norms.push_back({plan, std::move(means), same_memory(bias_grad), stream});
  }
  plan->deferred_norm_taps.fetch_add(1, std::memory_order_relaxed);
  return true;
}

}  // namespace lightning_cafin
