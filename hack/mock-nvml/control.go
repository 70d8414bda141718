package main

// The control interface: what an administrator or the hardware does to the machine, for tests.
// Two C functions beside NVML's own, called through ctypes:
//
//	int mockNvmlConfigure(const char *machine, const char *stateDir, const char *procRoot,
//	                      const char *sysfsRoot)
//	    starts this process over on a new machine ("" = MOCK_NVML_MACHINE or dgxh100), state
//	    directory ("" = private to the process), procfs root for the capability files ("" =
//	    none) and sysfs root whose driver bindings hide GPUs off nvidia ("" = none hidden);
//	    whoever had NVML initialised in this process loses it.
//	int mockNvmlControl(const char *stateDir, const char *command, char *reply, unsigned int length)
//	    runs one command on the machine whose state is in stateDir ("" = this process's): 0 and
//	    the reply, or 1 and an error message.
//
// Commands (GPU is an index):
//
//	state                              the state as JSON
//	xid GPU XID [GI CI]                an Xid event (critical-error event type)
//	lose GPU / reset GPU / reboot      fall off the bus; a GPU reset; every GPU reset
//	timeslice GPU 0-3                  the time slice, as `nvidia-smi compute-policy --set-timeslice`
//	busy GPU on|off                    processes on the full GPU (MIG activation is IN_USE)
//	busy-gi GPU GI on|off              processes in a GPU instance (destroying it is IN_USE)
//	events GPU xid|no-xid              whether the GPU offers Xid events (supported event types)
//	mig GPU 0|1                        set MIG mode as an administrator would, reset included
//	create-gi GPU PROFILE_ID START     a GPU instance as `nvidia-smi mig -cgi` makes it
//	create-ci GPU GI CI_PROFILE        a compute instance in it (`nvidia-smi mig -cci`)
//	fail FUNCTION CODE [count=N] [gpu=N]   calls fail with nvmlReturn_t CODE
//	hang FUNCTION MS [count=N] [gpu=N]     calls block MS milliseconds first
//	clear-faults
//	fabric GPU|all [cluster=UUID] [clique=N] [state=unsupported|not-started|in-progress|completed] [status=CODE]
//	                                   the GPU's NVLink fabric registration (fabric.go)
//	addressing GPU|all none|hmm|ats|unsupported   its memory addressing mode
//	virtualization GPU|all none|passthrough|vgpu|host-vgpu|host-vsga   its virtualization mode
//	renumber on|off                    MIG-mode switches reset the GPU: its minor number changes and
//	                                   its event registrations are lost
//
// FUNCTION is the C symbol (nvmlDeviceGetMemoryInfo) or "*". Failing with code 13
// (FUNCTION_NOT_FOUND) is how an older driver that lacks the symbol looks to pynvml, which raises
// the same NVMLError_FunctionNotFound for a missing symbol and for that code.

/*
#include <stdint.h>
*/
import "C"

import (
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"unsafe"
)

//export mockNvmlConfigure
func mockNvmlConfigure(machine, stateDir, procRoot, sysfsRoot *C.char) C.int {
	procMu.Lock()
	defer procMu.Unlock()
	spec := C.GoString(machine)
	if spec == "" {
		spec = os.Getenv(envMachine)
	}
	if spec == "" {
		spec = "dgxh100"
	}
	if _, err := machineModel(spec); err != nil {
		return 1 // the process keeps the machine it had
	}
	initCount = 0 // whatever a previous user left initialised
	procSpec = spec
	procStore = &store{dir: C.GoString(stateDir), procRoot: C.GoString(procRoot), sysfsRoot: C.GoString(sysfsRoot)}
	eventSets = map[uint32]*eventSet{}
	return 0
}

//export mockNvmlControl
func mockNvmlControl(stateDir, command, reply *C.char, length C.uint) C.int {
	text, err := control(C.GoString(stateDir), C.GoString(command))
	status := C.int(0)
	if err != nil {
		text, status = err.Error(), 1
	}
	if reply != nil && length > 0 {
		buf := unsafe.Slice((*byte)(unsafe.Pointer(reply)), int(length))
		n := copy(buf[:len(buf)-1], text)
		buf[n] = 0
	}
	return status
}

