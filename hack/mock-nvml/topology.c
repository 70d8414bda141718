// NVML's NVLink entry points, with nvml.h's exact prototypes; the Go side is topology.go.

#ifndef NVML_NO_UNVERSIONED_FUNC_DEFS
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#endif
#include <stdint.h>
#include "nvml.h"
#include "_cgo_export.h"

#define H(x) ((uintptr_t)(x).handle)

nvmlReturn_t DECLDIR nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive) {
    return mockDeviceGetNvLinkState(H(device), link, isActive);
}
nvmlReturn_t DECLDIR nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci) {
    return mockDeviceGetNvLinkRemotePciInfo(H(device), link, pci);
}
nvmlReturn_t DECLDIR nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                         nvmlIntNvLinkDeviceType_t *pNvLinkDeviceType) {
    return mockDeviceGetNvLinkRemoteDeviceType(H(device), link, pNvLinkDeviceType);
}
