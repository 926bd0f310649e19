// The C++ side of stageload's shim over libtorch: what tch does not expose.
//
// Every function returns nullptr on success or a malloc'd, NUL-terminated message on failure,
// which the caller frees with sl_free. Every C++ exception, standard or not, is caught here:
// nothing unwinds into Rust and nothing aborts the process.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/detail/MPSHooksInterface.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/core/Event.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <torch/script.h>
#include <torch/torch.h>
#include <torch/version.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/inductor/aoti_runner/model_container_runner.h>

#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <list>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

extern "C" {

void sl_free(void* p) { std::free(p); }

}  // extern "C"

namespace {

char* copy_message(const char* text) {
  size_t n = std::strlen(text);
  char* out = static_cast<char*>(std::malloc(n + 1));
  if (out != nullptr) std::memcpy(out, text, n + 1);
  return out;
}

template <typename F>
char* guarded(F&& body) {
  try {
    body();
    return nullptr;
  } catch (const c10::Error& e) {
    return copy_message(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return copy_message(e.what());
  } catch (...) {
    return copy_message("unknown C++ exception (not derived from std::exception)");
  }
}

// Device kinds as the Rust side's `DeviceKind` (repr(C)) numbers them.
enum SlDeviceKind : int { SL_CPU = 0, SL_CUDA = 1, SL_MPS = 2 };

c10::Device generator_device(SlDeviceKind kind, int index) {
  switch (kind) {
    case SL_CPU: return c10::Device(c10::kCPU);
    case SL_CUDA:
      TORCH_CHECK(at::hasCUDA(), "CUDA is not available");
      TORCH_CHECK(index >= 0 && index < static_cast<int>(at::detail::getCUDAHooks().deviceCount()),
                  "CUDA device index ", index, " out of range");
      return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
    case SL_MPS:
      TORCH_CHECK(at::hasMPS(), "MPS is not available");
      return c10::Device(c10::kMPS);
    default: break;
  }
  TORCH_CHECK(false, "unknown generator device kind ", static_cast<int>(kind));
  return c10::Device(c10::kCPU);
}

c10::StorageImpl* storage_of(const at::Tensor* t) {
  TORCH_CHECK(t != nullptr && t->defined(), "undefined tensor");
  TORCH_CHECK(t->has_storage(), "tensor has no storage (sparse or opaque layout)");
  return t->storage().unsafeGetStorageImpl();
}

// Building without random initialisation. While a thread has this dispatch key in its included
// set, every operator call it makes passes through skip_init_fallback first: random fills
// (uniform_, normal_, ...) return their tensor untouched and random factories (randn, rand)
// return uninitialised memory, so nothing is drawn and no time is spent drawing; every other
// operator runs as usual with the key excluded. The key is one libtorch reserves for testing
// dispatch modes and registers nothing for. In the second mode (every fill) deterministic fills
// (zero_, fill_) and factories (zeros, ones, full) are skipped too, so building a model touches
// none of its memory: for models whose every tensor a checkpoint fills before use.
constexpr c10::DispatchKey kSkipInitKey = c10::DispatchKey::TESTING_ONLY_GenericMode;
constexpr int kSkipRandom = 1;
constexpr int kSkipEveryFill = 2;
thread_local int skip_mode = 0;

bool is_random_fill(const std::string& name) {
  static const std::unordered_set<std::string> fills = {
      "aten::uniform_", "aten::normal_", "aten::bernoulli_", "aten::exponential_",
      "aten::random_", "aten::cauchy_", "aten::log_normal_", "aten::geometric_"};
  return fills.count(name) > 0;
}

bool is_random_factory(const std::string& name) {
  static const std::unordered_set<std::string> factories = {"aten::randn", "aten::rand"};
  return factories.count(name) > 0;
}

bool is_skipped_fill(const std::string& name) {
  static const std::unordered_set<std::string> fills = {"aten::zero_", "aten::fill_"};
  return is_random_fill(name) || (skip_mode >= kSkipEveryFill && fills.count(name) > 0);
}

bool is_skipped_factory(const std::string& name) {
  static const std::unordered_set<std::string> factories = {"aten::zeros", "aten::ones", "aten::full"};
  return is_random_factory(name) || (skip_mode >= kSkipEveryFill && factories.count(name) > 0);
}

void skip_init_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const std::string& name = schema.name();
  const size_t n = schema.arguments().size();
  const size_t base = stack->size() - n;
  if (n >= 1 && is_skipped_fill(name) && (*stack)[base].isTensor()) {
    at::Tensor self = (*stack)[base].toTensor();
    torch::jit::drop(*stack, n);
    torch::jit::push(*stack, std::move(self));
    return;
  }
  auto size = schema.argumentIndexWithName("size");
  if (is_skipped_factory(name) && size && (*stack)[base + *size].isIntList()) {
    auto arg = [&](const char* key) -> const c10::IValue* {
      auto i = schema.argumentIndexWithName(key);
      return i && !(*stack)[base + *i].isNone() ? &(*stack)[base + *i] : nullptr;
    };
    c10::TensorOptions options;
    if (auto v = arg("dtype")) options = options.dtype(v->toScalarType());
    if (auto v = arg("layout")) options = options.layout(v->toLayout());
    if (auto v = arg("device")) options = options.device(v->toDevice());
    if (auto v = arg("pin_memory")) options = options.pinned_memory(v->toBool());
    std::vector<int64_t> sizes = (*stack)[base + *size].toIntVector();
    at::Tensor out;
    {
      c10::impl::ExcludeDispatchKeyGuard outside(kSkipInitKey);
      out = at::empty(sizes, options);
    }
    torch::jit::drop(*stack, n);
    torch::jit::push(*stack, std::move(out));
    return;
  }
  c10::impl::ExcludeDispatchKeyGuard outside(kSkipInitKey);
  op.callBoxed(stack);
}

// The host block cache: libtorch's CPU allocator hands every block back to `free` (and, with the
// mmap threshold stageload sets, blocks of 1 MiB and more back to the OS) the moment a tensor
// dies, so a forward that allocates the same activations at every step faults every page of them
// in again: a diffusion step spent a third of its CPU time in the kernel doing that. This
// allocator keeps freed blocks of `min_block` bytes or more (sizes rounded up to whole pages) and
// gives one back to the next request of the same size. What it holds stays bounded: a request it
// cannot serve first frees the oldest kept blocks until live plus kept fits under the most the
// live blocks alone reached since the last flush (`high_`) plus two of the largest block asked for
// since then (`largest_`). (With no room above the mark, a step that alternates two sizes in the
// same memory, as attention and MLP blocks do, missed at every layer.) Smaller blocks go straight
// to libtorch's own `alloc_cpu`/`free_cpu`.
//
// Its own blocks it allocates itself (`alloc_block`): those of 2 MiB or more, while
// `huge_pages` is set, start at a 2 MiB boundary and are advised as huge-page candidates
// (`MADV_HUGEPAGE`), as libtorch's `alloc_cpu` does with C10_THP_MEM_ALLOC_ENABLE=1 set before
// the process starts. Where the kernel gives huge pages to advised memory, a block's first touch
// then takes one page fault per 2 MiB instead of 512: a load into fresh memory, which every
// staged load is, spends most of its time in those faults.
class HostBlockCache final : public c10::Allocator {
 public:
  HostBlockCache(size_t min_block, size_t huge_block) : min_block_(min_block), huge_block_(huge_block) {}

