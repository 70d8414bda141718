// NVML's C entry points, with the exact prototypes of NVIDIA's nvml.h (the compiler checks each
// definition against the header's declaration). Each forwards to the Go implementation in ops.go.
// Legacy unversioned symbols (nvmlInit, nvmlDeviceGetCount, ...) are exported too, as the real
// library does for old callers.

#ifndef NVML_NO_UNVERSIONED_FUNC_DEFS
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#endif
#include <stdint.h>
#include <string.h>
#include "nvml.h"
#include "_cgo_export.h"

// go-nvml's copy of nvml.h wraps each handle in a struct holding the one pointer, which the
// x86-64 and arm64 ABIs pass and store exactly like the pointer of NVIDIA's own header.
#define H(x) ((uintptr_t)(x).handle)
#define OUT(p) ((uintptr_t *)(void *)(p))

nvmlReturn_t DECLDIR nvmlInit_v2(void) { return mockInit(); }
nvmlReturn_t DECLDIR nvmlInit(void) { return mockInit(); }
nvmlReturn_t DECLDIR nvmlInitWithFlags(unsigned int flags) { (void)flags; return mockInit(); }
nvmlReturn_t DECLDIR nvmlShutdown(void) { return mockShutdown(); }

const DECLDIR char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires reset";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Version mismatch";
    default: return "Unknown Error";
    }
}

nvmlReturn_t DECLDIR nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    return mockSystemGetDriverVersion(version, length);
}
nvmlReturn_t DECLDIR nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    return mockSystemGetNVMLVersion(version, length);
}
nvmlReturn_t DECLDIR nvmlSystemGetCudaDriverVersion(int *v) {
    return mockSystemGetCudaDriverVersion("nvmlSystemGetCudaDriverVersion", v);
}
nvmlReturn_t DECLDIR nvmlSystemGetCudaDriverVersion_v2(int *v) {
    return mockSystemGetCudaDriverVersion("nvmlSystemGetCudaDriverVersion_v2", v);
}

nvmlReturn_t DECLDIR nvmlDeviceGetCount_v2(unsigned int *n) { return mockDeviceGetCount("nvmlDeviceGetCount_v2", n); }
nvmlReturn_t DECLDIR nvmlDeviceGetCount(unsigned int *n) { return mockDeviceGetCount("nvmlDeviceGetCount", n); }
nvmlReturn_t DECLDIR nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    return mockDeviceGetHandleByIndex("nvmlDeviceGetHandleByIndex_v2", index, OUT(device));
}
nvmlReturn_t DECLDIR nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return mockDeviceGetHandleByIndex("nvmlDeviceGetHandleByIndex", index, OUT(device));
}
nvmlReturn_t DECLDIR nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    return mockDeviceGetHandleByUUID((char *)uuid, OUT(device));
}
nvmlReturn_t DECLDIR nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    return mockDeviceGetUUID(H(device), uuid, length);
}
nvmlReturn_t DECLDIR nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    return mockDeviceGetName(H(device), name, length);
}
nvmlReturn_t DECLDIR nvmlDeviceGetBrand(nvmlDevice_t device, nvmlBrandType_t *type) {
    return mockDeviceGetBrand(H(device), type);
}
nvmlReturn_t DECLDIR nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    return mockDeviceGetIndex(H(device), index);
}
nvmlReturn_t DECLDIR nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber) {
    return mockDeviceGetMinorNumber(H(device), minorNumber);
}
nvmlReturn_t DECLDIR nvmlDeviceGetArchitecture(nvmlDevice_t device, nvmlDeviceArchitecture_t *arch) {
    return mockDeviceGetArchitecture(H(device), arch);
}
nvmlReturn_t DECLDIR nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    return mockDeviceGetCudaComputeCapability(H(device), major, minor);
}
nvmlReturn_t DECLDIR nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    return mockDeviceGetMemoryInfo(H(device), memory);
}
nvmlReturn_t DECLDIR nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    return mockDeviceGetMemoryInfoV2(H(device), memory);
}
nvmlReturn_t DECLDIR nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return mockDeviceGetPciInfo("nvmlDeviceGetPciInfo_v3", H(device), pci);
}
nvmlReturn_t DECLDIR nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return mockDeviceGetPciInfo("nvmlDeviceGetPciInfo_v2", H(device), pci);
}
nvmlReturn_t DECLDIR nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return mockDeviceGetPciInfo("nvmlDeviceGetPciInfo", H(device), pci);
}
nvmlReturn_t DECLDIR nvmlDeviceGetNumGpuCores(nvmlDevice_t device, unsigned int *numCores) {
    return mockDeviceGetNumGpuCores(H(device), numCores);
}

