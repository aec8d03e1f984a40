"""The names a trace gives GPU runtime calls and kernels, for CUDA and for ROCm/HIP alike: the calls
that wait for the device, that launch work (kernels, copies, CUDA/HIP graphs), that order streams on
events, and the kernels that are communication. Every rule and query that picks rows by these names
takes them from here, so a trace recorded on an AMD GPU (hipLaunchKernel, hipGraphLaunch,
hipMemcpyAsync, ...) gets the same findings as one recorded on an NVIDIA GPU."""
from __future__ import annotations

import re

# Calls that return only once the device is done with the work they wait for.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpy2D", "cudaMemcpy3D", "cudaMemcpyFromSymbol", "cudaMemcpyToSymbol",
              "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2",
              "cuMemcpyDtoH", "hipStreamSynchronize", "hipDeviceSynchronize", "hipEventSynchronize",
              "hipMemcpy", "hipMemcpy2D", "hipMemcpy3D", "hipMemcpyFromSymbol", "hipMemcpyToSymbol",
              "hipMemcpyDtoH", "hipMemcpyWithStream", "hipCtxSynchronize")
# Asynchronous copies that still block the host: to pageable memory, the call returns only once the
# copy is done, after all the work queued before it (`.cpu()`, `.to("cpu")`, `.numpy()`).
ASYNC_COPY_CALLS = ("cudaMemcpyAsync", "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync", "hipMemcpyAsync",
                    "hipMemcpyDtoHAsync")
# Launches of a whole captured graph: one host call for every kernel in it.
GRAPH_LAUNCH = re.compile(r"^(cudaGraphLaunch|cuGraphLaunch|hipGraphLaunch)")
# Calls that make a stream wait, on the device, for an event recorded on another stream.
EVENT_WAIT_CALLS = ("cudaStreamWaitEvent", "cuStreamWaitEvent", "hipStreamWaitEvent")
# The explicit whole-device and stream syncs (a sync a program writes, as torch.cuda.synchronize()).
DEVICE_SYNCS = ("cudaDeviceSynchronize", "hipDeviceSynchronize", "cuCtxSynchronize", "hipCtxSynchronize")
STREAM_SYNCS = ("cudaStreamSynchronize", "hipStreamSynchronize", "cuStreamSynchronize")
EVENT_SYNCS = ("cudaEventSynchronize", "hipEventSynchronize", "cuEventSynchronize")
# Device memory allocations (cudaMalloc, cudaMallocAsync, cuMemAlloc_v2, hipMalloc, hipMallocAsync
# ...), never the page-locked host allocations pin_memory=True makes (cudaHostAlloc, cudaMallocHost,
# cuMemHostAlloc, cuMemAllocHost, hipHostMalloc, hipMallocHost).
DEVICE_ALLOC = re.compile(r"^(cudaMalloc(?!Host)|cuMemAlloc(?!Host)|hipMalloc(?!Host))")
# Kernels that move data between devices: NCCL's (`ncclKernel_AllReduce_RING_LL_Sum_float`, NCCL >=
# 2.19's `ncclDevKernel_AllGather_RING_LL`) and RCCL's, ROCm's NCCL. The one predicate for it:
# gaps, launch-bound, the efficiency model's kernel groups and exposed-comm all take it from here.
COMM_KERNEL = re.compile(r"nccl|rccl", re.IGNORECASE)


def is_comm_kernel(name: str) -> bool:
    """True for a kernel that is communication (a collective or send/recv), not compute."""
    return bool(COMM_KERNEL.search(name))