  c10::DataPtr allocate(size_t n) override {
    // Beyond a quarter of the address space nothing can be allocated, and the bound's sum stays
    // clear of wrapping.
    if (n < min_block_ || n > SIZE_MAX / 4) {
      void* p = c10::alloc_cpu(n);
      return {p, p, &c10::free_cpu, c10::Device(c10::kCPU)};
    }
    size_t size = (n + kPage - 1) / kPage * kPage;
    std::vector<Block> victims;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto hit = by_size_.find(size);
      if (hit != by_size_.end()) {
        void* p = hit->second->data;
        order_.erase(hit->second);
        by_size_.erase(hit);
        kept_ -= size;
        live_bytes_ += size;
        high_ = std::max(high_, live_bytes_);
        live_.emplace(p, size);
        ++hits_;
        return {p, p, &release, c10::Device(c10::kCPU)};
      }
      ++misses_;
      // Booked before the allocation, so that concurrent requests see it; the marks move only
      // once it succeeded.
      live_bytes_ += size;
      size_t bound = std::max(high_, live_bytes_) + 2 * std::max(largest_, size);
      while (kept_ + live_bytes_ > bound && !order_.empty()) victims.push_back(take_oldest());
    }
    for (const Block& b : victims) std::free(b.data);
    void* p = nullptr;
    try {
      p = alloc_block(size);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      live_bytes_ -= size;
      throw;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    live_.emplace(p, size);
    high_ = std::max(high_, live_bytes_);
    largest_ = std::max(largest_, size);
    return {p, p, &release, c10::Device(c10::kCPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Frees every kept block and starts the high-water mark over from what is live; returns the
  // bytes freed.
  size_t flush() {
    std::vector<Block> all;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (!order_.empty()) all.push_back(take_oldest());
      high_ = live_bytes_;
      largest_ = 0;
    }
    size_t bytes = 0;
    for (const Block& b : all) {
      bytes += b.size;
      std::free(b.data);
    }
    return bytes;
  }

  void stats(size_t* out) {
    std::lock_guard<std::mutex> lock(mutex_);
    out[0] = kept_;
    out[1] = live_bytes_;
    out[2] = high_;
    out[3] = largest_;
    out[4] = hits_;
    out[5] = misses_;
  }

  static std::atomic<HostBlockCache*> instance;
  // Whether blocks allocated from now on may get huge pages (see the class's comment).
  static std::atomic<bool> huge_pages;

 private:
  static constexpr size_t kPage = 4096;

  // A block of `size` bytes (whole pages), freed with `std::free`.
  void* alloc_block(size_t size) const {
    bool huge = size >= huge_block_ && huge_pages.load();
    void* p = nullptr;
    int err = posix_memalign(&p, huge ? huge_block_ : c10::gAlignment, size);
    // Worded as libtorch's own allocator words it, which stageload reads as an out-of-memory.
    TORCH_CHECK(err == 0 && p != nullptr, "host block cache: can't allocate memory: you tried to allocate ",
                size, " bytes. Error code ", err, " (", std::strerror(err), ")");
#ifdef MADV_HUGEPAGE
    // Advice only: where the kernel gives no huge pages (THP off) the block has small ones.
    if (huge) madvise(p, size, MADV_HUGEPAGE);
#endif
    return p;
  }
  struct Block {
    void* data;
    size_t size;
  };

  // A block's deleter (and the raw deleter): a block this cache handed out is kept, anything
  // else (a small block freed through `raw_deleter`) goes back to `free_cpu`.
  static void release(void* p) { instance.load()->keep(p); }

  void keep(void* p) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = live_.find(p);
      if (it != live_.end()) {
        size_t size = it->second;
        live_.erase(it);
        live_bytes_ -= size;
        order_.push_back(Block{p, size});
        by_size_.emplace(size, std::prev(order_.end()));
        kept_ += size;
        return;
      }
    }
    c10::free_cpu(p);
  }

