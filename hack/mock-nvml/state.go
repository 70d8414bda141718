package main

// The simulated machine: which GPUs it has (from NVIDIA's go-nvml mocks) and what has been done
// to them (MIG mode, GPU and compute instances, injected faults). The state is plain data so it
// can live in a JSON file shared by every process that loads the library (the driver, a test, a
// restarted driver), the way the hardware is shared; without a state directory it lives in this
// process only.

import (
	"bytes"
	"crypto/sha1"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxb200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

const (
	envMachine  = "MOCK_NVML_MACHINE"   // dgxh100 (default), dgxh200, dgxa100, dgxb200, gb200nvl72, pcieh100nvl, l40s; ":N" keeps N GPUs
	envStateDir = "MOCK_NVML_STATE_DIR" // where the state file lives; unset: private to the process
	envProcRoot = "MOCK_NVML_PROC_ROOT" // where the kernel driver's /proc files go (nvidia-caps minors)
	// The host's sysfs: a GPU whose PCI device there is bound to another driver (vfio-pci) is gone
	// from NVML's view, as on a host (sysfs.go).
	envSysfsRoot = "MOCK_NVML_SYSFS_ROOT"
	stateFile    = "state.json"
	lockFile     = "state.lock"
	// A GPU's minor number after a MIG-mode switch that renumbers it (see State.RenumberOnMigSwitch).
	renumberOffset = 64
)

type Placement struct {
	Start uint32 `json:"start"`
	Size  uint32 `json:"size"`
}

func (p Placement) overlaps(o Placement) bool {
	return p.Start < o.Start+o.Size && o.Start < p.Start+p.Size
}

type ComputeInstance struct {
	ID        uint32    `json:"id"`
	ProfileID uint32    `json:"profileId"`
	Placement Placement `json:"placement"`
	UUID      string    `json:"uuid"`
}

type GpuInstance struct {
	ID               uint32            `json:"id"`
	ProfileID        uint32            `json:"profileId"`
	Placement        Placement         `json:"placement"`
	ComputeInstances []ComputeInstance `json:"computeInstances"`
	Busy             bool              `json:"busy,omitempty"` // processes run in it: destroy is IN_USE
}

type Event struct {
	Seq  uint64 `json:"seq"`
	Type uint64 `json:"type"`
	Data uint64 `json:"data"`
	GI   uint32 `json:"gi"`
	CI   uint32 `json:"ci"`
}

type Gpu struct {
	UUID       string        `json:"uuid"`
	Minor      int           `json:"minor"`
	BusID      string        `json:"busId"`
	MigCurrent int           `json:"migCurrent"`
	MigPending int           `json:"migPending"`
	Busy       bool          `json:"busy,omitempty"` // processes on the full GPU: MIG activation is IN_USE
	Lost       bool          `json:"lost,omitempty"` // fallen off the bus: every call is GPU_IS_LOST
	Instances  []GpuInstance `json:"gpuInstances"`
	Events     []Event       `json:"events,omitempty"`
	Fabric     *Fabric       `json:"fabric,omitempty"`     // nil: fabric info NOT_SUPPORTED (fabric.go)
	Addressing string        `json:"addressing,omitempty"` // none, hmm, ats; else NOT_SUPPORTED
	// nvmlDeviceGetVirtualizationMode (virtualization.go): none, passthrough, vgpu, ...; "": none.
	Virtualization string `json:"virtualization,omitempty"`

	// Compute mode (nvmlComputeMode_t) and time slice (0-3) of compute.go.
	ComputeMode int `json:"computeMode,omitempty"`
	TimeSlice   int `json:"timeSlice,omitempty"`

	// No Xid events: nvmlDeviceGetSupportedEventTypes leaves the Xid bit out (the `events` command).
	NoXidEvents bool `json:"noXidEvents,omitempty"`

	NvLinksDown []uint32 `json:"nvlinksDown,omitempty"` // links taken down (topology.go)
}

// Fault makes calls of one NVML function fail with Code, or hang for HangMS first.
type Fault struct {
	Function string `json:"function"`
	Code     int    `json:"code,omitempty"`
	HangMS   int    `json:"hangMs,omitempty"`
	GPU      int    `json:"gpu"`             // -1: any GPU (and calls without one)
	Count    int    `json:"count,omitempty"` // 0: until cleared; else this many calls
}

type State struct {
	Machine       string `json:"machine"`
	DriverVersion string `json:"driverVersion"`
	CudaVersion   int    `json:"cudaVersion"`
	// Real NVML: SetMigMode "may unbind or reset the device ... attributes such as minor number
	// might change". When set, every successful switch renumbers the GPU, so callers must re-read.
	RenumberOnMigSwitch bool `json:"renumberOnMigSwitch,omitempty"`
	// The procfs root the kernel driver's capability files are written under, as the driver does
	// when it creates GPU and compute instances ("": none written).
	ProcRoot string `json:"procRoot,omitempty"`
	// The sysfs root whose driver bindings say which GPUs NVML sees ("": all of them).
	SysfsRoot string  `json:"sysfsRoot,omitempty"`
	Gpus      []Gpu   `json:"gpus"`
	Faults    []Fault `json:"faults,omitempty"`
	Serial    uint64  `json:"serial"` // for MIG uuids and event sequence numbers
}

// machines are the systems NVIDIA's go-nvml mocks define, by the name MOCK_NVML_MACHINE takes.
var machines = map[string]func() *server.Server{
	"dgxh100": dgxh100.New,
	"dgxh200": dgxh200.New,
	"dgxa100": dgxa100.New,
	"dgxb200": dgxb200.New,
}

// model is the static description of the GPUs of a machine, never stored: it is NVIDIA's data.
type model struct {
	configs       []gpus.Config
	driverVersion string
	cudaVersion   int
}

var modelCache sync.Map // machine spec -> *model

func machineModel(spec string) (*model, error) {
	if m, ok := modelCache.Load(spec); ok {
		return m.(*model), nil
	}
	name, countText, hasCount := strings.Cut(spec, ":")
	build, ok := machines[name]
	if !ok {
		known := make([]string, 0, len(machines))
		for k := range machines {
			known = append(known, k)
		}
		sort.Strings(known)
		return nil, fmt.Errorf("unknown machine %q (known: %s)", name, strings.Join(known, ", "))
	}
	srv := build()
	m := &model{driverVersion: srv.DriverVersion, cudaVersion: srv.CudaDriverVersion}
	for _, d := range srv.Devices {
		m.configs = append(m.configs, d.(*server.Device).Config)
	}
	if hasCount {
		count, err := strconv.Atoi(countText)
		if err != nil || count < 0 || count > len(m.configs) {
			return nil, fmt.Errorf("machine %q: GPU count must be 0..%d", spec, len(m.configs))
		}
		m.configs = m.configs[:count]
	}
	modelCache.Store(spec, m)
	return m, nil
}

// stableUUID derives a UUID from text, so a machine's GPUs keep their identity across runs.
func stableUUID(text string) string {
	h := sha1.Sum([]byte(text))
	h[6] = h[6]&0x0f | 0x50
	h[8] = h[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", h[0:4], h[4:6], h[6:8], h[8:10], h[10:16])
}

func newState(spec, procRoot, sysfsRoot string) (*State, error) {
	m, err := machineModel(spec)
	if err != nil {
		return nil, err
	}
	s := &State{Machine: spec, DriverVersion: m.driverVersion, CudaVersion: m.cudaVersion, ProcRoot: procRoot, SysfsRoot: sysfsRoot}
	for i := range m.configs {
		s.Gpus = append(s.Gpus, Gpu{
			UUID:      "GPU-" + stableUUID(fmt.Sprintf("%s/%d", spec, i)),
			Minor:     i,
			BusID:     fmt.Sprintf("00000000:%02X:00.0", 0x18+0x10*i),
			Instances: []GpuInstance{},
		})
	}
	if err := s.initFabric(); err != nil {
		return nil, err
	}
	return s, nil
}

func (s *State) model() *model {
	m, err := machineModel(s.Machine)
	if err != nil {
		panic(err) // a state file is only ever written for a known machine
	}
	return m
}

func (s *State) config(gpu int) gpus.Config { return s.model().configs[gpu] }

func (s *State) next() uint64 {
	s.Serial++
	return s.Serial
}

// --- where the state lives --------------------------------------------------------------------

// store is one state: in this process, or in a directory shared with other processes.
type store struct {
	mu        sync.Mutex
	dir       string // "" = in memory
	procRoot  string // for a new state
	sysfsRoot string // for a new state
	memory    *State
	cached    []byte // the file's bytes when `parsed` was decoded from them
	parsed    *State
}

// with runs fn on the current state under the store's locks and saves it if fn changed it.
func (st *store) with(spec string, fn func(*State) error) error {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.dir == "" {
		if st.memory == nil {
			s, err := newState(spec, st.procRoot, st.sysfsRoot)
			if err != nil {
				return err
			}
			st.memory = s
		}
		return fn(st.memory)
	}
	if err := os.MkdirAll(st.dir, 0o755); err != nil {
		return err
	}
	lock, err := os.OpenFile(filepath.Join(st.dir, lockFile), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return err
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return err
	}
	defer syscall.Flock(int(lock.Fd()), syscall.LOCK_UN) //nolint:errcheck
	path := filepath.Join(st.dir, stateFile)
	data, err := os.ReadFile(path)
	var s *State
	switch {
	case os.IsNotExist(err):
		if s, err = newState(spec, st.procRoot, st.sysfsRoot); err != nil {
			return err
		}
	case err != nil:
		return err
	case st.parsed != nil && bytes.Equal(data, st.cached):
		s = st.parsed
	default:
		s = &State{}
		if err := json.Unmarshal(data, s); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		if _, err := machineModel(s.Machine); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
	}
	before := data
	fnErr := fn(s)
	after, err := json.MarshalIndent(s, "", " ")
	if err != nil {
		return err
	}
	if !bytes.Equal(before, after) {
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, after, 0o644); err != nil {
			return err
		}
		if err := os.Rename(tmp, path); err != nil {
			return err
		}
	}
	st.cached, st.parsed = after, s
	return fnErr
}

// --- MIG bookkeeping -----------------------------------------------------------------------------

func (g *Gpu) instance(id uint32) *GpuInstance {
	for i := range g.Instances {
		if g.Instances[i].ID == id {
			return &g.Instances[i]
		}
	}
	return nil
}

func (gi *GpuInstance) compute(id uint32) *ComputeInstance {
	for i := range gi.ComputeInstances {
		if gi.ComputeInstances[i].ID == id {
			return &gi.ComputeInstances[i]
		}
	}
	return nil
}

// migDevices lists (GPU instance, compute instance) pairs in NVML's order: by GI id, then CI id.
func (g *Gpu) migDevices() [][2]uint32 {
	var out [][2]uint32
	sorted := append([]GpuInstance(nil), g.Instances...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].ID < sorted[j].ID })
	for _, gi := range sorted {
		cis := append([]ComputeInstance(nil), gi.ComputeInstances...)
		sort.Slice(cis, func(i, j int) bool { return cis[i].ID < cis[j].ID })
		for _, ci := range cis {
			out = append(out, [2]uint32{gi.ID, ci.ID})
		}
	}
	return out
}

