// The C interface of ninefold's CUTLASS GEMMs (gemm_sm90.cu, dispatch.cu); ctypes reads it in binding.py.
#pragma once
#include <stddef.h>

#define NF_OK 0
#define NF_ERR_CONFIG 1     // no configuration of that index
#define NF_ERR_MODE 2       // the configuration has no such decomposition (stream-K scheduler only)
#define NF_ERR_SHAPE 3      // CUTLASS cannot run this shape (alignment, sizes)
#define NF_ERR_WORKSPACE 4  // the workspace given is smaller than the configuration needs
#define NF_ERR_INIT 5       // initialising the kernel's parameters failed
#define NF_ERR_LAUNCH 6     // the launch failed
#define NF_ERR_DEVICE 7     // no CUDA device of that index (its SM count could not be read)

#define NF_MODE_HEURISTIC 0      // CUTLASS's stream-K scheduler chooses
#define NF_MODE_DATA_PARALLEL 1  // one program per output tile
#define NF_MODE_SPLIT_K 2        // `splits` programs per output tile, each over a slice of K
#define NF_MODE_STREAM_K 3       // K iterations of all tiles divided evenly among the SMs
