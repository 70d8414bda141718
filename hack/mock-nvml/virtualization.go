package main

// The GPU's virtualization mode (nvmlDeviceGetVirtualizationMode): whether the machine is bare
// metal (NONE, every DGX mock), a VM the GPU is passed through to (PASSTHROUGH), a vGPU guest
// (VGPU) or a vGPU host (HOST_VGPU, HOST_VSGA). NVIDIA's DRA driver asks it before it offers
// dynamic MIG, which a vGPU guest cannot repartition; the control command
//
//	virtualization GPU|all none|passthrough|vgpu|host-vgpu|host-vsga
//
// sets it.

/*
#cgo CFLAGS: -DNVML_NO_UNVERSIONED_FUNC_DEFS
#include <stdint.h>
#include "nvml.h"
*/
import "C"

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

var virtualizationModes = map[string]C.nvmlGpuVirtualizationMode_t{
	"none":        C.NVML_GPU_VIRTUALIZATION_MODE_NONE,
	"passthrough": C.NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH,
	"vgpu":        C.NVML_GPU_VIRTUALIZATION_MODE_VGPU,
	"host-vgpu":   C.NVML_GPU_VIRTUALIZATION_MODE_HOST_VGPU,
	"host-vsga":   C.NVML_GPU_VIRTUALIZATION_MODE_HOST_VSGA,
}

//export mockDeviceGetVirtualizationMode
func mockDeviceGetVirtualizationMode(device uintptr, mode *C.nvmlGpuVirtualizationMode_t) C.int {
	return gpuCall("nvmlDeviceGetVirtualizationMode", device, func(s *State, gpu int) nvml.Return {
		if mode == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		name := s.Gpus[gpu].Virtualization
		if name == "" {
			name = "none"
		}
		*mode = virtualizationModes[name]
		return nvml.SUCCESS
	})
}

// runVirtualization is the control command `virtualization GPU|all MODE`.
func (s *State) runVirtualization(args []string) (string, error) {
	if len(args) != 3 {
		return "", fmt.Errorf("virtualization GPU|all none|passthrough|vgpu|host-vgpu|host-vsga")
	}
	if _, ok := virtualizationModes[args[2]]; !ok {
		return "", fmt.Errorf("virtualization: %q is not none, passthrough, vgpu, host-vgpu or host-vsga", args[2])
	}
	targets, err := s.gpuTargets(args)
	if err != nil {
		return "", err
	}
	for _, n := range targets {
		s.Gpus[n].Virtualization = args[2]
	}
	return "", nil
}