  // Caller holds the lock and has checked that something is kept.
  Block take_oldest() {
    Block b = order_.front();
    auto range = by_size_.equal_range(b.size);
    for (auto it = range.first; it != range.second; ++it) {
      if (it->second == order_.begin()) {
        by_size_.erase(it);
        break;
      }
    }
    order_.pop_front();
    kept_ -= b.size;
    return b;
  }

  const size_t min_block_;
  const size_t huge_block_;  // the huge page size: from it blocks may get huge pages
  std::mutex mutex_;
  std::list<Block> order_;  // kept blocks, oldest first
  std::unordered_multimap<size_t, std::list<Block>::iterator> by_size_;
  std::unordered_map<void*, size_t> live_;  // blocks handed out, by address
  size_t kept_ = 0;
  size_t live_bytes_ = 0;  // bytes of the blocks in live_
  size_t high_ = 0;        // the most live_bytes_ reached since the last flush
  size_t largest_ = 0;     // the largest block asked for since the last flush
  size_t hits_ = 0;
  size_t misses_ = 0;
};

std::atomic<HostBlockCache*> HostBlockCache::instance{nullptr};
std::atomic<bool> HostBlockCache::huge_pages{true};
std::once_flag host_block_cache_once;

}  // namespace

TORCH_LIBRARY_IMPL(_, TESTING_ONLY_GenericMode, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&skip_init_fallback>());
}

