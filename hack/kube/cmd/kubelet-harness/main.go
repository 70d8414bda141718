// Command kubelet-harness is the kubelet side of a DRA driver test, for real: it runs the
// kubelet's own DRA manager (pkg/kubelet/cm/dra) and plugin manager (pkg/kubelet/pluginmanager)
// for one simulated node, without a container runtime. It registers DRA plugins through the
// real registration handshake, keeps its Node Ready, prepares the claims of the pods bound to
// its node before "starting" them, records the CDI device ids the runtime would receive and
// unprepares the claims when the pods go away. See README.md for what tests can observe.
package main

import (
	"context"
	"errors"
	goflag "flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/pflag"

	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/klog/v2"

	// Registers the kubelet's feature gates (DRAExtendedResource, ResourceHealthStatus, ...)
	// with utilfeature.DefaultMutableFeatureGate, which the DRA manager consults.
	_ "k8s.io/kubernetes/pkg/features"
)

// options are the command line settings; every path is a parameter so that tests never touch
// the machine's /var/lib/kubelet and several harnesses can run side by side.
type options struct {
	kubeconfig        string
	nodeName          string
	registryDir       string
	stateDir          string
	nodeLabels        map[string]string
	heartbeatInterval time.Duration
}

func parseFlags(args []string) (options, error) {
	var opts options
	fs := pflag.NewFlagSet("kubelet-harness", pflag.ContinueOnError)
	fs.StringVar(&opts.kubeconfig, "kubeconfig", "", "kubeconfig of the API server (required)")
	fs.StringVar(&opts.nodeName, "node-name", "", "name of the Node this harness plays the kubelet of (required)")
	fs.StringVar(&opts.registryDir, "plugins-registry-dir", "",
		"directory watched for plugin registration sockets, the kubelet's plugins_registry (required)")
	fs.StringVar(&opts.stateDir, "state-dir", "",
		"directory of the DRA manager's checkpoint (dra_manager_state), the kubelet's root dir (required)")
	fs.StringToStringVar(&opts.nodeLabels, "node-labels", nil,
		"labels of the Node when the harness has to create it, key=value,...")
	fs.DurationVar(&opts.heartbeatInterval, "heartbeat-interval", 10*time.Second,
		"how often the Node's Ready condition is refreshed (the kubelet's nodeStatusUpdateFrequency)")
	utilfeature.DefaultMutableFeatureGate.AddFlag(fs)

	klogFlags := goflag.NewFlagSet("klog", goflag.ContinueOnError)
	klog.InitFlags(klogFlags)
	fs.AddGoFlag(klogFlags.Lookup("v"))
	fs.AddGoFlag(klogFlags.Lookup("vmodule"))

	if err := fs.Parse(args); err != nil {
		return opts, err
	}
	if fs.NArg() > 0 {
		return opts, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	for _, required := range []string{"kubeconfig", "node-name", "plugins-registry-dir", "state-dir"} {
		if fs.Lookup(required).Value.String() == "" {
			return opts, fmt.Errorf("--%s is required", required)
		}
	}
	if opts.heartbeatInterval <= 0 {
		return opts, fmt.Errorf("--heartbeat-interval must be positive, got %s", opts.heartbeatInterval)
	}
	return opts, nil
}

func main() {
	opts, err := parseFlags(os.Args[1:])
	if errors.Is(err, pflag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "kubelet-harness: %v (see --help)\n", err)
		os.Exit(2)
	}

	// Every log line names the node: several harnesses may log side by side.
	logger := klog.Background().WithName("kubelet-harness").WithValues("node", opts.nodeName)
	ctx, stop := signal.NotifyContext(klog.NewContext(context.Background(), logger), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	err = run(ctx, opts)
	klog.Flush()
	if err != nil {
		fmt.Fprintf(os.Stderr, "kubelet-harness: %v\n", err)
		os.Exit(1)
	}
}
