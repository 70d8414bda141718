package main

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/features"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/pkg/kubelet/events"
	"k8s.io/utils/ptr"
)

// Failed syncs (prepare, unprepare, API errors) are retried with a per-pod exponential
// backoff between these bounds; the kubelet's pod workers retry a failing pod about every 10 s.
const (
	retryBaseDelay = time.Second
	retryMaxDelay  = 10 * time.Second
)

// ReasonFailedUnprepareDynamicResources is the harness's own event reason (the kubelet only
// logs this failure): it tells a test why a deleted pod stays Terminating.
const ReasonFailedUnprepareDynamicResources = "FailedUnprepareDynamicResources"

// trackedPod is what the harness knows about one pod bound to its node: the latest object seen
// by the informer, whether the informer reported it deleted, and whether this process already
// "started" it (prepared its claims and recorded its CDI devices).
type trackedPod struct {
	pod     *v1.Pod
	deleted bool
	started bool
	// released: this pod's claims were unprepared (terminated or finished). The kubelet releases a
	// pod's claims once; a second UnprepareResources for it would, before 1.37, unprepare a claim
	// that another pod still uses (the DRA manager did not check that the pod still references it).
	released bool
}

// podController plays the kubelet's pod workers for pods bound to the node. Pods are keyed by
// UID: a pod re-created under the same name is another pod, as for the kubelet.
type podController struct {
	client   kubernetes.Interface
	dra      *dra.Manager
	recorder record.EventRecorder
	queue    workqueue.TypedRateLimitingInterface[types.UID]

	mutex sync.Mutex
	pods  map[types.UID]*trackedPod
}

func newPodController(client kubernetes.Interface, draManager *dra.Manager, recorder record.EventRecorder) *podController {
	return &podController{
		client:   client,
		dra:      draManager,
		recorder: recorder,
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[types.UID](retryBaseDelay, retryMaxDelay),
			workqueue.TypedRateLimitingQueueConfig[types.UID]{Name: "pods"}),
		pods: map[types.UID]*trackedPod{},
	}
}

func (c *podController) eventHandler() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { c.observe(obj, false) },
		UpdateFunc: func(_, obj any) { c.observe(obj, false) },
		DeleteFunc: func(obj any) {
			if tombstone, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = tombstone.Obj
			}
			c.observe(obj, true)
		},
	}
}

func (c *podController) observe(obj any, deleted bool) {
	pod, ok := obj.(*v1.Pod)
	if !ok {
		return
	}
	c.mutex.Lock()
	tracked := c.pods[pod.UID]
	if tracked == nil {
		tracked = &trackedPod{}
		c.pods[pod.UID] = tracked
	}
	tracked.pod, tracked.deleted = pod, deleted
	c.mutex.Unlock()
	c.queue.Add(pod.UID)
}

// activePods is the DRA manager's ActivePodsFunc, the kubelet's GetActivePods: every pod bound
// to the node that has not finished, terminating ones included. Claims that the manager's
// checkpoint holds for any other pod get unprepared by its reconcile loop.
func (c *podController) activePods() []*v1.Pod {
	c.mutex.Lock()
	defer c.mutex.Unlock()
	var active []*v1.Pod
	for _, tracked := range c.pods {
		if !tracked.deleted && !hasFinished(tracked.pod) {
			active = append(active, tracked.pod)
		}
	}
	return active
}

func hasFinished(pod *v1.Pod) bool {
	return pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed
}

// followHealthUpdates re-syncs the pods whose devices changed health, so that their
// containerStatuses[].allocatedResourcesStatus follow, as the kubelet's status manager does.
func (c *podController) followHealthUpdates(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case update := <-c.dra.Updates():
			for _, uid := range update.PodUIDs {
				c.queue.Add(types.UID(uid))
			}
		}
	}
}

// run processes pods with the given number of workers until ctx is cancelled.
func (c *podController) run(ctx context.Context, workers int) {
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for c.processNext(ctx) {
			}
		})
	}
	<-ctx.Done()
	c.queue.ShutDown()
	wg.Wait()
}

func (c *podController) processNext(ctx context.Context) bool {
	uid, shutdown := c.queue.Get()
	if shutdown {
		return false
	}
	defer c.queue.Done(uid)
	if err := c.sync(ctx, uid); err != nil {
		if ctx.Err() == nil {
			klog.FromContext(ctx).Info("Syncing pod failed, will retry", "podUID", uid, "err", err)
		}
		c.queue.AddRateLimited(uid)
		return true
	}
	c.queue.Forget(uid)
	return true
}