// The release message: libtorch 2.13 lets a storage carry the message every access then throws,
// and clear it again. Older libtorch (the GPU machine's 2.11) cannot clear it, so there a released
// storage gets no message of ours: any access throws libtorch's own "data is not allocated".
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
#define SL_RELEASE_MESSAGE 1
#else
#define SL_RELEASE_MESSAGE 0
#endif

void set_release_message(c10::StorageImpl* s, const char* message) {
#if SL_RELEASE_MESSAGE
  s->release_data_and_set_meta_custom_data_ptr_error_msg_(
      std::string(message ? message : "this tensor's storage was released by stageload"));
#else
  (void)s;
  (void)message;
#endif
}

void clear_release_message(c10::StorageImpl* s) {
#if SL_RELEASE_MESSAGE
  s->clear_data_ptr_access_error_msg_();
#else
  (void)s;
#endif
}

extern "C" {

// The buffers of a TorchScript module and its submodules, each handed to `add` with its dotted
// name as a fresh tensor sharing the buffer's storage (tch lists only the parameters).
// `module` is tch's CModule pointer, a `torch::jit::script::Module*` (tch's torch_api.h).
char* sl_module_named_buffers(void* module, void* data, void (*add)(void*, const char*, at::Tensor*)) {
  return guarded([&] {
    TORCH_CHECK(module != nullptr && add != nullptr, "no module");
    auto* m = static_cast<torch::jit::script::Module*>(module);
    for (const auto& buffer : m->named_buffers(/*recurse=*/true)) {
      add(data, buffer.name.c_str(), new at::Tensor(buffer.value));
    }
  });
}

char* sl_skip_init(int mode, int* previous) {
  return guarded([&] {
    TORCH_CHECK(mode >= 0 && mode <= kSkipEveryFill, "unknown skip-init mode ", mode);
    *previous = c10::impl::tls_is_dispatch_key_included(kSkipInitKey) ? skip_mode : 0;
    skip_mode = mode;
    c10::impl::tls_set_dispatch_key_included(kSkipInitKey, mode > 0);
  });
}

// Streams through the device-generic guard interface (no CUDA headers needed): a stream from
// the device's pool made current for this thread, and a wait on this thread's current stream.
char* sl_cuda_use_side_stream(int index, int64_t* previous_id) {
  return guarded([&] {
    generator_device(SL_CUDA, index);
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
    c10::Stream side = impl.getStreamFromGlobalPool(device, false);
    *previous_id = impl.exchangeStream(side).id();
  });
}

char* sl_cuda_set_stream(int index, int64_t id) {
  return guarded([&] {
    generator_device(SL_CUDA, index);
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    impl.exchangeStream(c10::Stream::unpack3(id, static_cast<c10::DeviceIndex>(index), c10::DeviceType::CUDA));
  });
}

// A CUDA event recorded on this thread's current stream of device `index`; the caller owns it
// and frees it with sl_event_free.
char* sl_cuda_event_record(int index, void** out) {
  return guarded([&] {
    generator_device(SL_CUDA, index);
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    auto event = std::make_unique<c10::Event>(c10::DeviceType::CUDA);
    event->record(impl.getStream(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index))));
    *out = event.release();
  });
}

char* sl_event_synchronize(void* event) {
  return guarded([&] {
    TORCH_CHECK(event != nullptr, "no event");
    static_cast<c10::Event*>(event)->synchronize();
  });
}

void sl_event_free(void* event) { delete static_cast<c10::Event*>(event); }

char* sl_copy_async(const at::Tensor* dst, const at::Tensor* src) {
  return guarded([&] {
    TORCH_CHECK(dst != nullptr && src != nullptr && dst->defined() && src->defined(), "undefined tensor");
    // A copy of weights, not a step of a computation: a leaf that requires grad (a VarStore's
    // parameter) is a legal target.
    at::NoGradGuard no_grad;
    dst->copy_(*src, /*non_blocking=*/true);
  });
}

// A page-locked copy of a host tensor, for whatever accelerator the process has (the device
// argument of pin_memory is deprecated, and warned about on every call, since torch 2.3).
char* sl_pin_memory(const at::Tensor* t, at::Tensor** out) {
  return guarded([&] {
    TORCH_CHECK(t != nullptr && t->defined() && out != nullptr, "undefined tensor");
    *out = new at::Tensor(t->pin_memory());
  });
}

