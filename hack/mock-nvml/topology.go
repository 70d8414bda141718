package main

// NVLink (nvmlDeviceGetNvLinkState, ...RemotePciInfo_v2, ...RemoteDeviceType), and the two PCIe
// servers whose GPUs are linked otherwise than through NVSwitches.
//
// What each machine's links lead to, as `nvidia-smi nvlink -R` would list them:
//   - dgxa100 (12 links per GPU), dgxh100, dgxh200, dgxb200 (18): the baseboard's NVSwitches, four
//     PCI devices of the host; every GPU reaches every other through them (all-to-all);
//   - gb200nvl72 (18): the NVLink switches of the rack's switch trays, which are no PCI devices of
//     this host: the remote PCI info is NOT_SUPPORTED, the remote device type SWITCH;
//   - pcieh100nvl: eight H100 NVL PCIe cards, NVLink bridges joining 0-1, 2-3, 4-5 and 6-7 (12 links
//     each, the remote device type GPU, the remote PCI info the partner's);
//   - l40s: four L40S without NVLink: every NVLink call is NOT_SUPPORTED.
// Links past a GPU's last are INVALID_ARGUMENT, as NVML answers. The control command
//   nvlink GPU LINK|all up|down
// takes links down (a bridge pulled, a link that failed training) and up again.

/*
#cgo CFLAGS: -DNVML_NO_UNVERSIONED_FUNC_DEFS
#include <stdint.h>
#include "nvml.h"
*/
import "C"

