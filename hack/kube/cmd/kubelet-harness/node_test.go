package main

import (
	"encoding/json"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func decodeStatusPatch(t *testing.T, patch []byte) v1.NodeStatus {
	t.Helper()
	var decoded struct {
		Status v1.NodeStatus `json:"status"`
	}
	if err := json.Unmarshal(patch, &decoded); err != nil {
		t.Fatal(err)
	}
	return decoded.Status
}

func TestReadyPatchKeepsTransitionTimeOfAReadyNode(t *testing.T) {
	since := metav1.NewTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	now := metav1.NewTime(since.Add(time.Hour))
	node := &v1.Node{Status: v1.NodeStatus{
		Conditions:  []v1.NodeCondition{{Type: v1.NodeReady, Status: v1.ConditionTrue, LastTransitionTime: since}},
		Allocatable: v1.ResourceList{v1.ResourcePods: resource.MustParse("8")},
	}}

	patch, err := readyStatusPatch(node, now)
	if err != nil {
		t.Fatal(err)
	}
	status := decodeStatusPatch(t, patch)

	ready := status.Conditions[0]
	if ready.Status != v1.ConditionTrue || !ready.LastHeartbeatTime.Equal(&now) || !ready.LastTransitionTime.Equal(&since) {
		t.Errorf("Ready condition = %+v, want True, heartbeat %s, transition kept at %s", ready, now, since)
	}
	if status.Allocatable != nil || status.Capacity != nil {
		t.Errorf("the patch overwrites the capacity the node already reports: %s", patch)
	}
}

func TestReadyPatchGivesANodeWithoutCapacityRoomForPods(t *testing.T) {
	now := metav1.NewTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	node := &v1.Node{Status: v1.NodeStatus{
		Conditions: []v1.NodeCondition{{Type: v1.NodeReady, Status: v1.ConditionFalse}},
	}}

	patch, err := readyStatusPatch(node, now)
	if err != nil {
		t.Fatal(err)
	}
	status := decodeStatusPatch(t, patch)

	if ready := status.Conditions[0]; !ready.LastTransitionTime.Equal(&now) {
		t.Errorf("a node turning Ready must get a new transition time: %+v", ready)
	}
	if pods := status.Allocatable[v1.ResourcePods]; pods.IsZero() {
		t.Errorf("allocatable pods missing, the scheduler would place no pod: %s", patch)
	}
}