// Host memory of exactly `bytes` rounded up to whole pages: an anonymous mapping of its own (not
// libtorch's caching host allocator, which rounds every block up to a power of two), page-locked
// for CUDA with `pin` by cudaHostRegister, looked up in the CUDA runtime the process has loaded
// (libtorch_cuda's); an error, with the mapping undone, where there is none or it refuses. The
// tensor (uint8, [bytes]) unregisters and unmaps the memory when its storage goes. `*mapped` is
// the size of the mapping.
char* sl_host_buffer(int64_t bytes, int pin, at::Tensor** out, int64_t* mapped) {
  return guarded([&] {
    TORCH_CHECK(bytes > 0 && out != nullptr && mapped != nullptr, "host buffer of ", bytes, " bytes");
    const int64_t page = sysconf(_SC_PAGESIZE);
    TORCH_CHECK(page > 0 && bytes <= INT64_MAX - page, "host buffer of ", bytes, " bytes: too large");
    const size_t size = static_cast<size_t>((bytes + page - 1) / page * page);
    void* memory = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(memory != MAP_FAILED, "mapping ", size, " bytes of host memory: ", std::strerror(errno));
    using Register = int (*)(void*, size_t, unsigned int);
    using Unregister = int (*)(void*);
    using ErrorString = const char* (*)(int);
    Unregister unregister = nullptr;
    if (pin != 0) {
      auto do_register = reinterpret_cast<Register>(dlsym(RTLD_DEFAULT, "cudaHostRegister"));
      unregister = reinterpret_cast<Unregister>(dlsym(RTLD_DEFAULT, "cudaHostUnregister"));
      if (do_register == nullptr || unregister == nullptr) {
        munmap(memory, size);
        TORCH_CHECK(false, "no CUDA runtime in this process to page-lock host memory with");
      }
      const int code = do_register(memory, size, 0);  // cudaHostRegisterDefault
      if (code != 0) {
        auto describe = reinterpret_cast<ErrorString>(dlsym(RTLD_DEFAULT, "cudaGetErrorString"));
        munmap(memory, size);
        TORCH_CHECK(false, "cudaHostRegister of ", size, " bytes failed: ",
                    describe != nullptr ? describe(code) : "CUDA error", " (", code, ")");
      }
    }
    auto release = [size, unregister](void* p) {
      if (unregister != nullptr) unregister(p);
      munmap(p, size);
    };
    try {
      *out = new at::Tensor(at::from_blob(memory, {bytes}, release, at::TensorOptions().dtype(at::kByte)));
    } catch (...) {
      release(memory);
      throw;
    }
    *mapped = static_cast<int64_t>(size);
  });
}

char* sl_empty_pinned_cache() {
  return guarded([&] {
    TORCH_CHECK(at::hasCUDA() || at::hasMPS(), "no accelerator, so no pinned host memory to give back");
    auto accelerator = at::getAccelerator(false);
    TORCH_CHECK(accelerator.has_value(), "no accelerator, so no pinned host memory to give back");
    auto* allocator = at::getHostAllocator(*accelerator);
    TORCH_CHECK(allocator != nullptr, "no pinned host memory allocator for ", *accelerator);
    allocator->empty_cache();
  });
}

char* sl_cuda_sync_current_stream(int index) {
  return guarded([&] {
    generator_device(SL_CUDA, index);
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    impl.getStream(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index))).synchronize();
  });
}

char* sl_generator_get_state(SlDeviceKind kind, int index, uint8_t** out, size_t* len) {
  return guarded([&] {
    auto gen = at::globalContext().defaultGenerator(generator_device(kind, index));
    std::lock_guard<std::mutex> lock(gen.mutex());
    at::Tensor state = gen.get_state();
    TORCH_CHECK(state.scalar_type() == at::kByte, "generator state is not a byte tensor");
    state = state.contiguous();
    size_t n = static_cast<size_t>(state.numel());
    uint8_t* buf = static_cast<uint8_t*>(std::malloc(n == 0 ? 1 : n));
    TORCH_CHECK(buf != nullptr, "out of memory copying a generator state of ", n, " bytes");
    std::memcpy(buf, state.data_ptr<uint8_t>(), n);
    *out = buf;
    *len = n;
  });
}

