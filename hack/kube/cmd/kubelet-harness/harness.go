package main

import (
	"context"
	"fmt"
	"os"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
	pluginwatcherapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
)

// podWorkers is how many pods are started or stopped at the same time; the kubelet has one
// worker per pod, a handful is plenty for a test node.
const podWorkers = 4

// run wires the kubelet's DRA machinery the way pkg/kubelet does (kubelet.go,
// cm/container_manager_linux.go) and blocks until ctx is cancelled.
func run(ctx context.Context, opts options) error {
	logger := klog.FromContext(ctx)

	restConfig, err := clientcmd.BuildConfigFromFlags("", opts.kubeconfig)
	if err != nil {
		return fmt.Errorf("load --kubeconfig %s: %w", opts.kubeconfig, err)
	}
	restConfig.UserAgent = "kubelet-harness/" + opts.nodeName
	restConfig.QPS, restConfig.Burst = 50, 100
	client, err := kubernetes.NewForConfig(restConfig)
	if err != nil {
		return fmt.Errorf("create API client: %w", err)
	}
	if err := os.MkdirAll(opts.stateDir, 0o750); err != nil {
		return fmt.Errorf("create --state-dir: %w", err)
	}

	// Events look like the kubelet's: component "kubelet", host = the node.
	broadcaster := record.NewBroadcaster(record.WithContext(ctx))
	defer broadcaster.Shutdown()
	broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	recorder := broadcaster.NewRecorder(scheme.Scheme, v1.EventSource{Component: "kubelet", Host: opts.nodeName})

	// The node must exist before anything else: the DRA manager wipes the node's
	// ResourceSlices at start and the scheduler places pods only on Ready nodes.
	node := &nodeKeeper{client: client, name: opts.nodeName, labels: opts.nodeLabels}
	if err := node.heartbeat(ctx); err != nil {
		return fmt.Errorf("register Node %s: %w", opts.nodeName, err)
	}

	draManager, err := dra.NewManager(logger, client, opts.stateDir)
	if err != nil {
		return fmt.Errorf("create DRA manager with --state-dir %s: %w", opts.stateDir, err)
	}
	defer stopDRAManager(draManager)

	informerFactory := informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", opts.nodeName).String()
		}))
	defer informerFactory.Shutdown()
	podInformer := informerFactory.Core().V1().Pods().Informer()
	pods := newPodController(client, draManager, recorder)
	if _, err := podInformer.AddEventHandler(pods.eventHandler()); err != nil {
		return fmt.Errorf("watch pods: %w", err)
	}

	// The kubelet's only pod source here is the API server: the sources are ready once the
	// pod informer has synced. Until then the DRA manager's reconcile loop must not treat
	// checkpointed claims of not-yet-seen pods as orphaned.
	sourcesReady := config.NewSourcesReady(func(sets.Set[string]) bool { return podInformer.HasSynced() })
	if err := draManager.Start(ctx, pods.activePods, getNodeFunc(ctx, node.get), sourcesReady); err != nil {
		return fmt.Errorf("start DRA manager: %w", err)
	}

	pluginManager := pluginmanager.NewPluginManager(opts.registryDir, recorder)
	pluginManager.AddHandler(pluginwatcherapi.DRAPlugin, draManager.GetWatcherHandler())
	go runPluginManager(ctx, pluginManager, sourcesReady)

	informerFactory.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), podInformer.HasSynced) {
		return nil // Stopped by a signal before the pods were listed.
	}

	go node.keepReady(ctx, opts.heartbeatInterval)
	go pods.followHealthUpdates(ctx)
	logger.Info("Kubelet harness running", "pluginsRegistryDir", opts.registryDir, "stateDir", opts.stateDir)
	pods.run(ctx, podWorkers)
	logger.Info("Kubelet harness stopping; prepared claims stay prepared, as on a kubelet restart")
	return nil
}
