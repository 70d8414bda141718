// The compute mode (nvidia-smi -c) and the processes on a GPU, with the exact prototypes of NVIDIA's
// nvml.h; see compute.go.

#ifndef NVML_NO_UNVERSIONED_FUNC_DEFS
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#endif
#include <stdint.h>
#include "nvml.h"
#include "_cgo_export.h"

nvmlReturn_t DECLDIR nvmlDeviceGetComputeMode(nvmlDevice_t device, nvmlComputeMode_t *mode) {
    return mockDeviceGetComputeMode((uintptr_t)device.handle, (unsigned int *)(void *)mode);
}
nvmlReturn_t DECLDIR nvmlDeviceSetComputeMode(nvmlDevice_t device, nvmlComputeMode_t mode) {
    return mockDeviceSetComputeMode((uintptr_t)device.handle, (unsigned int)mode);
}

// The processes on a GPU: Go says which one runs (pid 0: none), C fills NVML's array with the
// two-call protocol (a NULL or short array gets INSUFFICIENT_SIZE and the count needed).
static nvmlReturn_t runningProcesses(const char *function, nvmlDevice_t device, int compute,
                                     unsigned int *infoCount, nvmlProcessInfo_t *infos) {
    unsigned int pid = 0;
    nvmlReturn_t ret;
    if (infoCount == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    ret = mockDeviceRunningProcess((char *)function, (uintptr_t)device.handle, compute, &pid);
    if (ret != NVML_SUCCESS) {
        return ret;
    }
    unsigned int needed = pid != 0 ? 1 : 0;
    if (*infoCount < needed) {
        *infoCount = needed;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    *infoCount = needed;
    if (needed != 0) {
        if (infos == NULL) {
            return NVML_ERROR_INVALID_ARGUMENT;
        }
        infos[0].pid = pid;
        infos[0].usedGpuMemory = 1ULL << 30;
        infos[0].gpuInstanceId = 0xFFFFFFFF;
        infos[0].computeInstanceId = 0xFFFFFFFF;
    }
    return NVML_SUCCESS;
}
nvmlReturn_t DECLDIR nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                              nvmlProcessInfo_t *infos) {
    return runningProcesses("nvmlDeviceGetComputeRunningProcesses_v3", device, 1, infoCount, infos);
}
nvmlReturn_t DECLDIR nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                               nvmlProcessInfo_t *infos) {
    return runningProcesses("nvmlDeviceGetGraphicsRunningProcesses_v3", device, 0, infoCount, infos);
}
