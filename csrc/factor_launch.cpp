// The kept factor update (factor_launch.h).  Compiled by the host compiler: the kernel is
// capture_stats.cu's launch_factor_update.
#include "factor_launch.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>

#include <limits>
#include <string>

#include "capture_tap.h"
#include "checks.h"
#include "record_op.h"

namespace lightning_cafin {
namespace {

const char* kKept = "FactorLaunch: ";

// Pooled flag slots per launch at most (a report unread keeps its slot; the health counters
// read one report per capture step, so two are in use at a time in the usual loop).
constexpr size_t kMaxSlots = 4;

void check_cuda_call(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, kKept, what, " failed: ", cudaGetErrorString(err));
}

// Whether the work before `event` is done (an error other than "not ready" raised); the
// "not ready" a query leaves behind is cleared, as torch's CUDAEvent::query does.
bool completed(cudaEvent_t event) {
  const cudaError_t err = cudaEventQuery(event);
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  check_cuda_call(err, "cudaEventQuery");
  return true;
}

}  // namespace

FactorItem factor_item(const char* op, int64_t i, const at::Tensor& H, const at::Tensor& S, int64_t kind,
                       int64_t flags, double h_div, double s_div, double s_scale, double extra) {
  TORCH_CHECK(kind == 0 || kind == 1, op, "kinds[", num(i), "] must be 0 or 1, got ", num(kind));
  TORCH_CHECK(flags >= 0 && flags < 8, op, "flags[", num(i), "] = ", num(flags), " is not a flag set");
  TORCH_CHECK(h_div > 0 && s_div > 0, op, "h_div and s_div must be positive (layer ", num(i), ")");
  FactorItem it{};
  it.H = H.data_ptr<float>();
  it.S = S.data_ptr<float>();
  it.ns = static_cast<int32_t>(S.numel());
  it.kind = static_cast<int32_t>(kind);
  it.flags = static_cast<int32_t>(flags);
  // as torch divides a float32 tensor by a Python scalar: times float(1) / float(divisor)
  it.inv_hn = 1.0f / static_cast<float>(h_div);
  it.inv_sn = 1.0f / static_cast<float>(s_div);
  it.inv_sscale = 1.0f / static_cast<float>(s_scale);
  it.extra = static_cast<float>(extra);
  return it;
}

int64_t factor_layer_count(const char* op, std::initializer_list<size_t> sizes) {
  const int64_t L = static_cast<int64_t>(*sizes.begin());
  for (size_t n : sizes)
    TORCH_CHECK(static_cast<int64_t>(n) == L, op, "every list must have one entry per layer (", num(L),
                "), got one with ", num(static_cast<int64_t>(n)));
  TORCH_CHECK(L > 0, op, "no layers");
  TORCH_CHECK(L <= std::numeric_limits<int32_t>::max(), op, "too many layers");
  return L;
}

void check_factor_vector(const at::Tensor& t, const char* op, const Entry& name, const c10::Device& device,
                         const char* first) {
  check_cuda_on(t, op, name, device, first);
  check_dtype(t, at::kFloat, op, name);
  check_contiguous_1d(t, op, name);
  TORCH_CHECK(t.numel() >= 1 && t.numel() <= std::numeric_limits<int32_t>::max(), op, name_of(name), " has ",
              num(t.numel()), " elements");
}

FlagSlot::FlagSlot(int64_t n, int device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* host_ptr = nullptr;
  // mapped: the kernel writes the flags here itself, no copy to the host after it
  check_cuda_call(cudaHostAlloc(&host_ptr, static_cast<size_t>(n) * sizeof(int32_t),
                                cudaHostAllocMapped | cudaHostAllocPortable),
                  "cudaHostAlloc of the NaN flags");
  host = static_cast<int32_t*>(host_ptr);
  void* dev = nullptr;
  cudaError_t err = cudaHostGetDevicePointer(&dev, host_ptr, 0);
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (err != cudaSuccess) {
    cudaFreeHost(host_ptr);
    check_cuda_call(err, "mapping the NaN flags to the device");
  }
  device_ptr = static_cast<int32_t*>(dev);
}

FlagSlot::~FlagSlot() {
  // The last launch writing here must be done before the memory goes (a report dropped
  // unread, its optimizer deleted right after a capture step).  Errors ignored: at
  // interpreter exit the CUDA runtime may already be gone.
  if (event != nullptr) {
    cudaEventSynchronize(event);
    cudaEventDestroy(event);
  }
  if (host != nullptr) cudaFreeHost(host);
  (void)cudaGetLastError();
}

std::vector<int32_t> HostFlags::values() {
  std::lock_guard<std::mutex> lock(mu_);
  if (slot_ != nullptr) {
    cudaError_t err;
    {
      const pybind11::gil_scoped_release no_gil;
      err = cudaEventSynchronize(slot_->event);
    }
    check_cuda_call(err, "waiting for the factor update");
    values_.assign(slot_->host, slot_->host + n_);
    slot_.reset();  // (back to the launch's pool)
  }
  return values_;
}

