// The compute mode (nvidia-smi -c), with the exact prototypes of NVIDIA's nvml.h; see compute.go.

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