nvmlReturn_t DECLDIR nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode) {
    return mockDeviceGetMigMode(H(device), currentMode, pendingMode);
}
nvmlReturn_t DECLDIR nvmlDeviceSetMigMode(nvmlDevice_t device, unsigned int mode, nvmlReturn_t *activationStatus) {
    return mockDeviceSetMigMode(H(device), mode, activationStatus);
}

nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile,
                                                          nvmlGpuInstanceProfileInfo_v2_t *info) {
    return mockDeviceGetGpuInstanceProfileInfo("nvmlDeviceGetGpuInstanceProfileInfoV", H(device), profile, info, 1);
}
nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                         nvmlGpuInstanceProfileInfo_t *info) {
    nvmlGpuInstanceProfileInfo_v2_t v2;
    memset(&v2, 0, sizeof v2);
    if (info == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = mockDeviceGetGpuInstanceProfileInfo("nvmlDeviceGetGpuInstanceProfileInfo", H(device), profile, &v2, 0);
    if (r == NVML_SUCCESS) {
        info->id = v2.id; info->isP2pSupported = v2.isP2pSupported; info->sliceCount = v2.sliceCount;
        info->instanceCount = v2.instanceCount; info->multiprocessorCount = v2.multiprocessorCount;
        info->copyEngineCount = v2.copyEngineCount; info->decoderCount = v2.decoderCount;
        info->encoderCount = v2.encoderCount; info->jpegCount = v2.jpegCount; info->ofaCount = v2.ofaCount;
        info->memorySizeMB = v2.memorySizeMB;
    }
    return r;
}
nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t device, unsigned int profileId,
                                                                   nvmlGpuInstancePlacement_t *placements,
                                                                   unsigned int *count) {
    return mockDeviceGetGpuInstancePossiblePlacements(H(device), profileId, placements, count);
}
nvmlReturn_t DECLDIR nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t device, unsigned int profileId,
                                                              const nvmlGpuInstancePlacement_t *placement,
                                                              nvmlGpuInstance_t *gpuInstance) {
    return mockDeviceCreateGpuInstanceWithPlacement(H(device), profileId, (nvmlGpuInstancePlacement_t *)placement,
                                                    OUT(gpuInstance));
}
nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstances(nvmlDevice_t device, unsigned int profileId,
                                               nvmlGpuInstance_t *gpuInstances, unsigned int *count) {
    return mockDeviceGetGpuInstances(H(device), profileId, OUT(gpuInstances), count);
}
nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id, nvmlGpuInstance_t *gpuInstance) {
    return mockDeviceGetGpuInstanceById(H(device), id, OUT(gpuInstance));
}
nvmlReturn_t DECLDIR nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info) {
    return mockGpuInstanceGetInfo(H(gpuInstance), info);
}
nvmlReturn_t DECLDIR nvmlGpuInstanceDestroy(nvmlGpuInstance_t gpuInstance) {
    return mockGpuInstanceDestroy(H(gpuInstance));
}