char* sl_generator_set_state(SlDeviceKind kind, int index, const uint8_t* data, size_t len) {
  return guarded([&] {
    auto gen = at::globalContext().defaultGenerator(generator_device(kind, index));
    at::Tensor state = at::empty({static_cast<int64_t>(len)}, at::TensorOptions().dtype(at::kByte));
    if (len > 0) std::memcpy(state.data_ptr<uint8_t>(), data, len);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  });
}

char* sl_cuda_device_count(int64_t* out) {
  return guarded([&] {
    *out = at::hasCUDA() ? static_cast<int64_t>(at::detail::getCUDAHooks().deviceCount()) : 0;
  });
}

char* sl_mps_available(bool* out) {
  return guarded([&] { *out = at::hasMPS(); });
}

char* sl_host_cache_install(size_t min_block, size_t huge_block, bool* installed_now) {
  return guarded([&] {
    *installed_now = false;
    std::call_once(host_block_cache_once, [&] {
      // Never freed: storages keep a pointer to their allocator for as long as they live.
      auto* cache = new HostBlockCache(min_block, huge_block);
      HostBlockCache::instance.store(cache);
      c10::SetCPUAllocator(cache, /*priority=*/1);
      *installed_now = true;
    });
  });
}

void sl_host_cache_huge_pages(bool on) { HostBlockCache::huge_pages.store(on); }

char* sl_host_cache_flush(size_t* freed) {
  return guarded([&] {
    HostBlockCache* cache = HostBlockCache::instance.load();
    *freed = cache == nullptr ? 0 : cache->flush();
  });
}

// `out` has room for six counters: kept, live, high, largest, hits, misses (zeros when the cache
// is not installed).
char* sl_host_cache_stats(bool* installed, size_t* out) {
  return guarded([&] {
    HostBlockCache* cache = HostBlockCache::instance.load();
    *installed = cache != nullptr;
    std::fill(out, out + 6, 0);
    if (cache != nullptr) cache->stats(out);
  });
}

char* sl_storage_info(const at::Tensor* t, uint64_t* id, size_t* nbytes, bool* allocated) {
  return guarded([&] {
    c10::StorageImpl* s = storage_of(t);
    *id = reinterpret_cast<uint64_t>(s);
    *nbytes = s->nbytes();
    // The unchecked accessor: a freed storage throws on every checked access by design.
    *allocated = s->_mutable_data_ptr_no_checks().get() != nullptr;
  });
}

char* sl_storage_free(const at::Tensor* t, const char* message, size_t* freed) {
  return guarded([&] {
    c10::StorageImpl* s = storage_of(t);
    size_t n = s->nbytes();
    c10::Device device = s->device();
    // The old DataPtr is destroyed here, which hands the memory back to its allocator.
    s->set_data_ptr_noswap(c10::DataPtr(nullptr, device));
    s->set_nbytes(0);
    // From now on every access to the data (kernels included) throws this message instead of
    // dereferencing a null pointer.
    set_release_message(s, message);
    *freed = n;
  });
}

char* sl_storage_realloc(const at::Tensor* t, size_t nbytes) {
  return guarded([&] {
    c10::StorageImpl* s = storage_of(t);
    TORCH_CHECK(s->_mutable_data_ptr_no_checks().get() == nullptr && s->nbytes() == 0,
                "storage is still allocated (", s->nbytes(), " bytes); free it before reallocating");
    c10::Allocator* allocator = s->allocator();
    if (allocator == nullptr) allocator = c10::GetAllocator(s->device().type());
    TORCH_CHECK(allocator != nullptr, "no allocator for device ", s->device());
    // A device's caching allocator allocates on the thread's current device: make that the
    // storage's (a refill on a background thread, or a model on cuda:1 while cuda:0 is current).
    c10::OptionalDeviceGuard on_its_device;
    if (s->device().type() != c10::DeviceType::CPU) on_its_device.reset_device(s->device());
    s->set_data_ptr_noswap(allocator->allocate(nbytes));
    s->set_nbytes(nbytes);
    clear_release_message(s);
  });
}

// Memory a storage borrows (a streamed block's slot): the storage never frees it.
void borrowed_memory_deleter(void*) {}