func (c *podController) sync(ctx context.Context, uid types.UID) error {
	c.mutex.Lock()
	tracked, known := c.pods[uid]
	var snapshot trackedPod
	if known {
		snapshot = *tracked
	}
	c.mutex.Unlock()
	if !known {
		return nil
	}
	pod := snapshot.pod
	ctx = klog.NewContext(ctx, klog.LoggerWithValues(klog.FromContext(ctx), "pod", klog.KObj(pod), "podUID", uid))

	switch {
	case snapshot.deleted:
		// Gone from the API server: deleted by us after unprepare (then its claims are released
		// already), or force-deleted while running. Like the kubelet, stop it and release its claims.
		if !snapshot.released {
			if err := c.dra.UnprepareResources(ctx, pod); err != nil {
				return err
			}
		}
		c.mutex.Lock()
		if c.pods[uid] == tracked && tracked.deleted {
			delete(c.pods, uid)
		}
		c.mutex.Unlock()
		return nil
	case pod.DeletionTimestamp != nil:
		return c.terminate(ctx, tracked, snapshot.released, pod)
	case hasFinished(pod):
		// The kubelet releases the claims of a pod whose containers have all exited.
		return c.release(ctx, tracked, snapshot.released, pod)
	case !snapshot.started:
		return c.start(ctx, tracked, pod)
	default:
		return c.publishStatus(ctx, pod)
	}
}

// start prepares the pod's claims, as the kubelet does before it creates the pod sandbox,
// records the CDI devices its containers would get, and reports the pod Running.
func (c *podController) start(ctx context.Context, tracked *trackedPod, pod *v1.Pod) error {
	if err := c.dra.PrepareResources(ctx, pod); err != nil {
		// Same event as the kubelet's (kuberuntime_manager.go).
		c.recorder.Eventf(pod, v1.EventTypeWarning, events.FailedPrepareDynamicResources,
			"Failed to prepare dynamic resources: %v", err)
		return err
	}
	devices, err := cdiDevicesAnnotation(pod, c.dra.GetResources)
	if err != nil {
		return err
	}
	if pod.Annotations[CDIDevicesAnnotation] != devices {
		patch, err := json.Marshal(map[string]any{
			"metadata": map[string]any{"annotations": map[string]string{CDIDevicesAnnotation: devices}},
		})
		if err != nil {
			return fmt.Errorf("encode annotation patch: %w", err)
		}
		pod, err = c.client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{})
		if err != nil {
			return ignoreGone(fmt.Errorf("record CDI devices: %w", err))
		}
	}
	c.mutex.Lock()
	tracked.started = true
	c.mutex.Unlock()
	klog.FromContext(ctx).V(2).Info("Started pod", "cdiDevices", devices)
	return c.publishStatus(ctx, pod)
}

// publishStatus reports the pod Running, with the health of its devices when the
// ResourceHealthStatus feature is on (as the kubelet's status manager does).
func (c *podController) publishStatus(ctx context.Context, pod *v1.Pod) error {
	status := runningStatus(pod, metav1.Now())
	if utilfeature.DefaultFeatureGate.Enabled(features.ResourceHealthStatus) {
		updateAllocatedResourcesStatus(c.dra, klog.FromContext(ctx), pod, status)
	}
	if apiequality.Semantic.DeepEqual(&pod.Status, status) {
		return nil
	}
	updated := pod.DeepCopy()
	updated.Status = *status
	_, err := c.client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, updated, metav1.UpdateOptions{})
	if apierrors.IsConflict(err) {
		// The pod changed since this sync read it; the informer brings the change, which
		// queues another sync.
		return nil
	}
	return ignoreGone(err)
}

// terminate handles a pod whose deletion was requested: its containers "stop" at once, the
// claims get unprepared (the kubelet does this after the containers stopped and before it
// reports the pod terminated), then the deletion is completed with grace period 0, as the
// kubelet's status manager does.
func (c *podController) terminate(ctx context.Context, tracked *trackedPod, released bool, pod *v1.Pod) error {
	if err := c.release(ctx, tracked, released, pod); err != nil {
		c.recorder.Eventf(pod, v1.EventTypeWarning, ReasonFailedUnprepareDynamicResources,
			"Failed to unprepare dynamic resources: %v", err)
		return err
	}
	err := c.client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
		GracePeriodSeconds: ptr.To[int64](0),
		Preconditions:      metav1.NewUIDPreconditions(string(pod.UID)),
	})
	if err != nil {
		return ignoreGone(fmt.Errorf("complete deletion: %w", err))
	}
	klog.FromContext(ctx).V(2).Info("Pod stopped and deleted")
	return nil
}

// release unprepares the pod's claims unless that was done already, and records that it was, so
// that the claims of one pod are released once.
func (c *podController) release(ctx context.Context, tracked *trackedPod, released bool, pod *v1.Pod) error {
	if released {
		return nil
	}
	if err := c.dra.UnprepareResources(ctx, pod); err != nil {
		return err
	}
	c.mutex.Lock()
	tracked.released = true
	c.mutex.Unlock()
	return nil
}

// ignoreGone drops the errors that mean "this pod no longer exists" (NotFound, or a UID
// precondition that failed because a new pod has the name): the informer reports the deletion.
func ignoreGone(err error) error {
	if apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
		return nil
	}
	return err
}
