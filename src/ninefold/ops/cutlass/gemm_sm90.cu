// bf16 y = x @ w^T for Hopper (sm_90a) through CUTLASS 3's warp-specialized TMA + wgmma kernels.
//
// Built once per configuration (build.py's CONFIGS): each object defines `nf_cutlass_run_<i>` and
// `nf_cutlass_workspace_<i>`; a generated dispatch table gathers them behind one C entry point.
// x is [m, k] row-major, w is [n, k] row-major (a torch Linear weight), y is [m, n] row-major.
// "Swapped" configurations compute y^T = w @ x^T instead, so the weight rows fill the 64-row wgmma
// dimension and the few activation rows of a decode step sit in the flexible N dimension of the tile.
// Built with CUTLASS_ENABLE_GDC_FOR_SM90 (build.py: every configuration but stream-K's), the kernels wait for
// the kernel before them (griddepcontrol.wait) before their first global load and let the next one launch
// after their last mainloop tile, so `pdl` launches may overlap a kernel's set-up with its predecessor's
// tail (programmatic dependent launch). Kernels built without it ignore `pdl`: they must not start early.
#include <cuda_runtime.h>

#include <atomic>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/kernel_hardware_info.h"

#include "nf_cutlass.h"

using namespace cute;

namespace {

using Element = cutlass::bfloat16_t;
using Cooperative = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using Pingpong = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using StreamK = cutlass::gemm::StreamKScheduler;
using Persistent = cutlass::gemm::PersistentScheduler;

template <class Schedule>
using EpilogueFor = std::conditional_t<std::is_same_v<Schedule, Cooperative>,
                                       cutlass::epilogue::TmaWarpSpecializedCooperative,
                                       cutlass::epilogue::TmaWarpSpecialized>;

template <int TileM, int TileN, int TileK, int ClusterM, class Schedule, class Scheduler, bool Swap>
struct Config {
  static constexpr bool swapped = Swap;
  static constexpr bool stream_k = std::is_same_v<Scheduler, StreamK>;
  using TileShape = Shape<Int<TileM>, Int<TileN>, Int<TileK>>;
  using ClusterShape = Shape<Int<ClusterM>, _1, _1>;
  using LayoutA = cutlass::layout::RowMajor;     // K contiguous: x, or w when swapped
  using LayoutB = cutlass::layout::ColumnMajor;  // K contiguous: w, or x when swapped
  using LayoutD = std::conditional_t<Swap, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD, 8, Element, LayoutD, 8, EpilogueFor<Schedule>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, 8, Element, LayoutB, 8, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// The configuration this object is built for: build.py passes its fields as macros.
#if !defined(NF_CONFIG) || !defined(NF_TILE_M) || !defined(NF_TILE_N) || !defined(NF_TILE_K) || \
    !defined(NF_CLUSTER_M) || !defined(NF_SCHEDULE) || !defined(NF_SCHEDULER) || !defined(NF_SWAP)
#error "build.py defines NF_CONFIG, NF_TILE_M/N/K, NF_CLUSTER_M, NF_SCHEDULE, NF_SCHEDULER and NF_SWAP"
#endif
#ifdef CUTLASS_ENABLE_GDC_FOR_SM90
constexpr bool kWaitsForPredecessor = true;
#else
constexpr bool kWaitsForPredecessor = false;
#endif
using Chosen = Config<NF_TILE_M, NF_TILE_N, NF_TILE_K, NF_CLUSTER_M, NF_SCHEDULE, NF_SCHEDULER, (NF_SWAP != 0)>;

// Makes `device` current for this library's (static) CUDA runtime, which does not follow torch's, and
// returns its SM count (0 when there is no such device).
int use_device(int device) {
  static std::atomic<int> counts[64];
  if (device < 0 || device >= 64) return 0;
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) return 0;
  if (current != device && cudaSetDevice(device) != cudaSuccess) return 0;
  int count = counts[device].load(std::memory_order_relaxed);
  if (count == 0) {
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
    counts[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

template <class Cfg>
typename Cfg::Gemm::Arguments arguments(const void* x, const void* w, void* y, int m, int n, int k,
                                           int mode, int splits, int device) {
  using Gemm = typename Cfg::Gemm;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideD = typename Gemm::GemmKernel::StrideD;
  const int rows = Cfg::swapped ? n : m;  // the GEMM's M
  const int cols = Cfg::swapped ? m : n;  // the GEMM's N
  const Element* a = static_cast<const Element*>(Cfg::swapped ? w : x);
  const Element* b = static_cast<const Element*>(Cfg::swapped ? x : w);
  StrideA stride_a{};
  get<0>(stride_a) = k;  // A: [rows, k], k contiguous
  StrideB stride_b{};
  get<0>(stride_b) = k;  // B: [cols, k] in memory, k contiguous
  StrideD stride_d{};
  if constexpr (Cfg::swapped) {
    get<1>(stride_d) = rows;  // D^T [rows, cols] column-major is y [m, n] row-major
  } else {
    get<0>(stride_d) = cols;
  }
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = device;
  hw_info.sm_count = use_device(device);
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {rows, cols, k, 1},
                                {a, stride_a, b, stride_b},
                                {{1.0f, 0.0f}, nullptr, stride_d, static_cast<Element*>(y), stride_d},
                                hw_info};
  if constexpr (Cfg::stream_k) {
    using Mode = cutlass::gemm::kernel::detail::DecompositionMode;
    args.scheduler.splits = splits > 1 ? splits : 1;
    args.scheduler.decomposition_mode = mode == NF_MODE_DATA_PARALLEL ? Mode::DataParallel
                                        : mode == NF_MODE_SPLIT_K     ? Mode::SplitK
                                        : mode == NF_MODE_STREAM_K    ? Mode::StreamK
                                                                      : Mode::Heuristic;
  }
  return args;
}

}  // namespace

#define NF_CAT2(a, b) a##b
#define NF_CAT(a, b) NF_CAT2(a, b)

extern "C" int NF_CAT(nf_cutlass_workspace_, NF_CONFIG)(int m, int n, int k, int mode, int splits, int device,
                                                        size_t* bytes) {
  if (!Chosen::stream_k && mode != NF_MODE_DATA_PARALLEL && mode != NF_MODE_HEURISTIC) return NF_ERR_MODE;
  if (use_device(device) <= 0) return NF_ERR_DEVICE;
  auto args = arguments<Chosen>(nullptr, nullptr, nullptr, m, n, k, mode, splits, device);
  *bytes = Chosen::Gemm::get_workspace_size(args);
  return NF_OK;
}

extern "C" int NF_CAT(nf_cutlass_run_, NF_CONFIG)(const void* x, const void* w, void* y, int m, int n, int k,
                                                  int mode, int splits, void* workspace, size_t workspace_bytes,
                                                  int device, void* stream, int pdl) {
  if (!Chosen::stream_k && mode != NF_MODE_DATA_PARALLEL && mode != NF_MODE_HEURISTIC) return NF_ERR_MODE;
  if (use_device(device) <= 0) return NF_ERR_DEVICE;
  auto args = arguments<Chosen>(x, w, y, m, n, k, mode, splits, device);
  typename Chosen::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return NF_ERR_SHAPE;
  if (Chosen::Gemm::get_workspace_size(args) > workspace_bytes) return NF_ERR_WORKSPACE;
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  if (gemm.initialize(args, workspace, cuda_stream) != cutlass::Status::kSuccess) return NF_ERR_INIT;
  if (gemm.run(cuda_stream, nullptr, kWaitsForPredecessor && pdl != 0) != cutlass::Status::kSuccess) return NF_ERR_LAUNCH;
  return NF_OK;
}