import (
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// h100NVL is NVIDIA's H100 NVL PCIe card: the H100 mock's GPU (its MIG profiles) with the name, PCI
// device id (pci.ids 0x2321) and memory the card reports.
var h100NVL = func() gpus.Config {
	c := gpus.H100_SXM5_80GB
	c.Name = "NVIDIA H100 NVL"
	c.PciDeviceId = 0x232110DE
	c.MemoryMB = 95830
	return c
}()

// l40s has no go-nvml mock: the values nvidia-smi reports for it (pci.ids 0x26b9); no MIG.
var l40s = gpus.Config{
	Name:         "NVIDIA L40S",
	Architecture: nvml.DEVICE_ARCH_ADA,
	Brand:        nvml.BRAND_NVIDIA,
	MemoryMB:     46068,
	CudaMajor:    8,
	CudaMinor:    9,
	PciDeviceId:  0x26B910DE,
}

func init() {
	machines["pcieh100nvl"] = func() *server.Server { return dgxh100.NewWithGPUs(gpus.Multiple(8, h100NVL)...) }
	machines["l40s"] = func() *server.Server { return dgxh100.NewWithGPUs(gpus.Multiple(4, l40s)...) }
}

// nvSwitchBusIDs are the baseboard NVSwitches of the DGX machines, as the host's PCI devices.
var nvSwitchBusIDs = []string{"00000000:05:00.0", "00000000:06:00.0", "00000000:07:00.0", "00000000:08:00.0"}

// linkEnd is what one NVLink leads to; busID "" when NVML has no PCI address for it.
type linkEnd struct {
	kind  nvml.IntNvLinkDeviceType
	busID string
}

// nvlinks lists the far end of each of the GPU's links; nil: the GPU has no NVLink.
func (s *State) nvlinks(gpu int) []linkEnd {
	name, _, _ := strings.Cut(s.Machine, ":")
	var links []linkEnd
	switch name {
	case "dgxa100", "dgxh100", "dgxh200", "dgxb200":
		count := 18
		if name == "dgxa100" {
			count = 12
		}
		for l := 0; l < count; l++ {
			links = append(links, linkEnd{nvml.NVLINK_DEVICE_TYPE_SWITCH, nvSwitchBusIDs[l%len(nvSwitchBusIDs)]})
		}
	case "gb200nvl72":
		for l := 0; l < 18; l++ {
			links = append(links, linkEnd{nvml.NVLINK_DEVICE_TYPE_SWITCH, ""})
		}
	case "pcieh100nvl":
		partner := gpu ^ 1
		if partner >= len(s.Gpus) {
			return []linkEnd{} // a machine cut to an odd count (":N"): the last card's bridge leads nowhere
		}
		for l := 0; l < 12; l++ {
			links = append(links, linkEnd{nvml.NVLINK_DEVICE_TYPE_GPU, s.Gpus[partner].BusID})
		}
	}
	return links
}

// nvlinkCall answers one query about one link: fill gets the link's far end.
func nvlinkCall(function string, device uintptr, link C.uint, fill func(end linkEnd, up bool) nvml.Return) C.int {
	return gpuCall(function, device, func(s *State, gpu int) nvml.Return {
		links := s.nvlinks(gpu)
		if links == nil {
			return nvml.ERROR_NOT_SUPPORTED
		}
		if int(link) >= len(links) {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		return fill(links[link], !s.Gpus[gpu].linkDown(uint32(link)))
	})
}

func (g *Gpu) linkDown(link uint32) bool {
	for _, l := range g.NvLinksDown {
		if l == link {
			return true
		}
	}
	return false
}

//export mockDeviceGetNvLinkState
func mockDeviceGetNvLinkState(device uintptr, link C.uint, active *C.nvmlEnableState_t) C.int {
	return nvlinkCall("nvmlDeviceGetNvLinkState", device, link, func(_ linkEnd, up bool) nvml.Return {
		if active == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		*active = C.NVML_FEATURE_DISABLED
		if up {
			*active = C.NVML_FEATURE_ENABLED
		}
		return nvml.SUCCESS
	})
}

//export mockDeviceGetNvLinkRemotePciInfo
func mockDeviceGetNvLinkRemotePciInfo(device uintptr, link C.uint, pci *C.nvmlPciInfo_t) C.int {
	return nvlinkCall("nvmlDeviceGetNvLinkRemotePciInfo_v2", device, link, func(end linkEnd, _ bool) nvml.Return {
		if pci == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		if end.busID == "" {
			return nvml.ERROR_NOT_SUPPORTED
		}
		*pci = C.nvmlPciInfo_t{}
		for i := 0; i < len(end.busID) && i < len(pci.busId)-1; i++ {
			pci.busId[i] = C.char(end.busID[i])
		}
		return nvml.SUCCESS
	})
}

//export mockDeviceGetNvLinkRemoteDeviceType
func mockDeviceGetNvLinkRemoteDeviceType(device uintptr, link C.uint, kind *C.nvmlIntNvLinkDeviceType_t) C.int {
	return nvlinkCall("nvmlDeviceGetNvLinkRemoteDeviceType", device, link, func(end linkEnd, _ bool) nvml.Return {
		if kind == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		*kind = C.nvmlIntNvLinkDeviceType_t(end.kind)
		return nvml.SUCCESS
	})
}

// runNvLink is the control command `nvlink GPU LINK|all up|down`.
func (s *State) runNvLink(args []string) (string, error) {
	if len(args) != 4 || (args[3] != "up" && args[3] != "down") {
		return "", fmt.Errorf("nvlink GPU LINK|all up|down")
	}
	g, n, err := s.gpuArg(args, 1)
	if err != nil {
		return "", err
	}
	count := len(s.nvlinks(n))
	targets := []uint32{}
	if args[2] == "all" {
		for l := 0; l < count; l++ {
			targets = append(targets, uint32(l))
		}
	} else {
		l, err := strconv.Atoi(args[2])
		if err != nil || l < 0 || l >= count {
			return "", fmt.Errorf("nvlink: GPU %d has links 0..%d, not %q", n, count-1, args[2])
		}
		targets = append(targets, uint32(l))
	}
	down := map[uint32]bool{}
	for _, l := range g.NvLinksDown {
		down[l] = true
	}
	for _, l := range targets {
		down[l] = args[3] == "down"
	}
	g.NvLinksDown = nil
	for l, isDown := range down {
		if isDown {
			g.NvLinksDown = append(g.NvLinksDown, l)
		}
	}
	sort.Slice(g.NvLinksDown, func(i, j int) bool { return g.NvLinksDown[i] < g.NvLinksDown[j] })
	return "", nil
}
