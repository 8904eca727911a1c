// NCCL-allocated device memory for torch's pluggable CUDA allocator: nccl_ub=True on torch
// builds whose ProcessGroupNCCL.mem_allocator is unavailable ("NCCL mem allocator is not
// supported in this NCCL version"), as Apex ships its own (shardopt/zero/user_buffers.py).
//
// Python builds a torch.cuda.memory.CUDAPluggableAllocator from the two C functions below (found
// by name in this module's shared object), a torch.cuda.MemPool over it, and registers the pool
// with the NCCL process group (register_mem_pool). Compiled only when CUDA and nccl.h are found
// at build time (shardopt/_build.py); without it the symbols are absent and nccl_ub=True says so.
//
// ncclMemAlloc/ncclMemFree (NCCL >= 2.19) are looked up at run time in the libnccl the process
// already loaded (torch's, from the nvidia-nccl wheel), so this module does not link NCCL and
// uses the same NCCL as torch's communicators; nccl.h supplies the types and the version macros.
// shardopt_nccl_version() reports the run-time NCCL version, or 0 where ncclMemAlloc is missing:
// the only case in which nccl_ub=True is refused for NCCL's sake.

#include <dlfcn.h>
#include <nccl.h>

#include <cstddef>
#include <mutex>
#include <string>

#include <c10/util/Exception.h>

namespace {

using MemAllocFn = ncclResult_t (*)(void**, size_t);
using MemFreeFn = ncclResult_t (*)(void*);
using GetVersionFn = ncclResult_t (*)(int*);
using ErrorStringFn = const char* (*)(ncclResult_t);

struct NcclMemApi {
  MemAllocFn alloc = nullptr;
  MemFreeFn free = nullptr;
  ErrorStringFn error_string = nullptr;
  int version = 0;
};

void* find_nccl_symbol(const char* name) {
  // the process's libnccl (torch loaded it) first, then any NCCL visible to the dynamic loader
  if (void* sym = dlsym(RTLD_DEFAULT, name)) {
    return sym;
  }
  static void* handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD | RTLD_GLOBAL);
  if (handle == nullptr) {
    handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
  }
  return handle != nullptr ? dlsym(handle, name) : nullptr;
}

const NcclMemApi& api() {
  static NcclMemApi found;
  static std::once_flag once;
  std::call_once(once, [] {
    auto get_version = reinterpret_cast<GetVersionFn>(find_nccl_symbol("ncclGetVersion"));
    found.alloc = reinterpret_cast<MemAllocFn>(find_nccl_symbol("ncclMemAlloc"));
    found.free = reinterpret_cast<MemFreeFn>(find_nccl_symbol("ncclMemFree"));
    found.error_string = reinterpret_cast<ErrorStringFn>(find_nccl_symbol("ncclGetErrorString"));
    int version = 0;
    if (get_version != nullptr && get_version(&version) == ncclSuccess && found.alloc != nullptr &&
        found.free != nullptr) {
      found.version = version;
    }
  });
  return found;
}

const char* describe(const NcclMemApi& nccl, ncclResult_t result) {
  return nccl.error_string != nullptr ? nccl.error_string(result) : "unknown NCCL error";
}

}  // namespace

extern "C" {

// The run-time NCCL version code (e.g. 22703), or 0 when that NCCL has no ncclMemAlloc.
__attribute__((visibility("default"))) int shardopt_nccl_version() {
  return api().version;
}

// torch's CUDAPluggableAllocator signatures. The device is the current one (the MemPool is used
// under torch.cuda.device(...)); NCCL allocates on the current device, so it is not switched.
__attribute__((visibility("default"))) void* shardopt_nccl_mem_alloc(
    size_t size, int device, void* stream) {
  (void)device;
  (void)stream;
  const NcclMemApi& nccl = api();
  TORCH_CHECK(
      nccl.version != 0,
      "shardopt: this process's NCCL has no ncclMemAlloc (user-buffer registration needs NCCL "
      ">= 2.19); use nccl_ub=False");
  void* ptr = nullptr;
  if (size == 0) {
    return nullptr;
  }
  ncclResult_t result = nccl.alloc(&ptr, size);
  TORCH_CHECK(
      result == ncclSuccess,
      "shardopt: ncclMemAlloc of ",
      std::to_string(size),
      " bytes failed: ",
      describe(nccl, result));
  return ptr;
}

__attribute__((visibility("default"))) void shardopt_nccl_mem_free(
    void* ptr, size_t size, int device, void* stream) {
  (void)size;
  (void)device;
  (void)stream;
  if (ptr == nullptr) {
    return;
  }
  const NcclMemApi& nccl = api();
  ncclResult_t result = nccl.free(ptr);
  // called from the allocator's release path, which must not throw: report and go on
  if (result != ncclSuccess) {
    TORCH_WARN("shardopt: ncclMemFree failed: ", describe(nccl, result));
  }
}

}  // extern "C"
