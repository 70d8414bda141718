package main

// The few places where the kubelet's DRA manager API differs between the Kubernetes releases the
// harness is built against (1.34 - 1.37, see hack/versions.env and KUBE_VERSION). Calls go through
// interfaces, so one source tree compiles against each release without build tags.

import (
	"context"
	"reflect"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/pkg/kubelet/config"
)

// getNodeFunc adapts get to dra.GetNodeFunc, which takes a context from 1.36 and none before (then
// ctx, the harness's own, is used). The function type is built by reflection because no single Go
// function value has both types.
func getNodeFunc(ctx context.Context, get func(context.Context) (*v1.Node, error)) dra.GetNodeFunc {
	var adapted dra.GetNodeFunc
	fnType := reflect.TypeOf(adapted)
	impl := reflect.MakeFunc(fnType, func(args []reflect.Value) []reflect.Value {
		callCtx := ctx
		if len(args) == 1 {
			callCtx = args[0].Interface().(context.Context)
		}
		node, err := get(callCtx)
		errValue := reflect.Zero(fnType.Out(1))
		if err != nil {
			errValue = reflect.ValueOf(err)
		}
		return []reflect.Value{reflect.ValueOf(node), errValue}
	})
	reflect.ValueOf(&adapted).Elem().Set(impl)
	return adapted
}

// stopDRAManager stops the manager's background work. Manager.Stop exists from 1.37; before it the
// manager's goroutines end with the context passed to Start, which run cancels too.
func stopDRAManager(manager any) {
	if stopper, ok := manager.(interface{ Stop() }); ok {
		stopper.Stop()
	}
}

// updateAllocatedResourcesStatus fills the pod status's allocatedResourcesStatus from the device
// health the plugins reported. 1.37 added the logger parameter.
func updateAllocatedResourcesStatus(manager any, logger klog.Logger, pod *v1.Pod, status *v1.PodStatus) {
	switch m := manager.(type) {
	case interface {
		UpdateAllocatedResourcesStatus(klog.Logger, *v1.Pod, *v1.PodStatus)
	}:
		m.UpdateAllocatedResourcesStatus(logger, pod, status)
	case interface {
		UpdateAllocatedResourcesStatus(*v1.Pod, *v1.PodStatus)
	}:
		m.UpdateAllocatedResourcesStatus(pod, status)
	default:
		logger.Error(nil, "This Kubernetes release's DRA manager has no UpdateAllocatedResourcesStatus the harness knows")
	}
}

// runPluginManager runs the plugin manager until ctx ends. PluginManager.Run takes a context from
// 1.35; on 1.34 it takes only the sources and the stop channel.
func runPluginManager(ctx context.Context, manager any, sourcesReady config.SourcesReady) {
	switch m := manager.(type) {
	case interface {
		Run(context.Context, config.SourcesReady, <-chan struct{})
	}:
		m.Run(ctx, sourcesReady, ctx.Done())
	case interface {
		Run(config.SourcesReady, <-chan struct{})
	}:
		m.Run(sourcesReady, ctx.Done())
	default:
		klog.FromContext(ctx).Error(nil, "This Kubernetes release's plugin manager has no Run the harness knows")
	}
}
