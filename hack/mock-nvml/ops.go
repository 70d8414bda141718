package main

// The NVML operations, called from the C entry points in nvml.c (which carry nvml.h's exact
// prototypes). Every function returns an nvmlReturn_t value.

/*
#cgo CFLAGS: -DNVML_NO_UNVERSIONED_FUNC_DEFS
#include <stdint.h>
#include <string.h>
#include "nvml.h"
*/
import "C"

import (
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Handles are numbers, never pointers into Go memory: kind | gpu | GPU instance | compute instance.
const (
	kindGPU = iota + 1
	kindMIG
	kindGI
	kindCI
	kindEventSet
)

const noInstance = 0xFFFFFFFF // nvmlEventData_t's "no GPU/compute instance"

func makeHandle(kind, gpu int, gi, ci uint32) uintptr {
	return uintptr(kind)<<24 | uintptr(gpu)<<16 | uintptr(gi&0xff)<<8 | uintptr(ci&0xff)
}

// handlePointer makes a handle number into the pointer type NVML's structs hold; it never points
// anywhere, and callers only hand it back.
func handlePointer(h uintptr) unsafe.Pointer {
	return *(*unsafe.Pointer)(unsafe.Pointer(&h))
}

func splitHandle(h uintptr) (kind, gpu int, gi, ci uint32) {
	return int(h >> 24), int(h >> 16 & 0xff), uint32(h >> 8 & 0xff), uint32(h & 0xff)
}

// --- the process: configuration, init count, event sets -----------------------------------------

type eventSet struct {
	registered map[int]uint64 // gpu -> event mask
	cursor     map[int]uint64 // gpu -> last event sequence number delivered
}

var (
	procMu      sync.Mutex
	initCount   int
	procSpec    string
	procStore   *store
	eventSets   = map[uint32]*eventSet{}
	nextEventID uint32
)

// processStore is this process's state: MOCK_NVML_MACHINE and MOCK_NVML_STATE_DIR, read once.
func processStore() (*store, string) {
	procMu.Lock()
	defer procMu.Unlock()
	if procStore == nil {
		procSpec = os.Getenv(envMachine)
		if procSpec == "" {
			procSpec = "dgxh100"
		}
		procStore = &store{
			dir:       os.Getenv(envStateDir),
			procRoot:  os.Getenv(envProcRoot),
			sysfsRoot: os.Getenv(envSysfsRoot),
		}
	}
	return procStore, procSpec
}

func ret(r nvml.Return) C.int { return C.int(r) }

// withState runs fn on the state for a call of `function` on `handle` (0: none), after the
// injected faults for that call: a hang, a failure, a lost GPU.
func withState(function string, handle uintptr, fn func(*State) nvml.Return) (result C.int) {
	defer func() {
		// A bug in the mock must not abort the process that loaded it: report it and answer UNKNOWN.
		if r := recover(); r != nil {
			os.Stderr.WriteString("mock libnvidia-ml: " + function + ": internal error\n")
			result = ret(nvml.ERROR_UNKNOWN)
		}
	}()
	procMu.Lock()
	initialised := initCount > 0
	procMu.Unlock()
	if !initialised {
		return ret(nvml.ERROR_UNINITIALIZED)
	}
	st, spec := processStore()
	gpu := -1
	if handle != 0 {
		_, gpu, _, _ = splitHandle(handle)
	}
	var hang time.Duration
	code := nvml.SUCCESS
	err := st.with(spec, func(s *State) error {
		hang, code = s.takeFault(function, gpu)
		return nil
	})
	if err != nil {
		return ret(nvml.ERROR_UNKNOWN)
	}
	if hang > 0 {
		time.Sleep(hang)
	}
	if code != nvml.SUCCESS {
		return ret(code)
	}
	outcome := nvml.SUCCESS
	err = st.with(spec, func(s *State) error {
		if handle != 0 {
			kind, g, _, _ := splitHandle(handle)
			if kind < kindGPU || kind > kindCI || g >= len(s.Gpus) {
				outcome = nvml.ERROR_INVALID_ARGUMENT
				return nil
			}
			if s.Gpus[g].Lost {
				outcome = nvml.ERROR_GPU_IS_LOST
				return nil
			}
		}
		outcome = fn(s)
		if handle != 0 && (strings.Contains(function, "Create") || strings.Contains(function, "Destroy")) {
			_, g, _, _ := splitHandle(handle)
			s.syncCaps(g)
		}
		return nil
	})
	if err != nil {
		return ret(nvml.ERROR_UNKNOWN)
	}
	return ret(outcome)
}

// takeFault consumes the first injected fault that matches a call.
func (s *State) takeFault(function string, gpu int) (time.Duration, nvml.Return) {
	for i := range s.Faults {
		f := &s.Faults[i]
		if f.Function != function && f.Function != "*" {
			continue
		}
		if f.GPU >= 0 && f.GPU != gpu {
			continue
		}
		hang, code := time.Duration(f.HangMS)*time.Millisecond, nvml.Return(f.Code)
		if f.Count > 0 {
			f.Count--
			if f.Count == 0 {
				s.Faults = append(s.Faults[:i], s.Faults[i+1:]...)
			}
		}
		return hang, code
	}
	return 0, nvml.SUCCESS
}

func putString(dst *C.char, length C.uint, value string) nvml.Return {
	if dst == nil {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	if int(length) < len(value)+1 {
		return nvml.ERROR_INSUFFICIENT_SIZE
	}
	buf := unsafe.Slice((*byte)(unsafe.Pointer(dst)), int(length))
	copy(buf, value)
	buf[len(value)] = 0
	return nvml.SUCCESS
}

// --- library -------------------------------------------------------------------------------------

//export mockInit
func mockInit() C.int {
	st, spec := processStore()
	if err := st.with(spec, func(*State) error { return nil }); err != nil {
		os.Stderr.WriteString("mock libnvidia-ml: " + err.Error() + "\n")
		return ret(nvml.ERROR_UNKNOWN)
	}
	procMu.Lock()
	initCount++
	procMu.Unlock()
	// nvmlInit is subject to faults too (a driver that fails to initialise).
	if code := withState("nvmlInit_v2", 0, func(*State) nvml.Return { return nvml.SUCCESS }); code != 0 {
		procMu.Lock()
		initCount--
		procMu.Unlock()
		return code
	}
	return 0
}

//export mockShutdown
func mockShutdown() C.int {
	procMu.Lock()
	defer procMu.Unlock()
	if initCount == 0 {
		return ret(nvml.ERROR_UNINITIALIZED)
	}
	initCount--
	return 0
}

//export mockSystemGetDriverVersion
func mockSystemGetDriverVersion(version *C.char, length C.uint) C.int {
	return withState("nvmlSystemGetDriverVersion", 0, func(s *State) nvml.Return {
		return putString(version, length, s.DriverVersion)
	})
}

//export mockSystemGetNVMLVersion
func mockSystemGetNVMLVersion(version *C.char, length C.uint) C.int {
	return withState("nvmlSystemGetNVMLVersion", 0, func(s *State) nvml.Return {
		// NVML's version is the CUDA major version before the driver's ("12.550.54.15").
		return putString(version, length, strconv.Itoa(s.CudaVersion/1000)+"."+s.DriverVersion)
	})
}

//export mockSystemGetCudaDriverVersion
func mockSystemGetCudaDriverVersion(function *C.char, version *C.int) C.int {
	return withState(C.GoString(function), 0, func(s *State) nvml.Return {
		if version == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		*version = C.int(s.CudaVersion)
		return nvml.SUCCESS
	})
}

// --- full GPUs -------------------------------------------------------------------------------------

//export mockDeviceGetCount
func mockDeviceGetCount(function *C.char, count *C.uint) C.int {
	return withState(C.GoString(function), 0, func(s *State) nvml.Return {
		if count == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		*count = C.uint(len(s.visibleGpus()))
		return nvml.SUCCESS
	})
}

//export mockDeviceGetHandleByIndex
func mockDeviceGetHandleByIndex(function *C.char, index C.uint, device *uintptr) C.int {
	// The handle names the GPU's place in the machine, the index its place among those NVML sees
	// (sysfs.go): no GPU is known before the lookup, so only faults for any GPU apply to it.
	return withState(C.GoString(function), 0, func(s *State) nvml.Return {
		visible := s.visibleGpus()
		if device == nil || int(index) >= len(visible) {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		gpu := visible[index]
		if s.Gpus[gpu].Lost {
			return nvml.ERROR_GPU_IS_LOST // a lost GPU has no handle either, as on hardware
		}
		*device = makeHandle(kindGPU, gpu, 0, 0)
		return nvml.SUCCESS
	})
}

//export mockDeviceGetHandleByUUID
func mockDeviceGetHandleByUUID(uuid *C.char, device *uintptr) C.int {
	wanted := C.GoString(uuid)
	return withState("nvmlDeviceGetHandleByUUID", 0, func(s *State) nvml.Return {
		if device == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		for i, g := range s.Gpus {
			if !s.onNvidia(i) {
				continue // off nvidia (sysfs.go): NVML knows neither it nor its MIG devices
			}
			if g.UUID == wanted {
				if g.Lost {
					return nvml.ERROR_GPU_IS_LOST
				}
				*device = makeHandle(kindGPU, i, 0, 0)
				return nvml.SUCCESS
			}
			for _, gi := range g.Instances {
				for _, ci := range gi.ComputeInstances {
					if ci.UUID == wanted {
						*device = makeHandle(kindMIG, i, gi.ID, ci.ID)
						return nvml.SUCCESS
					}
				}
			}
		}
		return nvml.ERROR_NOT_FOUND
	})
}

// gpuCall is a call on a full GPU's handle; MIG device handles are refused where NVML refuses them.
func gpuCall(function string, device uintptr, fn func(s *State, gpu int) nvml.Return) C.int {
	return withState(function, device, func(s *State) nvml.Return {
		kind, gpu, _, _ := splitHandle(device)
		if kind != kindGPU {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		return fn(s, gpu)
	})
}

// migInfo resolves a MIG device handle, if it still names a live GPU and compute instance.
func migInfo(s *State, device uintptr) (*GpuInstance, *ComputeInstance) {
	kind, gpu, giID, ciID := splitHandle(device)
	if kind != kindMIG {
		return nil, nil
	}
	gi := s.Gpus[gpu].instance(giID)
	if gi == nil {
		return nil, nil
	}
	return gi, gi.compute(ciID)
}

//export mockDeviceGetUUID
func mockDeviceGetUUID(device uintptr, uuid *C.char, length C.uint) C.int {
	return withState("nvmlDeviceGetUUID", device, func(s *State) nvml.Return {
		kind, gpu, _, _ := splitHandle(device)
		switch kind {
		case kindGPU:
			return putString(uuid, length, s.Gpus[gpu].UUID)
		case kindMIG:
			if _, ci := migInfo(s, device); ci != nil {
				return putString(uuid, length, ci.UUID)
			}
		}
		return nvml.ERROR_INVALID_ARGUMENT
	})
}

//export mockDeviceGetName
func mockDeviceGetName(device uintptr, name *C.char, length C.uint) C.int {
	return gpuCall("nvmlDeviceGetName", device, func(s *State, gpu int) nvml.Return {
		return putString(name, length, s.config(gpu).Name)
	})
}

//export mockDeviceGetBrand
func mockDeviceGetBrand(device uintptr, brand *C.nvmlBrandType_t) C.int {
	return gpuCall("nvmlDeviceGetBrand", device, func(s *State, gpu int) nvml.Return {
		*brand = C.nvmlBrandType_t(s.config(gpu).Brand)
		return nvml.SUCCESS
	})
}

//export mockDeviceGetIndex
func mockDeviceGetIndex(device uintptr, index *C.uint) C.int {
	return gpuCall("nvmlDeviceGetIndex", device, func(s *State, gpu int) nvml.Return {
		*index = C.uint(gpu)
		return nvml.SUCCESS
	})
}

//export mockDeviceGetMinorNumber
func mockDeviceGetMinorNumber(device uintptr, minor *C.uint) C.int {
	return gpuCall("nvmlDeviceGetMinorNumber", device, func(s *State, gpu int) nvml.Return {
		*minor = C.uint(s.Gpus[gpu].Minor)
		return nvml.SUCCESS
	})
}

//export mockDeviceGetArchitecture
func mockDeviceGetArchitecture(device uintptr, arch *C.nvmlDeviceArchitecture_t) C.int {
	return gpuCall("nvmlDeviceGetArchitecture", device, func(s *State, gpu int) nvml.Return {
		*arch = C.nvmlDeviceArchitecture_t(s.config(gpu).Architecture)
		return nvml.SUCCESS
	})
}

//export mockDeviceGetCudaComputeCapability
func mockDeviceGetCudaComputeCapability(device uintptr, major, minor *C.int) C.int {
	return gpuCall("nvmlDeviceGetCudaComputeCapability", device, func(s *State, gpu int) nvml.Return {
		c := s.config(gpu)
		*major, *minor = C.int(c.CudaMajor), C.int(c.CudaMinor)
		return nvml.SUCCESS
	})
}

// memoryOf is the memory a handle sees: the GPU's, or its GPU instance's for a MIG device.
func memoryOf(s *State, device uintptr) (uint64, nvml.Return) {
	kind, gpu, _, _ := splitHandle(device)
	switch kind {
	case kindGPU:
		return s.config(gpu).MemoryMB << 20, nvml.SUCCESS
	case kindMIG:
		gi, ci := migInfo(s, device)
		if ci == nil {
			return 0, nvml.ERROR_INVALID_ARGUMENT
		}
		profile, ok := s.profileByID(gpu, gi.ProfileID)
		if !ok {
			return 0, nvml.ERROR_UNKNOWN
		}
		return profile.MemorySizeMB << 20, nvml.SUCCESS
	}
	return 0, nvml.ERROR_INVALID_ARGUMENT
}

//export mockDeviceGetMemoryInfo
func mockDeviceGetMemoryInfo(device uintptr, memory *C.nvmlMemory_t) C.int {
	return withState("nvmlDeviceGetMemoryInfo", device, func(s *State) nvml.Return {
		total, code := memoryOf(s, device)
		if code == nvml.SUCCESS {
			memory.total, memory.free, memory.used = C.ulonglong(total), C.ulonglong(total), 0
		}
		return code
	})
}

//export mockDeviceGetMemoryInfoV2
func mockDeviceGetMemoryInfoV2(device uintptr, memory *C.nvmlMemory_v2_t) C.int {
	return withState("nvmlDeviceGetMemoryInfo_v2", device, func(s *State) nvml.Return {
		if memory.version != C.nvmlMemory_v2 {
			return nvml.ERROR_ARGUMENT_VERSION_MISMATCH
		}
		total, code := memoryOf(s, device)
		if code == nvml.SUCCESS {
			memory.total, memory.free, memory.used, memory.reserved = C.ulonglong(total), C.ulonglong(total), 0, 0
		}
		return code
	})
}

//export mockDeviceGetPciInfo
func mockDeviceGetPciInfo(function *C.char, device uintptr, pci *C.nvmlPciInfo_t) C.int {
	return gpuCall(C.GoString(function), device, func(s *State, gpu int) nvml.Return {
		*pci = C.nvmlPciInfo_t{}
		busID := s.Gpus[gpu].BusID
		for i := 0; i < len(busID) && i < len(pci.busId)-1; i++ {
			pci.busId[i] = C.char(busID[i])
		}
		legacy := busID[4:] // the legacy field holds the short form, 0000:18:00.0
		for i := 0; i < len(legacy) && i < len(pci.busIdLegacy)-1; i++ {
			pci.busIdLegacy[i] = C.char(legacy[i])
		}
		var bus uint32
		for _, c := range busID[9:11] {
			bus = bus*16 + uint32(strings.IndexRune("0123456789ABCDEF", c))
		}
		pci.bus = C.uint(bus)
		pci.pciDeviceId = C.uint(s.config(gpu).PciDeviceId)
		pci.pciSubSystemId = C.uint(0x16A110DE)
		return nvml.SUCCESS
	})
}

//export mockDeviceGetNumGpuCores
func mockDeviceGetNumGpuCores(device uintptr, cores *C.uint) C.int {
	// NVIDIA's mocks carry no core count: NOT_SUPPORTED, as some boards and drivers answer.
	return gpuCall("nvmlDeviceGetNumGpuCores", device, func(*State, int) nvml.Return {
		return nvml.ERROR_NOT_SUPPORTED
	})
}

// --- MIG mode --------------------------------------------------------------------------------------

//export mockDeviceGetMigMode
func mockDeviceGetMigMode(device uintptr, current, pending *C.uint) C.int {
	return gpuCall("nvmlDeviceGetMigMode", device, func(s *State, gpu int) nvml.Return {
		if !migCapable(s.config(gpu)) {
			return nvml.ERROR_NOT_SUPPORTED
		}
		*current, *pending = C.uint(s.Gpus[gpu].MigCurrent), C.uint(s.Gpus[gpu].MigPending)
		return nvml.SUCCESS
	})
}

// mockDeviceSetMigMode follows nvml.h: the pending mode is set first; activating it needs an idle
// GPU (IN_USE otherwise) and, before Hopper, a reset (RESET_REQUIRED); either way the pending mode
// stays what was asked for until a reset or another call.
//
//export mockDeviceSetMigMode
func mockDeviceSetMigMode(device uintptr, mode C.uint, activation *C.nvmlReturn_t) C.int {
	return gpuCall("nvmlDeviceSetMigMode", device, func(s *State, gpu int) nvml.Return {
		g := &s.Gpus[gpu]
		if !migCapable(s.config(gpu)) {
			return nvml.ERROR_NOT_SUPPORTED
		}
		if mode > 1 || activation == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		if mode == 0 && len(g.Instances) > 0 {
			return nvml.ERROR_IN_USE // GPU instances exist: MIG mode cannot be left
		}
		g.MigPending = int(mode)
		status := nvml.SUCCESS
		switch {
		case g.MigCurrent == int(mode):
		case g.Busy:
			status = nvml.ERROR_IN_USE
		case requiresReset(s.config(gpu)):
			status = nvml.ERROR_RESET_REQUIRED
		default:
			g.MigCurrent = int(mode)
			if s.RenumberOnMigSwitch {
				// The switch reset the GPU: a new minor number, and the event registrations of
				// this process's event sets for it are gone, as for a re-attached device.
				g.Minor += renumberOffset
				procMu.Lock()
				for _, es := range eventSets {
					delete(es.registered, gpu)
					delete(es.cursor, gpu)
				}
				procMu.Unlock()
			}
		}
		*activation = C.nvmlReturn_t(status)
		return nvml.SUCCESS
	})
}

// --- GPU-instance profiles and placements --------------------------------------------------------

// profileByID finds a GPU-instance profile by the id NVML reports in its info struct.
func (s *State) profileByID(gpu int, id uint32) (nvml.GpuInstanceProfileInfo, bool) {
	for _, p := range s.config(gpu).MIGProfiles.GpuInstanceProfiles {
		if p.Id == id {
			return p, true
		}
	}
	return nvml.GpuInstanceProfileInfo{}, false
}

// profileKey is the NVML_GPU_INSTANCE_PROFILE_* constant of the profile with info id `id`.
func (s *State) profileKey(gpu int, id uint32) (int, bool) {
	for key, p := range s.config(gpu).MIGProfiles.GpuInstanceProfiles {
		if p.Id == id {
			return key, true
		}
	}
	return 0, false
}

//export mockDeviceGetGpuInstanceProfileInfo
func mockDeviceGetGpuInstanceProfileInfo(function *C.char, device uintptr, profile C.uint, info *C.nvmlGpuInstanceProfileInfo_v2_t, v2 C.int) C.int {
	return gpuCall(C.GoString(function), device, func(s *State, gpu int) nvml.Return {
		c := s.config(gpu)
		if !migCapable(c) {
			return nvml.ERROR_NOT_SUPPORTED
		}
		if int(profile) >= nvml.GPU_INSTANCE_PROFILE_COUNT || info == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		if v2 != 0 && info.version != C.nvmlGpuInstanceProfileInfo_v2 {
			return nvml.ERROR_ARGUMENT_VERSION_MISMATCH
		}
		p, ok := c.MIGProfiles.GpuInstanceProfiles[int(profile)]
		if !ok {
			return nvml.ERROR_NOT_SUPPORTED
		}
		info.id = C.uint(p.Id)
		info.isP2pSupported = C.uint(p.IsP2pSupported)
		info.sliceCount = C.uint(p.SliceCount)
		info.instanceCount = C.uint(p.InstanceCount)
		info.multiprocessorCount = C.uint(p.MultiprocessorCount)
		info.copyEngineCount = C.uint(p.CopyEngineCount)
		info.decoderCount = C.uint(p.DecoderCount)
		info.encoderCount = C.uint(p.EncoderCount)
		info.jpegCount = C.uint(p.JpegCount)
		info.ofaCount = C.uint(p.OfaCount)
		info.memorySizeMB = C.ulonglong(p.MemorySizeMB)
		if v2 != 0 {
			putString(&info.name[0], C.uint(len(info.name)), migProfileLabel(p, c.MemoryMB))
		}
		return nvml.SUCCESS
	})
}

// migProfileLabel is a name like the driver's own ("MIG 1g.10gb"), from the mock's memory size.
func migProfileLabel(p nvml.GpuInstanceProfileInfo, _ uint64) string {
	gb := (p.MemorySizeMB + 1023) / 1024
	return "MIG " + itoa(uint64(p.SliceCount)) + "g." + itoa(gb) + "gb"
}

func itoa(v uint64) string {
	if v == 0 {
		return "0"
	}
	var b []byte
	for ; v > 0; v /= 10 {
		b = append([]byte{byte('0' + v%10)}, b...)
	}
	return string(b)
}

//export mockDeviceGetGpuInstancePossiblePlacements
func mockDeviceGetGpuInstancePossiblePlacements(device uintptr, profileID C.uint, placements *C.nvmlGpuInstancePlacement_t, count *C.uint) C.int {
	return gpuCall("nvmlDeviceGetGpuInstancePossiblePlacements_v2", device, func(s *State, gpu int) nvml.Return {
		if count == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		key, ok := s.profileKey(gpu, uint32(profileID))
		if !migCapable(s.config(gpu)) || !ok {
			return nvml.ERROR_NOT_SUPPORTED
		}
		offered := s.config(gpu).MIGProfiles.GpuInstancePlacements[key]
		if placements == nil {
			*count = C.uint(len(offered))
			return nvml.SUCCESS
		}
		if int(*count) < len(offered) {
			*count = C.uint(len(offered))
			return nvml.ERROR_INSUFFICIENT_SIZE
		}
		out := unsafe.Slice(placements, len(offered))
		for i, p := range offered {
			out[i].start, out[i].size = C.uint(p.Start), C.uint(p.Size)
		}
		*count = C.uint(len(offered))
		return nvml.SUCCESS
	})
}

// --- GPU instances -------------------------------------------------------------------------------

//export mockDeviceCreateGpuInstanceWithPlacement
func mockDeviceCreateGpuInstanceWithPlacement(device uintptr, profileID C.uint, placement *C.nvmlGpuInstancePlacement_t, out *uintptr) C.int {
	return gpuCall("nvmlDeviceCreateGpuInstanceWithPlacement", device, func(s *State, gpu int) nvml.Return {
		g := &s.Gpus[gpu]
		if placement == nil || out == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		if g.MigCurrent != 1 {
			return nvml.ERROR_NOT_SUPPORTED // "If device doesn't have MIG mode enabled"
		}
		key, ok := s.profileKey(gpu, uint32(profileID))
		if !ok {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		wanted := Placement{uint32(placement.start), uint32(placement.size)}
		valid := false
		for _, p := range s.config(gpu).MIGProfiles.GpuInstancePlacements[key] {
			if p.Start == wanted.Start && p.Size == wanted.Size {
				valid = true
			}
		}
		if !valid {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		same := 0
		for _, gi := range g.Instances {
			if gi.Placement.overlaps(wanted) {
				return nvml.ERROR_INSUFFICIENT_RESOURCES
			}
			if gi.ProfileID == uint32(profileID) {
				same++
			}
		}
		profile, _ := s.profileByID(gpu, uint32(profileID))
		if same >= int(profile.InstanceCount) {
			return nvml.ERROR_INSUFFICIENT_RESOURCES
		}
		id := uint32(1)
		for g.instance(id) != nil {
			id++
		}
		g.Instances = append(g.Instances, GpuInstance{ID: id, ProfileID: uint32(profileID), Placement: wanted, ComputeInstances: []ComputeInstance{}})
		*out = makeHandle(kindGI, gpu, id, 0)
		return nvml.SUCCESS
	})
}

// giCall is a call on a GPU-instance handle that still names a live GPU instance.
func giCall(function string, handle uintptr, fn func(s *State, gpu int, gi *GpuInstance) nvml.Return) C.int {
	return withState(function, handle, func(s *State) nvml.Return {
		kind, gpu, giID, _ := splitHandle(handle)
		if kind != kindGI {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		gi := s.Gpus[gpu].instance(giID)
		if gi == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		return fn(s, gpu, gi)
	})
}

//export mockDeviceGetGpuInstanceById
func mockDeviceGetGpuInstanceById(device uintptr, id C.uint, out *uintptr) C.int {
	return gpuCall("nvmlDeviceGetGpuInstanceById", device, func(s *State, gpu int) nvml.Return {
		if s.Gpus[gpu].MigCurrent != 1 {
			return nvml.ERROR_NOT_SUPPORTED
		}
		if s.Gpus[gpu].instance(uint32(id)) == nil {
			return nvml.ERROR_NOT_FOUND
		}
		*out = makeHandle(kindGI, gpu, uint32(id), 0)
		return nvml.SUCCESS
	})
}

//export mockDeviceGetGpuInstances
func mockDeviceGetGpuInstances(device uintptr, profileID C.uint, out *uintptr, count *C.uint) C.int {
	return gpuCall("nvmlDeviceGetGpuInstances", device, func(s *State, gpu int) nvml.Return {
		if count == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		if s.Gpus[gpu].MigCurrent != 1 {
			return nvml.ERROR_NOT_SUPPORTED
		}
		if _, ok := s.profileKey(gpu, uint32(profileID)); !ok {
			return nvml.ERROR_NOT_SUPPORTED
		}
		var ids []uint32
		for _, gi := range s.Gpus[gpu].Instances {
			if gi.ProfileID == uint32(profileID) {
				ids = append(ids, gi.ID)
			}
		}
		sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
		if out != nil && len(ids) > 0 {
			dst := unsafe.Slice(out, len(ids))
			for i, id := range ids {
				dst[i] = makeHandle(kindGI, gpu, id, 0)
			}
		}
		*count = C.uint(len(ids))
		return nvml.SUCCESS
	})
}

//export mockGpuInstanceGetInfo
func mockGpuInstanceGetInfo(handle uintptr, info *C.nvmlGpuInstanceInfo_t) C.int {
	return giCall("nvmlGpuInstanceGetInfo", handle, func(s *State, gpu int, gi *GpuInstance) nvml.Return {
		info.device = C.nvmlDevice_t{handle: (*C.struct_nvmlDevice_st)(handlePointer(makeHandle(kindGPU, gpu, 0, 0)))}
		info.id = C.uint(gi.ID)
		info.profileId = C.uint(gi.ProfileID)
		info.placement.start, info.placement.size = C.uint(gi.Placement.Start), C.uint(gi.Placement.Size)
		return nvml.SUCCESS
	})
}

//export mockGpuInstanceDestroy
func mockGpuInstanceDestroy(handle uintptr) C.int {
	return giCall("nvmlGpuInstanceDestroy", handle, func(s *State, gpu int, gi *GpuInstance) nvml.Return {
		if len(gi.ComputeInstances) > 0 || gi.Busy {
			return nvml.ERROR_IN_USE
		}
		g := &s.Gpus[gpu]
		for i := range g.Instances {
			if g.Instances[i].ID == gi.ID {
				g.Instances = append(g.Instances[:i], g.Instances[i+1:]...)
				break
			}
		}
		return nvml.SUCCESS
	})
}

// --- compute instances -----------------------------------------------------------------------------

//export mockGpuInstanceGetComputeInstanceProfileInfo
func mockGpuInstanceGetComputeInstanceProfileInfo(function *C.char, handle uintptr, profile, engine C.uint, info *C.nvmlComputeInstanceProfileInfo_v2_t, v2 C.int) C.int {
	return giCall(C.GoString(function), handle, func(s *State, gpu int, gi *GpuInstance) nvml.Return {
		if int(profile) >= nvml.COMPUTE_INSTANCE_PROFILE_COUNT || info == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		if v2 != 0 && info.version != C.nvmlComputeInstanceProfileInfo_v2 {
			return nvml.ERROR_ARGUMENT_VERSION_MISMATCH
		}
		if engine != nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED {
			return nvml.ERROR_NOT_SUPPORTED
		}
		key, _ := s.profileKey(gpu, gi.ProfileID)
		p, ok := s.config(gpu).MIGProfiles.ComputeInstanceProfiles[key][int(profile)]
		if !ok {
			return nvml.ERROR_NOT_SUPPORTED
		}
		info.id = C.uint(p.Id)
		info.sliceCount = C.uint(p.SliceCount)
		info.instanceCount = C.uint(p.InstanceCount)
		info.multiprocessorCount = C.uint(p.MultiprocessorCount)
		info.sharedCopyEngineCount = C.uint(p.SharedCopyEngineCount)
		info.sharedDecoderCount = C.uint(p.SharedDecoderCount)
		info.sharedEncoderCount = C.uint(p.SharedEncoderCount)
		info.sharedJpegCount = C.uint(p.SharedJpegCount)
		info.sharedOfaCount = C.uint(p.SharedOfaCount)
		if v2 != 0 {
			putString(&info.name[0], C.uint(len(info.name)), "MIG "+itoa(uint64(p.SliceCount))+"c")
		}
		return nvml.SUCCESS
	})
}

//export mockGpuInstanceCreateComputeInstance
func mockGpuInstanceCreateComputeInstance(handle uintptr, profileID C.uint, out *uintptr) C.int {
	return giCall("nvmlGpuInstanceCreateComputeInstance", handle, func(s *State, gpu int, gi *GpuInstance) nvml.Return {
		if out == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		key, _ := s.profileKey(gpu, gi.ProfileID)
		cfg := s.config(gpu).MIGProfiles
		profile, ok := cfg.ComputeInstanceProfiles[key][int(profileID)]
		if !ok {
			return nvml.ERROR_NOT_SUPPORTED
		}
		same := 0
		for _, ci := range gi.ComputeInstances {
			if ci.ProfileID == uint32(profileID) {
				same++
			}
		}
		if same >= int(profile.InstanceCount) {
			return nvml.ERROR_INSUFFICIENT_RESOURCES
		}
		var where *Placement
		for _, candidate := range s.computePlacements(gpu, key, int(profileID)) {
			free := true
			for _, ci := range gi.ComputeInstances {
				if ci.Placement.overlaps(candidate) {
					free = false
				}
			}
			if free {
				where = &candidate
				break
			}
		}
		if where == nil {
			return nvml.ERROR_INSUFFICIENT_RESOURCES
		}
		id := uint32(0)
		for gi.compute(id) != nil {
			id++
		}
		uuid := "MIG-" + stableUUID(s.Gpus[gpu].UUID+"/mig/"+itoa(s.next()))
		gi.ComputeInstances = append(gi.ComputeInstances, ComputeInstance{ID: id, ProfileID: uint32(profileID), Placement: *where, UUID: uuid})
		*out = makeHandle(kindCI, gpu, gi.ID, id)
		return nvml.SUCCESS
	})
}

//export mockGpuInstanceGetComputeInstanceById
func mockGpuInstanceGetComputeInstanceById(handle uintptr, id C.uint, out *uintptr) C.int {
	return giCall("nvmlGpuInstanceGetComputeInstanceById", handle, func(s *State, gpu int, gi *GpuInstance) nvml.Return {
		if gi.compute(uint32(id)) == nil {
			return nvml.ERROR_NOT_FOUND
		}
		*out = makeHandle(kindCI, gpu, gi.ID, uint32(id))
		return nvml.SUCCESS
	})
}

//export mockGpuInstanceGetComputeInstances
func mockGpuInstanceGetComputeInstances(handle uintptr, profileID C.uint, out *uintptr, count *C.uint) C.int {
	return giCall("nvmlGpuInstanceGetComputeInstances", handle, func(s *State, gpu int, gi *GpuInstance) nvml.Return {
		if count == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		var ids []uint32
		for _, ci := range gi.ComputeInstances {
			if ci.ProfileID == uint32(profileID) {
				ids = append(ids, ci.ID)
			}
		}
		sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
		if out != nil && len(ids) > 0 {
			dst := unsafe.Slice(out, len(ids))
			for i, id := range ids {
				dst[i] = makeHandle(kindCI, gpu, gi.ID, id)
			}
		}
		*count = C.uint(len(ids))
		return nvml.SUCCESS
	})
}

// ciCall is a call on a compute-instance handle that still names a live compute instance.
func ciCall(function string, handle uintptr, fn func(s *State, gpu int, gi *GpuInstance, ci *ComputeInstance) nvml.Return) C.int {
	return withState(function, handle, func(s *State) nvml.Return {
		kind, gpu, giID, ciID := splitHandle(handle)
		if kind != kindCI {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		gi := s.Gpus[gpu].instance(giID)
		if gi == nil || gi.compute(ciID) == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		return fn(s, gpu, gi, gi.compute(ciID))
	})
}

//export mockComputeInstanceGetInfo
func mockComputeInstanceGetInfo(function *C.char, handle uintptr, info *C.nvmlComputeInstanceInfo_t) C.int {
	return ciCall(C.GoString(function), handle, func(s *State, gpu int, gi *GpuInstance, ci *ComputeInstance) nvml.Return {
		info.device = C.nvmlDevice_t{handle: (*C.struct_nvmlDevice_st)(handlePointer(makeHandle(kindGPU, gpu, 0, 0)))}
		info.gpuInstance = C.nvmlGpuInstance_t{handle: (*C.struct_nvmlGpuInstance_st)(handlePointer(makeHandle(kindGI, gpu, gi.ID, 0)))}
		info.id = C.uint(ci.ID)
		info.profileId = C.uint(ci.ProfileID)
		info.placement.start, info.placement.size = C.uint(ci.Placement.Start), C.uint(ci.Placement.Size)
		return nvml.SUCCESS
	})
}

//export mockComputeInstanceDestroy
func mockComputeInstanceDestroy(handle uintptr) C.int {
	return ciCall("nvmlComputeInstanceDestroy", handle, func(s *State, gpu int, gi *GpuInstance, ci *ComputeInstance) nvml.Return {
		if gi.Busy {
			return nvml.ERROR_IN_USE
		}
		for i := range gi.ComputeInstances {
			if gi.ComputeInstances[i].ID == ci.ID {
				gi.ComputeInstances = append(gi.ComputeInstances[:i], gi.ComputeInstances[i+1:]...)
				break
			}
		}
		return nvml.SUCCESS
	})
}

// --- MIG devices -----------------------------------------------------------------------------------

//export mockDeviceGetMaxMigDeviceCount
func mockDeviceGetMaxMigDeviceCount(device uintptr, count *C.uint) C.int {
	return gpuCall("nvmlDeviceGetMaxMigDeviceCount", device, func(s *State, gpu int) nvml.Return {
		max := uint32(0)
		for _, p := range s.config(gpu).MIGProfiles.GpuInstanceProfiles {
			if p.SliceCount == 1 && p.InstanceCount > max {
				max = p.InstanceCount
			}
		}
		*count = C.uint(max)
		return nvml.SUCCESS
	})
}

//export mockDeviceGetMigDeviceHandleByIndex
func mockDeviceGetMigDeviceHandleByIndex(device uintptr, index C.uint, out *uintptr) C.int {
	return gpuCall("nvmlDeviceGetMigDeviceHandleByIndex", device, func(s *State, gpu int) nvml.Return {
		if s.Gpus[gpu].MigCurrent != 1 {
			return nvml.ERROR_NOT_SUPPORTED
		}
		devices := s.Gpus[gpu].migDevices()
		if int(index) >= len(devices) {
			return nvml.ERROR_NOT_FOUND
		}
		*out = makeHandle(kindMIG, gpu, devices[index][0], devices[index][1])
		return nvml.SUCCESS
	})
}

//export mockDeviceIsMigDeviceHandle
func mockDeviceIsMigDeviceHandle(device uintptr, isMig *C.uint) C.int {
	return withState("nvmlDeviceIsMigDeviceHandle", device, func(s *State) nvml.Return {
		kind, _, _, _ := splitHandle(device)
		*isMig = 0
		if kind == kindMIG {
			*isMig = 1
		}
		return nvml.SUCCESS
	})
}

//export mockDeviceGetMigIds
func mockDeviceGetMigIds(function *C.char, device uintptr, id *C.uint, wantCI C.int) C.int {
	return withState(C.GoString(function), device, func(s *State) nvml.Return {
		gi, ci := migInfo(s, device)
		if ci == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		*id = C.uint(gi.ID)
		if wantCI != 0 {
			*id = C.uint(ci.ID)
		}
		return nvml.SUCCESS
	})
}

//export mockDeviceGetDeviceHandleFromMigDeviceHandle
func mockDeviceGetDeviceHandleFromMigDeviceHandle(device uintptr, out *uintptr) C.int {
	return withState("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", device, func(s *State) nvml.Return {
		if _, ci := migInfo(s, device); ci == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		_, gpu, _, _ := splitHandle(device)
		*out = makeHandle(kindGPU, gpu, 0, 0)
		return nvml.SUCCESS
	})
}

// --- events ----------------------------------------------------------------------------------------

const supportedEvents = nvml.EventTypeXidCriticalError | nvml.EventTypeSingleBitEccError | nvml.EventTypeDoubleBitEccError

// supportedEvents: a GPU whose Xid events are off (the `events` command) offers only the ECC ones,
// as GPUs and drivers without Xid event support do.
func (g *Gpu) supportedEvents() uint64 {
	if g.NoXidEvents {
		return uint64(supportedEvents) &^ uint64(nvml.EventTypeXidCriticalError)
	}
	return uint64(supportedEvents)
}

//export mockDeviceGetSupportedEventTypes
func mockDeviceGetSupportedEventTypes(device uintptr, types *C.ulonglong) C.int {
	return gpuCall("nvmlDeviceGetSupportedEventTypes", device, func(s *State, gpu int) nvml.Return {
		*types = C.ulonglong(s.Gpus[gpu].supportedEvents())
		return nvml.SUCCESS
	})
}

//export mockEventSetCreate
func mockEventSetCreate(out *uintptr) C.int {
	return withState("nvmlEventSetCreate", 0, func(*State) nvml.Return {
		procMu.Lock()
		defer procMu.Unlock()
		nextEventID++
		eventSets[nextEventID] = &eventSet{registered: map[int]uint64{}, cursor: map[int]uint64{}}
		*out = uintptr(kindEventSet)<<24 | uintptr(nextEventID)
		return nvml.SUCCESS
	})
}

func lookupEventSet(h uintptr) *eventSet {
	if h>>24 != kindEventSet {
		return nil
	}
	procMu.Lock()
	defer procMu.Unlock()
	return eventSets[uint32(h&0xffffff)]
}

//export mockDeviceRegisterEvents
func mockDeviceRegisterEvents(device uintptr, types C.ulonglong, set uintptr) C.int {
	return gpuCall("nvmlDeviceRegisterEvents", device, func(s *State, gpu int) nvml.Return {
		es := lookupEventSet(set)
		if es == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		if uint64(types)&^s.Gpus[gpu].supportedEvents() != 0 {
			return nvml.ERROR_NOT_SUPPORTED
		}
		procMu.Lock()
		defer procMu.Unlock()
		es.registered[gpu] |= uint64(types)
		if _, seen := es.cursor[gpu]; !seen {
			es.cursor[gpu] = s.Serial // only events from now on
		}
		return nvml.SUCCESS
	})
}

// mockEventSetWait delivers the next event of a registered GPU, waiting up to timeout ms; a lost
// GPU among the registered ones makes it fail with GPU_IS_LOST at once, as nvml.h documents.
//
//export mockEventSetWait
func mockEventSetWait(function *C.char, set uintptr, data *C.nvmlEventData_t, timeoutMS C.uint) C.int {
	deadline := time.Now().Add(time.Duration(timeoutMS) * time.Millisecond)
	es := lookupEventSet(set)
	if es == nil || data == nil {
		return ret(nvml.ERROR_INVALID_ARGUMENT)
	}
	for {
		found := false
		code := withState(C.GoString(function), 0, func(s *State) nvml.Return {
			procMu.Lock()
			defer procMu.Unlock()
			gpus := make([]int, 0, len(es.registered))
			for gpu := range es.registered {
				gpus = append(gpus, gpu)
			}
			sort.Ints(gpus)
			for _, gpu := range gpus {
				if gpu < len(s.Gpus) && s.Gpus[gpu].Lost {
					return nvml.ERROR_GPU_IS_LOST
				}
			}
			for _, gpu := range gpus {
				for _, e := range s.Gpus[gpu].Events {
					if e.Seq <= es.cursor[gpu] || e.Type&es.registered[gpu] == 0 {
						continue
					}
					es.cursor[gpu] = e.Seq
					data.device = C.nvmlDevice_t{handle: (*C.struct_nvmlDevice_st)(handlePointer(makeHandle(kindGPU, gpu, 0, 0)))}
					data.eventType = C.ulonglong(e.Type)
					data.eventData = C.ulonglong(e.Data)
					data.gpuInstanceId = C.uint(e.GI)
					data.computeInstanceId = C.uint(e.CI)
					found = true
					return nvml.SUCCESS
				}
			}
			return nvml.SUCCESS
		})
		if code != 0 || found {
			return code
		}
		if !time.Now().Before(deadline) {
			return ret(nvml.ERROR_TIMEOUT)
		}
		time.Sleep(min(5*time.Millisecond, time.Until(deadline)))
	}
}

//export mockEventSetFree
func mockEventSetFree(set uintptr) C.int {
	return withState("nvmlEventSetFree", 0, func(*State) nvml.Return {
		if lookupEventSet(set) == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		procMu.Lock()
		defer procMu.Unlock()
		delete(eventSets, uint32(set&0xffffff))
		return nvml.SUCCESS
	})
}

// computePlacements are the placements of a compute-instance profile inside a GPU instance of
// GPU-instance profile `key`. NVIDIA's A100 mock lists none; there they are derived the way the
// H100 mock lists them: back to back, each as wide as the compute instance.
func (s *State) computePlacements(gpu, key, ciProfile int) []Placement {
	cfg := s.config(gpu).MIGProfiles
	var out []Placement
	for _, p := range cfg.ComputeInstancePlacements[key][ciProfile] {
		out = append(out, Placement{p.Start, p.Size})
	}
	if len(out) > 0 {
		return out
	}
	ci, ok := cfg.ComputeInstanceProfiles[key][ciProfile]
	gi, found := cfg.GpuInstanceProfiles[key]
	if !ok || !found || ci.SliceCount == 0 {
		return nil
	}
	for start := uint32(0); start+ci.SliceCount <= gi.SliceCount; start += ci.SliceCount {
		out = append(out, Placement{start, ci.SliceCount})
	}
	return out
}
