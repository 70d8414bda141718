package main

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"runtime"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
)

// defaultCapacity is what the harness reports for a node that reports none, so that the
// scheduler's NodeResourcesFit plugin admits pods (it refuses every pod on a node with no
// "pods" capacity).
var defaultCapacity = v1.ResourceList{
	v1.ResourceCPU:    resource.MustParse("16"),
	v1.ResourceMemory: resource.MustParse("64Gi"),
	v1.ResourcePods:   resource.MustParse("110"),
}

// nodeKeeper registers the Node and keeps its Ready condition fresh, like the kubelet's node
// status loop. It does not renew a Lease: no node-lifecycle controller runs in the tests.
type nodeKeeper struct {
	client kubernetes.Interface
	name   string
	labels map[string]string
}

// get is the DRA manager's GetNodeFunc.
func (k *nodeKeeper) get(ctx context.Context) (*v1.Node, error) {
	return k.client.CoreV1().Nodes().Get(ctx, k.name, metav1.GetOptions{})
}

func (k *nodeKeeper) keepReady(ctx context.Context, interval time.Duration) {
	logger := klog.FromContext(ctx)
	wait.UntilWithContext(ctx, func(ctx context.Context) {
		if err := k.heartbeat(ctx); err != nil && ctx.Err() == nil {
			logger.Error(err, "Updating node status failed, will retry", "interval", interval)
		}
	}, interval)
}

// heartbeat creates the Node when it is missing (the test fixture normally creates it) and
// patches its Ready condition with a fresh lastHeartbeatTime.
func (k *nodeKeeper) heartbeat(ctx context.Context) error {
	node, err := k.get(ctx)
	if apierrors.IsNotFound(err) {
		node, err = k.client.CoreV1().Nodes().Create(ctx, k.newNode(), metav1.CreateOptions{})
	}
	if err != nil {
		return err
	}
	patch, err := readyStatusPatch(node, metav1.Now())
	if err != nil {
		return err
	}
	_, err = k.client.CoreV1().Nodes().Patch(ctx, k.name, types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status")
	return err
}

func (k *nodeKeeper) newNode() *v1.Node {
	labels := map[string]string{
		v1.LabelHostname:   k.name,
		v1.LabelOSStable:   "linux",
		v1.LabelArchStable: runtime.GOARCH,
	}
	maps.Copy(labels, k.labels)
	return &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: k.name, Labels: labels}}
}

// readyStatusPatch is a strategic merge patch of the node status: conditions merge by type,
// so the fixture's other conditions and fields stay as they are.
func readyStatusPatch(node *v1.Node, now metav1.Time) ([]byte, error) {
	ready := v1.NodeCondition{
		Type:               v1.NodeReady,
		Status:             v1.ConditionTrue,
		Reason:             "KubeletReady",
		Message:            "kubelet harness is posting ready status",
		LastHeartbeatTime:  now,
		LastTransitionTime: now,
	}
	for _, c := range node.Status.Conditions {
		if c.Type == v1.NodeReady && c.Status == v1.ConditionTrue {
			ready.LastTransitionTime = c.LastTransitionTime
		}
	}
	status := map[string]any{"conditions": []v1.NodeCondition{ready}}
	if _, ok := node.Status.Allocatable[v1.ResourcePods]; !ok {
		status["capacity"] = defaultCapacity
		status["allocatable"] = defaultCapacity
	}
	patch, err := json.Marshal(map[string]any{"status": status})
	if err != nil {
		return nil, fmt.Errorf("encode node status patch: %w", err)
	}
	return patch, nil
}