func control(dir, command string) (string, error) {
	st, spec := processStore()
	if dir != "" && dir != st.dir {
		st = &store{dir: dir}
	}
	var reply string
	err := st.with(spec, func(s *State) error {
		var err error
		reply, err = s.run(strings.Fields(command))
		for gpu := range s.Gpus {
			s.syncCaps(gpu)
		}
		return err
	})
	return reply, err
}

func (s *State) gpuArg(args []string, i int) (*Gpu, int, error) {
	n, err := s.intArg(args, i)
	if err != nil {
		return nil, 0, err
	}
	if n < 0 || n >= len(s.Gpus) {
		return nil, 0, fmt.Errorf("no GPU %d (the machine has %d)", n, len(s.Gpus))
	}
	return &s.Gpus[n], n, nil
}

func (s *State) intArg(args []string, i int) (int, error) {
	if i >= len(args) {
		return 0, fmt.Errorf("%s: missing argument %d", args[0], i)
	}
	n, err := strconv.Atoi(args[i])
	if err != nil {
		return 0, fmt.Errorf("%s: %q is not a number", args[0], args[i])
	}
	return n, nil
}

func onOff(args []string, i int) (bool, error) {
	if i >= len(args) || (args[i] != "on" && args[i] != "off") {
		return false, fmt.Errorf("%s: say on or off", args[0])
	}
	return args[i] == "on", nil
}