char* sl_storage_attach(const at::Tensor* t, void* data, size_t nbytes) {
  return guarded([&] {
    c10::StorageImpl* s = storage_of(t);
    TORCH_CHECK(s->_mutable_data_ptr_no_checks().get() == nullptr && s->nbytes() == 0,
                "storage is still allocated (", s->nbytes(), " bytes); free it before attaching memory");
    TORCH_CHECK(s->device().type() == c10::kCPU, "only CPU storages borrow memory, not ", s->device());
    TORCH_CHECK(data != nullptr || nbytes == 0, "no memory to attach");
    s->set_data_ptr_noswap(c10::DataPtr(data, data, &borrowed_memory_deleter, s->device()));
    s->set_nbytes(nbytes);
    clear_release_message(s);
  });
}

// Memory a storage owns through its caller (a view of a checkpoint's file mapping): the storage
// hands `context` to `release` when it lets go of the memory (freed, or destroyed).
char* sl_storage_attach_owned(const at::Tensor* t, void* data, size_t nbytes, void* context,
                              void (*release)(void*)) {
  return guarded([&] {
    c10::StorageImpl* s = storage_of(t);
    TORCH_CHECK(s->_mutable_data_ptr_no_checks().get() == nullptr && s->nbytes() == 0,
                "storage is still allocated (", s->nbytes(), " bytes); free it before attaching memory");
    TORCH_CHECK(s->device().type() == c10::kCPU, "only CPU storages own attached memory, not ", s->device());
    TORCH_CHECK(data != nullptr && release != nullptr, "no memory to attach");
    s->set_data_ptr_noswap(c10::DataPtr(data, context, release, s->device()));
    s->set_nbytes(nbytes);
    clear_release_message(s);
  });
}

char* sl_cuda_empty_cache() {
  return guarded([&] {
    TORCH_CHECK(at::hasCUDA(), "CUDA is not available");
    c10::getDeviceAllocator(c10::kCUDA)->emptyCache();
  });
}

char* sl_mps_empty_cache() {
  return guarded([&] {
    TORCH_CHECK(at::hasMPS(), "MPS is not available");
    at::detail::getMPSHooks().emptyCache();
  });
}

char* sl_cuda_memory(int index, int64_t* allocated, int64_t* reserved, int64_t* peak_allocated,
                     int64_t* peak_reserved) {
  return guarded([&] {
    generator_device(SL_CUDA, index);  // validates availability and the index
    auto stats = c10::getDeviceAllocator(c10::kCUDA)->getDeviceStats(static_cast<c10::DeviceIndex>(index));
    constexpr size_t all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    *allocated = stats.allocated_bytes[all].current;
    *reserved = stats.reserved_bytes[all].current;
    *peak_allocated = stats.allocated_bytes[all].peak;
    *peak_reserved = stats.reserved_bytes[all].peak;
  });
}

char* sl_cuda_reset_peak(int index) {
  return guarded([&] {
    generator_device(SL_CUDA, index);
    c10::getDeviceAllocator(c10::kCUDA)->resetPeakStats(static_cast<c10::DeviceIndex>(index));
  });
}

}  // extern "C"