bool HostFlags::ready() {
  std::lock_guard<std::mutex> lock(mu_);
  return slot_ == nullptr || completed(slot_->event);
}

FactorLaunch::FactorLaunch(std::vector<at::Tensor> H, std::vector<at::Tensor> S, const std::vector<int64_t>& kinds,
                           const std::vector<int64_t>& flags, const std::vector<double>& h_div,
                           const std::vector<double>& s_div, const std::vector<double>& s_scale,
                           const std::vector<double>& extra)
    : H_(std::move(H)), S_(std::move(S)), device_(c10::kCPU) {
  const int64_t L = factor_layer_count(kKept, {H_.size(), S_.size(), kinds.size(), flags.size(), h_div.size(),
                                               s_div.size(), s_scale.size(), extra.size()});
  check_cuda(H_[0], kKept, "H[0]");
  device_ = H_[0].device();
  items_.resize(static_cast<size_t>(L));
  append_.resize(static_cast<size_t>(L));
  two_cols_.resize(static_cast<size_t>(L));
  for (int64_t i = 0; i < L; ++i) {
    check_factor_vector(H_[i], kKept, Entry{"H", i}, device_, "H[0]");
    check_factor_vector(S_[i], kKept, Entry{"S", i}, device_, "H[0]");
    // (the sums' pointers and length: filled by run)
    items_[i] = factor_item(kKept, i, H_[i], S_[i], kinds[i], flags[i], h_div[i], s_div[i], s_scale[i], extra[i]);
    two_cols_[i] = kinds[i] == 1 ? 1 : 0;
    append_[i] = (flags[i] & kFactorAppend) != 0 ? 1 : 0;
    TORCH_CHECK(kinds[i] == 0 || H_[i].numel() == 2, kKept, "H[", num(i), "] of a two-column layer has ",
                num(H_[i].numel()), " elements, expected 2");
    TORCH_CHECK(kinds[i] == 1 || H_[i].numel() > append_[i], kKept, "H[", num(i), "] has ", num(H_[i].numel()),
                " elements, too few for its flags");
  }
}

std::shared_ptr<FlagSlot> FactorLaunch::free_slot() {
  for (const auto& slot : slots_) {
    // no report holds it (use_count: the pool's own), and its last launch is done
    if (slot.use_count() == 1 && completed(slot->event)) return slot;
  }
  auto slot = std::make_shared<FlagSlot>(size(), device_.index());
  if (slots_.size() < kMaxSlots) slots_.push_back(slot);
  return slot;
}

std::shared_ptr<HostFlags> FactorLaunch::run(const TakenSums& taken, double c_old, double c_new) {
  LIGHTNING_CAFIN_RECORD_OP("FactorLaunch.run");
  const int64_t L = size();
  TORCH_CHECK(static_cast<int64_t>(taken.h.size()) == L && static_cast<int64_t>(taken.s.size()) == L, kKept,
              "the taken sums have ", num(static_cast<int64_t>(taken.h.size())), " layers, the launch ", num(L));
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor &h = taken.h[i], &s = taken.s[i];
    const int64_t want_h = two_cols_[i] ? h.numel() : H_[i].numel() - append_[i];
    TORCH_CHECK(h.defined() && s.defined() && h.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat &&
                    h.dim() == 1 && s.dim() == 1 && h.is_contiguous() && s.is_contiguous() &&
                    h.device() == device_ && s.device() == device_ && h.numel() == want_h &&
                    s.numel() == S_[i].numel() && h.numel() >= 1 && h.numel() <= std::numeric_limits<int32_t>::max(),
                kKept, "layer ", num(i), "'s sums do not fit its factors (h: ", num(h.numel()), " elements, s: ",
                num(s.numel()), "; float32, contiguous, 1-D, on ", device_.str(), " expected)");
    FactorItem& it = items_[i];
    it.h = h.data_ptr<float>();
    it.s = s.data_ptr<float>();
    it.nh = static_cast<int32_t>(h.numel());
  }
  const c10::cuda::CUDAGuard guard(device_);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device_.index()).stream();
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  check_cuda_call(cudaStreamIsCapturing(stream, &capturing), "cudaStreamIsCapturing");
  TORCH_CHECK(capturing == cudaStreamCaptureStatusNone, kKept,
              "the current stream is being captured into a CUDA graph; the factor update's NaN flags are read on "
              "the host, so a capture step cannot be part of a graph (capture steps outside it)");
  std::shared_ptr<FlagSlot> slot = free_slot();
  check_launch(launch_factor_update(items_.data(), static_cast<int>(L), static_cast<float>(c_old),
                                    static_cast<float>(c_new), slot->device_ptr, stream),
               kKept);
  check_cuda_call(cudaEventRecord(slot->event, stream), "recording the factor update's event");
  return std::make_shared<HostFlags>(std::move(slot), L);
}

}  // namespace lightning_cafin
