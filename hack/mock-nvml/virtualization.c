// NVML's virtualization-mode entry point, with nvml.h's exact prototype; the Go side is
// virtualization.go.

#ifndef NVML_NO_UNVERSIONED_FUNC_DEFS
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#endif
#include <stdint.h>
#include "nvml.h"
#include "_cgo_export.h"

nvmlReturn_t DECLDIR nvmlDeviceGetVirtualizationMode(nvmlDevice_t device, nvmlGpuVirtualizationMode_t *mode) {
    return mockDeviceGetVirtualizationMode((uintptr_t)device.handle, mode);
}
