package main

import (
	"encoding/json"
	"fmt"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/utils/ptr"
)

// CDIDevicesAnnotation is the pod annotation where the harness records, for every container
// (init containers included), the CDI device ids that the kubelet would have handed to the
// container runtime (CRI ContainerConfig.CDIDevices). Its value is a JSON object:
// {"<container name>": ["vendor/class=name", ...], ...}; a container without devices maps to [].
const CDIDevicesAnnotation = "dra-harness.dra-driver.dev/cdi-devices"

// containerResourcesFunc is (*dra.Manager).GetResources.
type containerResourcesFunc func(pod *v1.Pod, container *v1.Container) (*dra.ContainerInfo, error)

// cdiDevicesAnnotation computes the value of CDIDevicesAnnotation for a prepared pod.
func cdiDevicesAnnotation(pod *v1.Pod, resources containerResourcesFunc) (string, error) {
	devices := map[string][]string{}
	containers := append(append([]v1.Container{}, pod.Spec.InitContainers...), pod.Spec.Containers...)
	for i := range containers {
		info, err := resources(pod, &containers[i])
		if err != nil {
			return "", fmt.Errorf("container %s: %w", containers[i].Name, err)
		}
		names := []string{}
		for _, device := range info.CDIDevices {
			names = append(names, device.Name)
		}
		devices[containers[i].Name] = names
	}
	value, err := json.Marshal(devices) // Keys come out sorted: the value is stable.
	if err != nil {
		return "", fmt.Errorf("encode %s: %w", CDIDevicesAnnotation, err)
	}
	return string(value), nil
}

// runningStatus is the status of the pod once all its containers "run": phase Running, all
// conditions true, every container running and ready, init containers completed (sidecars
// running). Fields set by others (resourceClaimStatuses, ...) are kept, and so are the start
// times of containers that already run, so that a repeated sync changes nothing.
func runningStatus(pod *v1.Pod, now metav1.Time) *v1.PodStatus {
	status := pod.Status.DeepCopy()
	status.Phase = v1.PodRunning
	if status.StartTime == nil {
		status.StartTime = &now
	}
	for _, condition := range []v1.PodConditionType{
		v1.PodReadyToStartContainers, v1.PodInitialized, v1.ContainersReady, v1.PodReady,
	} {
		setConditionTrue(status, condition, now)
	}

	previous := map[string]v1.ContainerStatus{}
	for _, s := range append(append([]v1.ContainerStatus{}, status.InitContainerStatuses...), status.ContainerStatuses...) {
		previous[s.Name] = s
	}
	status.InitContainerStatuses = nil
	for _, c := range pod.Spec.InitContainers {
		isSidecar := c.RestartPolicy != nil && *c.RestartPolicy == v1.ContainerRestartPolicyAlways
		status.InitContainerStatuses = append(status.InitContainerStatuses,
			containerStatus(pod, c, previous[c.Name], now, !isSidecar))
	}
	status.ContainerStatuses = nil
	for _, c := range pod.Spec.Containers {
		status.ContainerStatuses = append(status.ContainerStatuses, containerStatus(pod, c, previous[c.Name], now, false))
	}
	return status
}

func setConditionTrue(status *v1.PodStatus, conditionType v1.PodConditionType, now metav1.Time) {
	for i := range status.Conditions {
		c := &status.Conditions[i]
		if c.Type == conditionType {
			if c.Status != v1.ConditionTrue {
				*c = v1.PodCondition{Type: conditionType, Status: v1.ConditionTrue, LastTransitionTime: now}
			}
			return
		}
	}
	status.Conditions = append(status.Conditions,
		v1.PodCondition{Type: conditionType, Status: v1.ConditionTrue, LastTransitionTime: now})
}

// containerStatus reports a container as running, or as completed with exit code 0 when it is
// a regular init container. A container that already had that state keeps its timestamps.
func containerStatus(pod *v1.Pod, c v1.Container, previous v1.ContainerStatus, now metav1.Time, completed bool) v1.ContainerStatus {
	state := v1.ContainerState{Running: &v1.ContainerStateRunning{StartedAt: now}}
	if completed {
		state = v1.ContainerState{Terminated: &v1.ContainerStateTerminated{
			ExitCode: 0, Reason: "Completed", StartedAt: now, FinishedAt: now,
		}}
	}
	switch {
	case !completed && previous.State.Running != nil:
		state = previous.State
	case completed && previous.State.Terminated != nil && previous.State.Terminated.ExitCode == 0:
		state = previous.State
	}
	return v1.ContainerStatus{
		Name:        c.Name,
		Image:       c.Image,
		ImageID:     c.Image,
		ContainerID: fmt.Sprintf("dra-harness://%s/%s", pod.UID, c.Name),
		State:       state,
		Ready:       true,
		Started:     ptr.To(!completed),
	}
}
