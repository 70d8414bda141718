package main

import (
	"errors"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	kubecontainer "k8s.io/kubernetes/pkg/kubelet/container"
	"k8s.io/utils/ptr"
)

func testPod() *v1.Pod {
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns", UID: "uid-1"},
		Spec: v1.PodSpec{
			InitContainers: []v1.Container{
				{Name: "setup", Image: "busybox"},
				{Name: "sidecar", Image: "busybox", RestartPolicy: ptr.To(v1.ContainerRestartPolicyAlways)},
			},
			Containers: []v1.Container{{Name: "app", Image: "cuda"}, {Name: "log", Image: "busybox"}},
		},
		Status: v1.PodStatus{
			Phase:      v1.PodPending,
			Conditions: []v1.PodCondition{{Type: v1.PodScheduled, Status: v1.ConditionTrue}},
			ResourceClaimStatuses: []v1.PodResourceClaimStatus{
				{Name: "gpu", ResourceClaimName: ptr.To("p-gpu-abcde")},
			},
		},
	}
}

func TestCDIDevicesAnnotationListsEveryContainer(t *testing.T) {
	devices := map[string][]string{
		"setup": {"gpu.dra-driver.dev/gpu=gpu-0"},
		"app":   {"gpu.dra-driver.dev/gpu=gpu-0", "gpu.dra-driver.dev/gpu=mig-1"},
	}
	resources := func(_ *v1.Pod, c *v1.Container) (*dra.ContainerInfo, error) {
		info := &dra.ContainerInfo{}
		for _, name := range devices[c.Name] {
			info.CDIDevices = append(info.CDIDevices, kubecontainer.CDIDevice{Name: name})
		}
		return info, nil
	}

	got, err := cdiDevicesAnnotation(testPod(), resources)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"app":["gpu.dra-driver.dev/gpu=gpu-0","gpu.dra-driver.dev/gpu=mig-1"],"log":[],` +
		`"setup":["gpu.dra-driver.dev/gpu=gpu-0"],"sidecar":[]}`
	if got != want {
		t.Errorf("annotation = %s, want %s", got, want)
	}
}

func TestCDIDevicesAnnotationNamesTheFailingContainer(t *testing.T) {
	resources := func(*v1.Pod, *v1.Container) (*dra.ContainerInfo, error) {
		return nil, errors.New("claim not prepared")
	}
	_, err := cdiDevicesAnnotation(testPod(), resources)
	if err == nil || err.Error() != "container setup: claim not prepared" {
		t.Errorf("error = %v, want one naming container setup", err)
	}
}

func TestRunningStatusReportsAllContainersRunning(t *testing.T) {
	now := metav1.NewTime(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC))
	status := runningStatus(testPod(), now)

	if status.Phase != v1.PodRunning {
		t.Errorf("phase = %s, want Running", status.Phase)
	}
	for _, want := range []v1.PodConditionType{
		v1.PodScheduled, v1.PodReadyToStartContainers, v1.PodInitialized, v1.ContainersReady, v1.PodReady,
	} {
		if !hasTrueCondition(status, want) {
			t.Errorf("condition %s is not True in %+v", want, status.Conditions)
		}
	}
	if len(status.ResourceClaimStatuses) != 1 {
		t.Errorf("resourceClaimStatuses set by the controller were dropped: %+v", status.ResourceClaimStatuses)
	}
	setup, sidecar := status.InitContainerStatuses[0], status.InitContainerStatuses[1]
	if setup.State.Terminated == nil || setup.State.Terminated.ExitCode != 0 {
		t.Errorf("init container setup should have completed: %+v", setup.State)
	}
	if sidecar.State.Running == nil || !sidecar.Ready {
		t.Errorf("sidecar should run and be ready: %+v", sidecar)
	}
	for _, c := range status.ContainerStatuses {
		if c.State.Running == nil || !c.Ready || !ptr.Deref(c.Started, false) {
			t.Errorf("container %s should run, be started and ready: %+v", c.Name, c)
		}
	}
}

// A second sync must compute the very status the first one published, or the harness would
// update the pod status on every event.
func TestRunningStatusIsStableAcrossSyncs(t *testing.T) {
	pod := testPod()
	pod.Status = *runningStatus(pod, metav1.NewTime(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)))

	again := runningStatus(pod, metav1.NewTime(time.Date(2026, 1, 2, 3, 9, 0, 0, time.UTC)))

	if !apiequality.Semantic.DeepEqual(&pod.Status, again) {
		t.Errorf("status changed on a repeated sync:\nfirst:  %+v\nsecond: %+v", pod.Status, *again)
	}
}

func hasTrueCondition(status *v1.PodStatus, conditionType v1.PodConditionType) bool {
	for _, c := range status.Conditions {
		if c.Type == conditionType {
			return c.Status == v1.ConditionTrue
		}
	}
	return false
}
