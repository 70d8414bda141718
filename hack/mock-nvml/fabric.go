package main

// GPU fabric info (nvmlDeviceGetGpuFabricInfo, ...V, ..._v4) and the memory addressing mode
// (nvmlDeviceGetAddressingMode), and the GB200 NVL72 compute tray that has both.
//
// What NVML answers, by platform (nvml.h; NVIDIA's compute-domain plugin, getCliqueIDStrict):
//   - before Hopper: fabric info is NOT_SUPPORTED;
//   - Hopper and Blackwell boards with single-node NVSwitch (DGX H100, H200, B200): registration
//     with the fabric manager completes, but the cluster UUID is all zeros -- "NVLink-capable, but
//     not MNNVL-capable" -- so such a node is in no clique;
//   - a GB200 NVL72 tray: the rack's cluster UUID and the clique (NVLink partition) id. Several
//     mock nodes (one state directory each) are put in the same or different cliques through
//     MOCK_NVML_FABRIC, or later with the control command `fabric`.
// The addressing mode is ATS on Grace (GB200) and NOT_SUPPORTED on the x86 DGX systems, which
// have no coherent memory ("" in NVIDIA's driver: no addressingMode attribute).

/*
#cgo CFLAGS: -DNVML_NO_UNVERSIONED_FUNC_DEFS
#include <stdint.h>
#include <string.h>
#include "nvml.h"
*/
import "C"