nvmlReturn_t DECLDIR nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                                   unsigned int engProfile,
                                                                   nvmlComputeInstanceProfileInfo_v2_t *info) {
    return mockGpuInstanceGetComputeInstanceProfileInfo("nvmlGpuInstanceGetComputeInstanceProfileInfoV",
                                                        H(gpuInstance), profile, engProfile, info, 1);
}
nvmlReturn_t DECLDIR nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                                  unsigned int engProfile,
                                                                  nvmlComputeInstanceProfileInfo_t *info) {
    nvmlComputeInstanceProfileInfo_v2_t v2;
    memset(&v2, 0, sizeof v2);
    if (info == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = mockGpuInstanceGetComputeInstanceProfileInfo("nvmlGpuInstanceGetComputeInstanceProfileInfo",
                                                                  H(gpuInstance), profile, engProfile, &v2, 0);
    if (r == NVML_SUCCESS) {
        info->id = v2.id; info->sliceCount = v2.sliceCount; info->instanceCount = v2.instanceCount;
        info->multiprocessorCount = v2.multiprocessorCount; info->sharedCopyEngineCount = v2.sharedCopyEngineCount;
        info->sharedDecoderCount = v2.sharedDecoderCount; info->sharedEncoderCount = v2.sharedEncoderCount;
        info->sharedJpegCount = v2.sharedJpegCount; info->sharedOfaCount = v2.sharedOfaCount;
    }
    return r;
}
nvmlReturn_t DECLDIR nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                          nvmlComputeInstance_t *computeInstance) {
    return mockGpuInstanceCreateComputeInstance(H(gpuInstance), profileId, OUT(computeInstance));
}
nvmlReturn_t DECLDIR nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                        nvmlComputeInstance_t *computeInstances, unsigned int *count) {
    return mockGpuInstanceGetComputeInstances(H(gpuInstance), profileId, OUT(computeInstances), count);
}
nvmlReturn_t DECLDIR nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t gpuInstance, unsigned int id,
                                                           nvmlComputeInstance_t *computeInstance) {
    return mockGpuInstanceGetComputeInstanceById(H(gpuInstance), id, OUT(computeInstance));
}
nvmlReturn_t DECLDIR nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance, nvmlComputeInstanceInfo_t *info) {
    return mockComputeInstanceGetInfo("nvmlComputeInstanceGetInfo_v2", H(computeInstance), info);
}
nvmlReturn_t DECLDIR nvmlComputeInstanceGetInfo(nvmlComputeInstance_t computeInstance, nvmlComputeInstanceInfo_t *info) {
    return mockComputeInstanceGetInfo("nvmlComputeInstanceGetInfo", H(computeInstance), info);
}
nvmlReturn_t DECLDIR nvmlComputeInstanceDestroy(nvmlComputeInstance_t computeInstance) {
    return mockComputeInstanceDestroy(H(computeInstance));
}

nvmlReturn_t DECLDIR nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    return mockDeviceGetMaxMigDeviceCount(H(device), count);
}
nvmlReturn_t DECLDIR nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *migDevice) {
    return mockDeviceGetMigDeviceHandleByIndex(H(device), index, OUT(migDevice));
}
nvmlReturn_t DECLDIR nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    return mockDeviceIsMigDeviceHandle(H(device), isMigDevice);
}
nvmlReturn_t DECLDIR nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    return mockDeviceGetMigIds("nvmlDeviceGetGpuInstanceId", H(device), id, 0);
}
nvmlReturn_t DECLDIR nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    return mockDeviceGetMigIds("nvmlDeviceGetComputeInstanceId", H(device), id, 1);
}
nvmlReturn_t DECLDIR nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device) {
    return mockDeviceGetDeviceHandleFromMigDeviceHandle(H(migDevice), OUT(device));
}

nvmlReturn_t DECLDIR nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes) {
    return mockDeviceGetSupportedEventTypes(H(device), eventTypes);
}
nvmlReturn_t DECLDIR nvmlEventSetCreate(nvmlEventSet_t *set) { return mockEventSetCreate(OUT(set)); }
nvmlReturn_t DECLDIR nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set) {
    return mockDeviceRegisterEvents(H(device), eventTypes, H(set));
}
nvmlReturn_t DECLDIR nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    return mockEventSetWait("nvmlEventSetWait_v2", H(set), data, timeoutms);
}
nvmlReturn_t DECLDIR nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    return mockEventSetWait("nvmlEventSetWait", H(set), data, timeoutms);
}
nvmlReturn_t DECLDIR nvmlEventSetFree(nvmlEventSet_t set) { return mockEventSetFree(H(set)); }