// AOTInductor packages (.pt2): torch::inductor::AOTIModelPackageLoader behind an opaque handle.
// Weights are the caller's tensors, registered user-managed (the runner keeps their data
// pointers, no copy); the caller frees and refills them in place and registers them again.
extern "C" {

// The metadata a package records, read from the archive without loading its library (so that
// a package built for another CPU is refused before any of its code runs).
char* sl_aoti_package_metadata(const char* path, void* data, void (*add)(void*, const char*, const char*)) {
  return guarded([&] {
    TORCH_CHECK(path != nullptr && add != nullptr, "no package path");
    auto metadata = torch::inductor::AOTIModelPackageLoader::load_metadata_from_package(path, "model");
    for (const auto& [key, value] : metadata) add(data, key.c_str(), value.c_str());
  });
}

char* sl_aoti_load(const char* path, int device_index, void** out) {
  return guarded([&] {
    TORCH_CHECK(path != nullptr && out != nullptr, "no package path");
    *out = new torch::inductor::AOTIModelPackageLoader(path, "model", false, 1,
                                                       static_cast<c10::DeviceIndex>(device_index));
  });
}

void sl_aoti_drop(void* loader) { delete static_cast<torch::inductor::AOTIModelPackageLoader*>(loader); }

// Every constant the package's runner expects: its FQN (the checkpoint's name) and dtype (a
// c10::ScalarType number).
char* sl_aoti_constants(void* loader, void* data, void (*add)(void*, const char*, int32_t)) {
  return guarded([&] {
    TORCH_CHECK(loader != nullptr && add != nullptr, "no package");
    auto* runner = static_cast<torch::inductor::AOTIModelPackageLoader*>(loader)->get_runner();
    TORCH_CHECK(runner != nullptr, "the package has no runner");
    auto dtypes = runner->getConstantNamesToDtypes();
    for (const auto& [name, fqn] : runner->getConstantNamesToOriginalFQNs()) {
      auto dtype = dtypes.find(name);
      TORCH_CHECK(dtype != dtypes.end(), "constant ", name, " has no dtype");
      add(data, fqn.c_str(), dtype->second);
    }
  });
}

// Registers `count` tensors under their FQNs as the runner's constants, user-managed (the
// runner reads their memory in place), every constant checked as given.
char* sl_aoti_register(void* loader, const char* const* fqns, const at::Tensor* const* tensors, size_t count) {
  return guarded([&] {
    TORCH_CHECK(loader != nullptr && (count == 0 || (fqns != nullptr && tensors != nullptr)), "no package");
    std::unordered_map<std::string, at::Tensor> map;
    for (size_t i = 0; i < count; ++i) {
      TORCH_CHECK(tensors[i] != nullptr && tensors[i]->defined(), "undefined tensor for constant ", fqns[i]);
      map.emplace(fqns[i], *tensors[i]);
    }
    static_cast<torch::inductor::AOTIModelPackageLoader*>(loader)->load_constants(map, false, true, true);
  });
}

// Runs the package on `count` inputs; each output is handed to `add` as a new at::Tensor.
char* sl_aoti_run(void* loader, const at::Tensor* const* inputs, size_t count, void* data,
                  void (*add)(void*, at::Tensor*)) {
  return guarded([&] {
    TORCH_CHECK(loader != nullptr && add != nullptr && (count == 0 || inputs != nullptr), "no package");
    std::vector<at::Tensor> in;
    in.reserve(count);
    for (size_t i = 0; i < count; ++i) {
      TORCH_CHECK(inputs[i] != nullptr && inputs[i]->defined(), "input ", i, " is undefined");
      in.push_back(*inputs[i]);
    }
    auto out = static_cast<torch::inductor::AOTIModelPackageLoader*>(loader)->run(in);
    for (auto& t : out) add(data, new at::Tensor(std::move(t)));
  });
}

}  // extern "C"

// ---- Issue 73: streams ordered by events (no host wait), registration errors cleared ----
extern "C" {

// Whether the work before `event` is done (cudaEventQuery): a query, never a wait.
char* sl_event_query(void* event, bool* done) {
  return guarded([&] {
    TORCH_CHECK(event != nullptr && done != nullptr, "no event");
    *done = static_cast<c10::Event*>(event)->query();
  });
}

// Makes this thread's current stream of CUDA device `index` wait for `event` before the work
// queued on it next (cudaStreamWaitEvent): the stream waits, the host does not.
char* sl_event_block(void* event, int index) {
  return guarded([&] {
    TORCH_CHECK(event != nullptr, "no event");
    generator_device(SL_CUDA, index);
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    static_cast<c10::Event*>(event)->block(impl.getStream(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index))));
  });
}

// Clears this thread's last CUDA runtime error (cudaGetLastError), which a failed
// cudaHostRegister leaves set for the check after the next kernel launch to throw; `*code` is the
// error cleared (0: none), -1 where the process has no CUDA runtime loaded.
char* sl_cuda_clear_last_error(int* code) {
  return guarded([&] {
    TORCH_CHECK(code != nullptr, "no out-pointer");
    using GetLastError = int (*)();
    auto get = reinterpret_cast<GetLastError>(dlsym(RTLD_DEFAULT, "cudaGetLastError"));
    *code = get != nullptr ? get() : -1;
  });
}

}  // extern "C"
