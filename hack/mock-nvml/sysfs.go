package main

// Which GPUs NVML sees. On a host, a GPU unbound from the nvidia kernel driver (bound to vfio-pci
// for a virtual machine, or to nothing half-way through a move) is gone from NVML: the device
// count leaves it out, the others are numbered without it, and its UUID is found no more. The
// mock reads the same from the machine's sysfs tree (MOCK_NVML_SYSFS_ROOT, a directory the tests
// build and the driver binds in, as dra_driver.devices.pci does on /sys). A GPU the tree does not
// hold counts as on nvidia, so a machine without a tree is as before.

import (
	"os"
	"path/filepath"
	"strings"
)

const nvidiaDriver = "nvidia"

// sysfsAddress is the GPU's directory name under bus/pci/devices: "0000:18:00.0" for NVML's
// "00000000:18:00.0".
func sysfsAddress(busID string) string {
	domain, rest, _ := strings.Cut(strings.ToLower(busID), ":")
	if len(domain) > 4 {
		domain = domain[len(domain)-4:]
	}
	return domain + ":" + rest
}

// onNvidia says whether the nvidia driver holds the GPU, as NVML needs it to.
func (s *State) onNvidia(gpu int) bool {
	if s.SysfsRoot == "" {
		return true
	}
	device := filepath.Join(s.SysfsRoot, "bus", "pci", "devices", sysfsAddress(s.Gpus[gpu].BusID))
	if _, err := os.Stat(device); err != nil {
		return true
	}
	driver, err := os.Readlink(filepath.Join(device, "driver"))
	return err == nil && filepath.Base(driver) == nvidiaDriver
}

// visibleGpus are the positions of the GPUs NVML sees, in NVML's index order.
func (s *State) visibleGpus() []int {
	visible := make([]int, 0, len(s.Gpus))
	for gpu := range s.Gpus {
		if s.onNvidia(gpu) {
			visible = append(visible, gpu)
		}
	}
	return visible
}