// reset is what a GPU reset (or a reboot) does: the pending MIG mode becomes current, every
// GPU and compute instance is gone, and a lost GPU answers again.
func (g *Gpu) reset() {
	g.MigCurrent = g.MigPending
	g.Instances = []GpuInstance{}
	g.Lost = false
	g.Busy = false
	g.ComputeMode, g.TimeSlice = 0, 0 // compute.go: neither survives a reset
}

func migCapable(c gpus.Config) bool { return len(c.MIGProfiles.GpuInstanceProfiles) > 0 }

func requiresReset(c gpus.Config) bool { return c.Architecture < nvml.DEVICE_ARCH_HOPPER }

// --- the kernel driver's capability files -----------------------------------------------------

// capMinor is the nvidia-caps minor of a GPU instance (ci < 0) or compute instance.
func capMinor(gpuMinor int, gi uint32, ci int) int {
	return 1000 + 200*gpuMinor + 10*int(gi) + ci + 1
}

func (s *State) capsDir(gpu int, gi uint32) string {
	return filepath.Join(s.ProcRoot, "driver", "nvidia", "capabilities",
		fmt.Sprintf("gpu%d", s.Gpus[gpu].Minor), "mig", fmt.Sprintf("gi%d", gi))
}

func writeAccess(path string, minor int) {
	_ = os.MkdirAll(filepath.Dir(path), 0o755)
	_ = os.WriteFile(path, []byte(fmt.Sprintf("DeviceFileMinor: %d\nDeviceFileMode: 292\nDeviceFileModify: 1\n", minor)), 0o644)
}

// syncCaps makes the capability files match the GPU's instances, as the kernel driver keeps them.
func (s *State) syncCaps(gpu int) {
	if s.ProcRoot == "" {
		return
	}
	g := &s.Gpus[gpu]
	root := filepath.Join(s.ProcRoot, "driver", "nvidia", "capabilities", fmt.Sprintf("gpu%d", g.Minor), "mig")
	_ = os.RemoveAll(root)
	for _, gi := range g.Instances {
		dir := s.capsDir(gpu, gi.ID)
		writeAccess(filepath.Join(dir, "access"), capMinor(g.Minor, gi.ID, -1))
		for _, ci := range gi.ComputeInstances {
			writeAccess(filepath.Join(dir, fmt.Sprintf("ci%d", ci.ID), "access"), capMinor(g.Minor, gi.ID, int(ci.ID)))
		}
	}
}