func (s *State) run(args []string) (string, error) {
	if len(args) == 0 {
		return "", fmt.Errorf("empty command")
	}
	switch args[0] {
	case "state":
		out, err := json.MarshalIndent(s, "", " ")
		return string(out), err
	case "xid":
		g, _, err := s.gpuArg(args, 1)
		if err != nil {
			return "", err
		}
		xid, err := s.intArg(args, 2)
		if err != nil {
			return "", err
		}
		gi, ci := uint32(noInstance), uint32(noInstance)
		if len(args) >= 5 {
			a, _ := strconv.Atoi(args[3])
			b, _ := strconv.Atoi(args[4])
			gi, ci = uint32(a), uint32(b)
		}
		g.Events = append(g.Events, Event{Seq: s.next(), Type: 0x8, Data: uint64(xid), GI: gi, CI: ci})
		if len(g.Events) > 1000 {
			g.Events = g.Events[len(g.Events)-1000:]
		}
		return "", nil
	case "lose":
		g, _, err := s.gpuArg(args, 1)
		if err != nil {
			return "", err
		}
		g.Lost = true
		return "", nil
	case "reset":
		g, _, err := s.gpuArg(args, 1)
		if err != nil {
			return "", err
		}
		g.reset()
		return "", nil
	case "reboot":
		for i := range s.Gpus {
			s.Gpus[i].reset()
			s.Gpus[i].Events = nil
		}
		return "", nil
	case "timeslice":
		return s.setTimeSlice(args)
	case "busy":
		g, _, err := s.gpuArg(args, 1)
		if err != nil {
			return "", err
		}
		g.Busy, err = onOff(args, 2)
		return "", err
	case "events":
		g, _, err := s.gpuArg(args, 1)
		if err != nil {
			return "", err
		}
		if len(args) < 3 || (args[2] != "xid" && args[2] != "no-xid") {
			return "", fmt.Errorf("events: xid or no-xid")
		}
		g.NoXidEvents = args[2] == "no-xid"
		return "", nil
	case "busy-gi":
		g, _, err := s.gpuArg(args, 1)
		if err != nil {
			return "", err
		}
		id, err := s.intArg(args, 2)
		if err != nil {
			return "", err
		}
		gi := g.instance(uint32(id))
		if gi == nil {
			return "", fmt.Errorf("no GPU instance %d", id)
		}
		gi.Busy, err = onOff(args, 3)
		return "", err
	case "mig":
		g, n, err := s.gpuArg(args, 1)
		if err != nil {
			return "", err
		}
		mode, err := s.intArg(args, 2)
		if err != nil || mode < 0 || mode > 1 {
			return "", fmt.Errorf("mig: mode is 0 or 1")
		}
		if !migCapable(s.config(n)) {
			return "", fmt.Errorf("GPU %d cannot do MIG", n)
		}
		g.MigPending = mode
		g.reset()
		return "", nil
	case "create-gi":
		g, n, err := s.gpuArg(args, 1)
		if err != nil {
			return "", err
		}
		profile, err1 := s.intArg(args, 2)
		start, err2 := s.intArg(args, 3)
		if err1 != nil || err2 != nil {
			return "", fmt.Errorf("create-gi GPU PROFILE_ID START")
		}
		p, ok := s.profileByID(n, uint32(profile))
		if !ok || g.MigCurrent != 1 {
			return "", fmt.Errorf("GPU %d: MIG mode off, or no profile %d", n, profile)
		}
		key, _ := s.profileKey(n, uint32(profile))
		for _, pl := range s.config(n).MIGProfiles.GpuInstancePlacements[key] {
			if int(pl.Start) == start {
				want := Placement{pl.Start, pl.Size}
				for _, gi := range g.Instances {
					if gi.Placement.overlaps(want) {
						return "", fmt.Errorf("placement %d overlaps GPU instance %d", start, gi.ID)
					}
				}
				id := uint32(1)
				for g.instance(id) != nil {
					id++
				}
				g.Instances = append(g.Instances, GpuInstance{ID: id, ProfileID: p.Id, Placement: want, ComputeInstances: []ComputeInstance{}})
				return strconv.Itoa(int(id)), nil
			}
		}
		return "", fmt.Errorf("profile %d has no placement at %d", profile, start)
	case "create-ci":
		g, n, err := s.gpuArg(args, 1)
		if err != nil {
			return "", err
		}
		giID, err1 := s.intArg(args, 2)
		ciProfile, err2 := s.intArg(args, 3)
		if err1 != nil || err2 != nil {
			return "", fmt.Errorf("create-ci GPU GI CI_PROFILE")
		}
		gi := g.instance(uint32(giID))
		if gi == nil {
			return "", fmt.Errorf("no GPU instance %d", giID)
		}
		key, _ := s.profileKey(n, gi.ProfileID)
		for _, want := range s.computePlacements(n, key, ciProfile) {
			free := true
			for _, ci := range gi.ComputeInstances {
				free = free && !ci.Placement.overlaps(want)
			}
			if free {
				id := uint32(0)
				for gi.compute(id) != nil {
					id++
				}
				uuid := "MIG-" + stableUUID(g.UUID+"/mig/"+itoa(s.next()))
				gi.ComputeInstances = append(gi.ComputeInstances, ComputeInstance{ID: id, ProfileID: uint32(ciProfile), Placement: want, UUID: uuid})
				return uuid, nil
			}
		}
		return "", fmt.Errorf("no room for compute-instance profile %d in GPU instance %d", ciProfile, giID)
	case "fail", "hang":
		if len(args) < 3 {
			return "", fmt.Errorf("%s FUNCTION VALUE [count=N] [gpu=N]", args[0])
		}
		value, err := s.intArg(args, 2)
		if err != nil {
			return "", err
		}
		f := Fault{Function: args[1], GPU: -1}
		if args[0] == "fail" {
			f.Code = value
		} else {
			f.HangMS = value
		}
		for _, opt := range args[3:] {
			key, val, _ := strings.Cut(opt, "=")
			n, err := strconv.Atoi(val)
			if err != nil || (key != "count" && key != "gpu") {
				return "", fmt.Errorf("%s: option %q is not count=N or gpu=N", args[0], opt)
			}
			if key == "count" {
				f.Count = n
			} else {
				f.GPU = n
			}
		}
		s.Faults = append(s.Faults, f)
		return "", nil
	case "fabric", "addressing":
		return s.runFabric(args)
	case "virtualization":
		return s.runVirtualization(args)
	case "nvlink":
		return s.runNvLink(args)
	case "clear-faults":
		s.Faults = nil
		return "", nil
	case "renumber":
		on, err := onOff(args, 1)
		s.RenumberOnMigSwitch = on
		return "", err
	}
	return "", fmt.Errorf("unknown command %q", args[0])
}
