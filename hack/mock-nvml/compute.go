package main

// The GPU's compute mode (nvmlDeviceGetComputeMode / nvmlDeviceSetComputeMode) and its time slice,
// which NVML cannot set: `nvidia-smi compute-policy --set-timeslice` does, and the mock's stand-in
// nvidia-smi (hack/mock-nvml/nvidia-smi) sets it through the control command `timeslice GPU 0-3`.
// Both are kept in the machine's state, so tests read the GPU's state as nvidia-smi would show it.
// As on the hardware: a MIG-enabled GPU refuses a time slice, and a reset puts both back to default.

/*
#include <stdint.h>
*/
import "C"

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

const (
	computeModeDefault          = 0
	computeModeExclusiveThread  = 1 // NVML: support removed
	computeModeProhibited       = 2
	computeModeExclusiveProcess = 3
)

//export mockDeviceGetComputeMode
func mockDeviceGetComputeMode(device uintptr, mode *C.uint) C.int {
	return gpuCall("nvmlDeviceGetComputeMode", device, func(s *State, gpu int) nvml.Return {
		if mode == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		*mode = C.uint(s.Gpus[gpu].ComputeMode)
		return nvml.SUCCESS
	})
}

//export mockDeviceSetComputeMode
func mockDeviceSetComputeMode(device uintptr, mode C.uint) C.int {
	return gpuCall("nvmlDeviceSetComputeMode", device, func(s *State, gpu int) nvml.Return {
		switch int(mode) {
		case computeModeDefault, computeModeProhibited, computeModeExclusiveProcess:
			s.Gpus[gpu].ComputeMode = int(mode)
			return nvml.SUCCESS
		case computeModeExclusiveThread:
			return nvml.ERROR_NOT_SUPPORTED
		default:
			return nvml.ERROR_INVALID_ARGUMENT
		}
	})
}

// setTimeSlice is the control command `timeslice GPU LEVEL` (0 Default .. 3 Long).
func (s *State) setTimeSlice(args []string) (string, error) {
	g, _, err := s.gpuArg(args, 1)
	if err != nil {
		return "", err
	}
	level, err := s.intArg(args, 2)
	if err != nil {
		return "", err
	}
	if level < 0 || level > 3 {
		return "", fmt.Errorf("timeslice: %d is not 0 (Default), 1 (Short), 2 (Medium) or 3 (Long)", level)
	}
	if g.MigCurrent == 1 && level != 0 {
		return "", fmt.Errorf("timeslice: GPU %s is in MIG mode: Not Supported", g.UUID)
	}
	g.TimeSlice = level
	return "", nil
}

// busyPid is the process a busy GPU runs (`busy GPU on`), one per GPU.
const busyPid = 4242

// mockDeviceRunningProcess is the compute (or graphics) process on a full GPU, which passthrough
// must see before it takes the GPU away: a busy GPU's one compute process; pid 0: none. The
// machine runs no graphics.
//
//export mockDeviceRunningProcess
func mockDeviceRunningProcess(function *C.char, device uintptr, compute C.int, pid *C.uint) C.int {
	return gpuCall(C.GoString(function), device, func(s *State, gpu int) nvml.Return {
		*pid = 0
		if compute != 0 && s.Gpus[gpu].Busy {
			*pid = C.uint(busyPid + gpu)
		}
		return nvml.SUCCESS
	})
}