import (
	"encoding/hex"
	"fmt"
	"os"
	"strconv"
	"strings"
	"unsafe"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxb200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

const (
	envFabric = "MOCK_NVML_FABRIC" // <cluster-uuid>/<clique-id> or <clique-id>: a gb200nvl72's clique
	// The simulator's default NVLink domain (dra_driver/simulated/nodes.py DEFAULT_CLUSTER_UUID),
	// so a mock tray and a simulated tray left at their defaults are in one clique.
	defaultClusterUUID = "76c7d4f7-82be-58c7-9c42-0480cc88c498"
	defaultCliqueID    = 1
	zeroUUID           = "00000000-0000-0000-0000-000000000000"
)

// gb200 is one GPU of a GB200 superchip. NVIDIA's go-nvml mocks have no GB200; it is the B200
// mock's GPU (the same GB100 die, hence NVIDIA's B200 MIG profiles and placements) with the
// product name, PCI device id and memory a GB200 reports (nvidia-smi; pci.ids 0x2941).
var gb200 = func() gpus.Config {
	c := gpus.B200_SXM5_180GB
	c.Name = "NVIDIA GB200"
	c.PciDeviceId = 0x294110DE
	c.MemoryMB = 189471
	return c
}()

// newGB200Tray is one compute tray of a GB200 NVL72 rack: two superchips, four GPUs.
func newGB200Tray() *server.Server { return dgxb200.NewWithGPUs(gpus.Multiple(4, gb200)...) }

func init() { machines["gb200nvl72"] = newGB200Tray }

// multiNodeFabric says whether a machine's GPUs are in a multi-node NVLink domain.
func multiNodeFabric(spec string) bool {
	name, _, _ := strings.Cut(spec, ":")
	return name == "gb200nvl72"
}

// Fabric is a GPU's registration with the NVLink fabric manager, as nvmlGpuFabricInfo_t has it.
type Fabric struct {
	ClusterUUID string `json:"clusterUuid"`
	CliqueID    uint32 `json:"cliqueId"`
	State       int    `json:"state"`  // NVML_GPU_FABRIC_STATE_*
	Status      int    `json:"status"` // an nvmlReturn_t, meaningful once State is COMPLETED
}

// parseFabric reads "<cluster-uuid>/<clique-id>" or "<clique-id>" (in the default cluster).
func parseFabric(text string) (Fabric, error) {
	f := Fabric{ClusterUUID: defaultClusterUUID, CliqueID: defaultCliqueID, State: nvml.GPU_FABRIC_STATE_COMPLETED}
	if text == "" {
		return f, nil
	}
	cluster, clique, hasCluster := strings.Cut(text, "/")
	if !hasCluster {
		cluster, clique = defaultClusterUUID, text
	}
	if _, err := uuidBytes(cluster); err != nil {
		return f, fmt.Errorf("fabric %q: %v", text, err)
	}
	id, err := strconv.ParseUint(clique, 10, 32)
	if err != nil {
		return f, fmt.Errorf("fabric %q: the clique id must be a 32-bit unsigned number", text)
	}
	f.ClusterUUID, f.CliqueID = strings.ToLower(cluster), uint32(id)
	return f, nil
}

func uuidBytes(text string) ([16]byte, error) {
	var out [16]byte
	raw, err := hex.DecodeString(strings.ReplaceAll(text, "-", ""))
	if err != nil || len(raw) != 16 || len(text) != 36 {
		return out, fmt.Errorf("%q is not a UUID", text)
	}
	copy(out[:], raw)
	return out, nil
}

// initialFabric is a GPU's fabric info on a new machine; nil: NOT_SUPPORTED.
func initialFabric(spec string, c gpus.Config) (*Fabric, error) {
	if c.Architecture < nvml.DEVICE_ARCH_HOPPER {
		return nil, nil
	}
	if !multiNodeFabric(spec) {
		return &Fabric{ClusterUUID: zeroUUID, State: nvml.GPU_FABRIC_STATE_COMPLETED}, nil
	}
	f, err := parseFabric(os.Getenv(envFabric))
	return &f, err
}

// initFabric gives a new machine's GPUs their fabric info and addressing mode.
func (s *State) initFabric() error {
	for i := range s.Gpus {
		f, err := initialFabric(s.Machine, s.config(i))
		if err != nil {
			return fmt.Errorf("%s: %v", envFabric, err)
		}
		s.Gpus[i].Fabric = f
		s.Gpus[i].Addressing = "unsupported"
		if multiNodeFabric(s.Machine) {
			s.Gpus[i].Addressing = "ats" // Grace's coherent memory, ATS by default
		}
	}
	return nil
}

// fabricCall answers one fabric-info query: fill gets the GPU's fabric info.
func fabricCall(function string, device uintptr, fill func(cluster [16]byte, f *Fabric) nvml.Return) C.int {
	return gpuCall(function, device, func(s *State, gpu int) nvml.Return {
		f := s.Gpus[gpu].Fabric
		if f == nil {
			return nvml.ERROR_NOT_SUPPORTED
		}
		cluster, err := uuidBytes(f.ClusterUUID)
		if err != nil {
			return nvml.ERROR_UNKNOWN
		}
		return fill(cluster, f)
	})
}

func putUUID(dst *C.uchar, cluster [16]byte) {
	copy(unsafe.Slice((*byte)(unsafe.Pointer(dst)), 16), cluster[:])
}

// healthSummary: HEALTHY once registered, NOT_SUPPORTED before.
func healthSummary(f *Fabric) C.uchar {
	if f.State == nvml.GPU_FABRIC_STATE_COMPLETED {
		return C.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY
	}
	return C.NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED
}

//export mockDeviceGetGpuFabricInfo
func mockDeviceGetGpuFabricInfo(device uintptr, info *C.nvmlGpuFabricInfo_t) C.int {
	return fabricCall("nvmlDeviceGetGpuFabricInfo", device, func(cluster [16]byte, f *Fabric) nvml.Return {
		if info == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		putUUID(&info.clusterUuid[0], cluster)
		info.status = C.nvmlReturn_t(f.Status)
		info.cliqueId = C.uint(f.CliqueID)
		info.state = C.nvmlGpuFabricState_t(f.State)
		return nvml.SUCCESS
	})
}

// mockDeviceGetGpuFabricInfoV takes a v2 or v3 struct, told apart by its version field.
//
//export mockDeviceGetGpuFabricInfoV
func mockDeviceGetGpuFabricInfoV(device uintptr, info *C.nvmlGpuFabricInfo_v3_t) C.int {
	return fabricCall("nvmlDeviceGetGpuFabricInfoV", device, func(cluster [16]byte, f *Fabric) nvml.Return {
		if info == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		version := info.version
		if version != C.nvmlGpuFabricInfo_v2 && version != C.nvmlGpuFabricInfo_v3 {
			return nvml.ERROR_ARGUMENT_VERSION_MISMATCH
		}
		// v2 is v3 without its last field, so the common fields sit at the same offsets.
		putUUID(&info.clusterUuid[0], cluster)
		info.status = C.nvmlReturn_t(f.Status)
		info.cliqueId = C.uint(f.CliqueID)
		info.state = C.nvmlGpuFabricState_t(f.State)
		info.healthMask = 0 // every NVML_GPU_FABRIC_HEALTH_MASK_* field: NOT_SUPPORTED
		if version == C.nvmlGpuFabricInfo_v3 {
			info.healthSummary = healthSummary(f)
		}
		return nvml.SUCCESS
	})
}

//export mockDeviceGetGpuFabricInfoV4
func mockDeviceGetGpuFabricInfoV4(device uintptr, info *C.nvmlGpuFabricInfo_v4_t) C.int {
	return fabricCall("nvmlDeviceGetGpuFabricInfo_v4", device, func(cluster [16]byte, f *Fabric) nvml.Return {
		if info == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		*info = C.nvmlGpuFabricInfo_v4_t{}
		putUUID(&info.clusterUuid[0], cluster)
		info.status = C.nvmlReturn_t(f.Status)
		info.state = C.nvmlGpuFabricState_t(f.State)
		if f.ClusterUUID != zeroUUID {
			// "The legacy v3 cliqueId maps to the id of the first UNICAST_POINTER entry."
			info.cliques[0]._type = C.NVML_GPU_FABRIC_CLIQUE_TYPE_UNICAST_POINTER
			info.cliques[0].id = C.uint(f.CliqueID)
			info.numCliques = 1
		}
		info.healthSummary = healthSummary(f)
		return nvml.SUCCESS
	})
}

var addressingModes = map[string]C.uint{
	"none": C.NVML_DEVICE_ADDRESSING_MODE_NONE,
	"hmm":  C.NVML_DEVICE_ADDRESSING_MODE_HMM,
	"ats":  C.NVML_DEVICE_ADDRESSING_MODE_ATS,
}

//export mockDeviceGetAddressingMode
func mockDeviceGetAddressingMode(device uintptr, mode *C.nvmlDeviceAddressingMode_t) C.int {
	return gpuCall("nvmlDeviceGetAddressingMode", device, func(s *State, gpu int) nvml.Return {
		if mode == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		if mode.version != C.nvmlDeviceAddressingMode_v1 {
			return nvml.ERROR_ARGUMENT_VERSION_MISMATCH
		}
		value, ok := addressingModes[s.Gpus[gpu].Addressing]
		if !ok {
			return nvml.ERROR_NOT_SUPPORTED
		}
		mode.value = value
		return nvml.SUCCESS
	})
}

// gpuTargets reads args[1], a GPU's index or "all", as the GPUs a control command changes.
func (s *State) gpuTargets(args []string) ([]int, error) {
	if args[1] != "all" {
		_, n, err := s.gpuArg(args, 1)
		if err != nil {
			return nil, err
		}
		return []int{n}, nil
	}
	targets := make([]int, len(s.Gpus))
	for i := range s.Gpus {
		targets[i] = i
	}
	return targets, nil
}

// runFabric is the control command
//
//	fabric GPU|all [cluster=UUID] [clique=N] [state=unsupported|not-started|in-progress|completed] [status=CODE]
//	addressing GPU|all none|hmm|ats|unsupported
func (s *State) runFabric(args []string) (string, error) {
	if len(args) < 2 {
		return "", fmt.Errorf("%s GPU|all ...", args[0])
	}
	targets, err := s.gpuTargets(args)
	if err != nil {
		return "", err
	}
	if args[0] == "addressing" {
		if len(args) != 3 {
			return "", fmt.Errorf("addressing GPU|all none|hmm|ats|unsupported")
		}
		if _, ok := addressingModes[args[2]]; !ok && args[2] != "unsupported" {
			return "", fmt.Errorf("addressing: %q is not none, hmm, ats or unsupported", args[2])
		}
		for _, n := range targets {
			s.Gpus[n].Addressing = args[2]
		}
		return "", nil
	}
	states := map[string]int{
		"unsupported": nvml.GPU_FABRIC_STATE_NOT_SUPPORTED,
		"not-started": nvml.GPU_FABRIC_STATE_NOT_STARTED,
		"in-progress": nvml.GPU_FABRIC_STATE_IN_PROGRESS,
		"completed":   nvml.GPU_FABRIC_STATE_COMPLETED,
	}
	for _, n := range targets {
		f := Fabric{ClusterUUID: zeroUUID, State: nvml.GPU_FABRIC_STATE_COMPLETED}
		if s.Gpus[n].Fabric != nil {
			f = *s.Gpus[n].Fabric
		}
		for _, opt := range args[2:] {
			key, value, _ := strings.Cut(opt, "=")
			switch key {
			case "cluster":
				if _, err := uuidBytes(value); err != nil {
					return "", fmt.Errorf("fabric: %v", err)
				}
				f.ClusterUUID = strings.ToLower(value)
			case "clique", "status":
				v, err := strconv.ParseUint(value, 10, 32)
				if err != nil {
					return "", fmt.Errorf("fabric: %s=%q is not a number", key, value)
				}
				if key == "clique" {
					f.CliqueID = uint32(v)
				} else {
					f.Status = int(v)
				}
			case "state":
				st, ok := states[value]
				if !ok {
					return "", fmt.Errorf("fabric: state %q is not unsupported, not-started, in-progress or completed", value)
				}
				f.State = st
			default:
				return "", fmt.Errorf("fabric: option %q is not cluster=, clique=, state= or status=", opt)
			}
		}
		if f.State == nvml.GPU_FABRIC_STATE_NOT_SUPPORTED {
			s.Gpus[n].Fabric = nil // NVML answers NOT_SUPPORTED
			continue
		}
		s.Gpus[n].Fabric = &f
	}
	return "", nil
}
