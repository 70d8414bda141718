// NVML's fabric-info and addressing-mode entry points, with nvml.h's exact prototypes; the Go side
// is fabric.go. Kept apart from nvml.c so that each group of functions stays in its own files.

#ifndef NVML_NO_UNVERSIONED_FUNC_DEFS
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#endif
#include <stdint.h>
#include "nvml.h"
#include "_cgo_export.h"

#define H(x) ((uintptr_t)(x).handle)

nvmlReturn_t DECLDIR nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device, nvmlGpuFabricInfo_t *gpuFabricInfo) {
    return mockDeviceGetGpuFabricInfo(H(device), gpuFabricInfo);
}
nvmlReturn_t DECLDIR nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfoV_t *gpuFabricInfo) {
    return mockDeviceGetGpuFabricInfoV(H(device), gpuFabricInfo);
}
nvmlReturn_t DECLDIR nvmlDeviceGetGpuFabricInfo_v4(nvmlDevice_t device, nvmlGpuFabricInfo_v4_t *gpuFabricInfo) {
    return mockDeviceGetGpuFabricInfoV4(H(device), gpuFabricInfo);
}
nvmlReturn_t DECLDIR nvmlDeviceGetAddressingMode(nvmlDevice_t device, nvmlDeviceAddressingMode_t *mode) {
    return mockDeviceGetAddressingMode(H(device), mode);
}
