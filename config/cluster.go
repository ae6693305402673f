package config

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
	"golang.org/x/time/rate"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	coreinformers "k8s.io/client-go/informers/core/v1"
	discoveryinformers "k8s.io/client-go/informers/discovery/v1"
	"k8s.io/client-go/kubernetes"
	listersv1 "k8s.io/client-go/listers/core/v1"
	discoverylisters "k8s.io/client-go/listers/discovery/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
)

// ErrNotInCluster is ClientConfig's error when neither a master nor a
// kubeconfig is given and the process does not run in a pod.
var ErrNotInCluster = errors.New("no API server or kubeconfig given, and not running in a pod")

// KubeconfigError is ClientConfig's error when the master or kubeconfig
// given cannot be loaded.
type KubeconfigError struct {
	Path string // the kubeconfig's; "" with a master alone
	Err  error
}

func (e *KubeconfigError) Error() string {
	return fmt.Sprintf("loading kubeconfig %q: %v", e.Path, e.Err)
}
func (e *KubeconfigError) Unwrap() error { return e.Err }

// ClientConfig returns the API server connection: master and kubeconfig
// when given, else the in-cluster service account. It asks for protobuf, as
// kube-proxy does: decoding JSON watch events was most of the CPU of a churn
// at 10k Services.
func ClientConfig(master, kubeconfig string) (*rest.Config, error) {
	var cfg *rest.Config
	var err error
	if master == "" && kubeconfig == "" {
		if cfg, err = rest.InClusterConfig(); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrNotInCluster, err)
		}
	} else if cfg, err = clientcmd.BuildConfigFromFlags(master, kubeconfig); err != nil {
		return nil, &KubeconfigError{Path: kubeconfig, Err: err}
	}
	cfg.ContentType = "application/vnd.kubernetes.protobuf"
	cfg.AcceptContentTypes = "application/vnd.kubernetes.protobuf,application/json"
	return cfg, nil
}

// resynced tells a periodic resync (the object as it was) from a change.
func resynced(old, o any) bool {
	a, errA := meta.Accessor(old)
	b, errB := meta.Accessor(o)
	return errA == nil && errB == nil && a.GetResourceVersion() != "" && a.GetResourceVersion() == b.GetResourceVersion()
}

// ClusterSource feeds a Sink from a cluster's Services and EndpointSlices,
// through shared informers filtered the way kube-proxy filters them.
type ClusterSource struct {
	Client kubernetes.Interface
	Node   string
	Sink   Sink
	Log    logrus.FieldLogger
	// Resync is the informers' resync period; 0 means none (events only).
	Resync time.Duration
	// Probe checks the API server during an outage, to log its return; nil
	// uses the client's /version.
	Probe func(context.Context) error
	// BuildInterval paces the builds under a stream of events: two follow
	// each other at once (a lone change, a Service and its slice), then one
	// per interval, the events meanwhile merged into it. The proxier syncs
	// at most once per --min-sync-period anyway; a State per event that it
	// never syncs was most of a churn's garbage at 10k Services. 0: none.
	BuildInterval time.Duration

	// Unserved is told once per Service (and again when its message
	// changes) about the ports it asks for that are not proxied (SCTP),
	// for an Event on the Service; the warning is logged either way.
	Unserved func(svc ServiceName, message string)

	kick chan struct{} // capacity 1: merges bursts of events into one build
	back chan struct{} // capacity 1: the API server is back after an outage

	last *State // the last State built (builder goroutine only)
	// unserved is the message last given per Service (builder goroutine only).
	unserved map[ServiceName]string
	// ports names the service ports each Service (namespace/name) had in
	// last: what a change of the Service replaces (builder goroutine only).
	ports map[ServiceName][]ServicePortName

	mu       sync.Mutex // guards dirty, outage and seenErrs
	dirty    map[ServiceName]bool
	outage   bool
	seenErrs map[string]bool
}

// Start runs the informers until ctx ends. It returns once both caches have
// synced and the first State was handed to the Sink, so nothing is programmed
// from a partial view; done is closed when everything has stopped.
func (c *ClusterSource) Start(ctx context.Context) (done <-chan struct{}, err error) {
	c.kick = make(chan struct{}, 1)
	c.back = make(chan struct{}, 1)
	quietKlog(c.Log)

	c.Log.Info("Waiting for the Service and EndpointSlice caches to sync")
	inf, err := c.startInformers(ctx)
	if err != nil {
		return nil, err
	}
	c.buildAll(inf)

	limit := rate.Inf
	if c.BuildInterval > 0 {
		limit = rate.Every(c.BuildInterval)
	}
	builds := rate.NewLimiter(limit, 2)
	ch := make(chan struct{})
	healthDone := make(chan struct{})
	go func() { defer close(healthDone); c.watchHealth(ctx) }()
	go func() {
		defer close(ch)
		defer func() { <-healthDone }()
		defer func() { inf.stop() }()
		for {
			select {
			case <-ctx.Done():
				return
			case <-c.kick:
				if builds.Wait(ctx) != nil {
					return
				}
				c.build(inf)
			case <-c.back:
				// After an outage client-go's reflectors retry with a
				// backoff of up to 30 s; fresh informers relist now, so
				// that changes made meanwhile apply at once. The old
				// caches serve until the new ones have synced.
				next, err := c.startInformers(ctx)
				if err != nil {
					c.Log.WithError(err).Warn("Restarting the informers after the outage failed; the old ones keep retrying")
					continue
				}
				inf.stop()
				inf = next
				c.buildAll(inf)
			}
		}
	}()
	return ch, nil
}

// informerSet is one generation of the two informers.
type informerSet struct {
	factory    informers.SharedInformerFactory
	cancel     context.CancelFunc
	services   listersv1.ServiceLister
	slices     discoverylisters.EndpointSliceLister
	sliceStore cache.Store
	byService  *sliceIndex // the slices of each Service, by name
	// nodes watches this node's Node object only (a field selector): its
	// zone for topology hints, and whether it is going away.
	nodeFactory informers.SharedInformerFactory
	nodes       listersv1.NodeLister
}

func (s *informerSet) stop() {
	s.cancel()
	s.factory.Shutdown()
	s.nodeFactory.Shutdown()
}

// startInformers starts Service and EndpointSlice informers with
// kube-proxy's label filters and waits until both caches have synced.
func (c *ClusterSource) startInformers(ctx context.Context) (*informerSet, error) {
	noProxyName, _ := labels.NewRequirement(LabelServiceProxyName, selection.DoesNotExist, nil)
	noHeadless, _ := labels.NewRequirement(LabelHeadless, selection.DoesNotExist, nil)
	factory := informers.NewSharedInformerFactoryWithOptions(c.Client, c.Resync,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.LabelSelector = labels.NewSelector().Add(*noProxyName, *noHeadless).String()
		}))
	// No index by namespace (the factory's default): nothing here lists by
	// namespace, and at 10k objects it is a set of every key per kind.
	tweak := func(o *metav1.ListOptions) {
		o.LabelSelector = labels.NewSelector().Add(*noProxyName, *noHeadless).String()
	}
	svcInformer := factory.InformerFor(&v1.Service{}, func(cl kubernetes.Interface, resync time.Duration) cache.SharedIndexInformer {
		return coreinformers.NewFilteredServiceInformer(cl, metav1.NamespaceAll, resync, cache.Indexers{}, tweak)
	})
	sliceInformer := factory.InformerFor(&discovery.EndpointSlice{}, func(cl kubernetes.Interface, resync time.Duration) cache.SharedIndexInformer {
		return discoveryinformers.NewFilteredEndpointSliceInformer(cl, metav1.NamespaceAll, resync, cache.Indexers{}, tweak)
	})
	nodeFactory := informers.NewSharedInformerFactoryWithOptions(c.Client, c.Resync,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", c.Node).String()
		}))
	nodeInformer := nodeFactory.Core().V1().Nodes()
	byService := &sliceIndex{}
	handlers := []struct {
		inf cache.SharedIndexInformer
		h   cache.ResourceEventHandler
	}{
		{svcInformer, cache.ResourceEventHandlerFuncs{
			AddFunc: func(o any) { c.changed(serviceKey(o)) },
			UpdateFunc: func(old, o any) {
				if !resynced(old, o) {
					c.changed(serviceKey(o))
				}
			},
			DeleteFunc: func(o any) { c.changed(serviceKey(o)) },
		}},
		{sliceInformer, cache.ResourceEventHandlerFuncs{
			AddFunc: func(o any) { byService.update(nil, o); c.changed(sliceKey(o)) },
			UpdateFunc: func(old, o any) {
				if !resynced(old, o) {
					byService.update(old, o)
					c.changed(sliceKey(old), sliceKey(o))
				}
			},
			DeleteFunc: func(o any) { byService.update(o, nil); c.changed(sliceKey(o)) },
		}},
		{nodeInformer.Informer(), cache.ResourceEventHandlerFuncs{
			AddFunc: func(any) { c.changed() },
			UpdateFunc: func(old, o any) {
				if !resynced(old, o) {
					c.changed()
				}
			},
			DeleteFunc: func(any) { c.changed() },
		}},
	}
	var handled []cache.InformerSynced // each handler has had the initial list
	for _, x := range handlers {
		// Only what the model reads is kept: at 10k Services the
		// managed fields and foreign annotations were most of the cache.
		if err := x.inf.SetTransform(slim); err != nil {
			return nil, fmt.Errorf("setting the cache transform: %w", err)
		}
		reg, err := x.inf.AddEventHandler(x.h)
		if err != nil {
			return nil, fmt.Errorf("adding event handler: %w", err)
		}
		handled = append(handled, reg.HasSynced)
		if err := x.inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
			c.watchError(err)
		}); err != nil {
			return nil, fmt.Errorf("setting watch error handler: %w", err)
		}
	}
	runCtx, cancel := context.WithCancel(ctx)
	set := &informerSet{factory: factory, cancel: cancel, services: listersv1.NewServiceLister(svcInformer.GetIndexer()),
		slices: discoverylisters.NewEndpointSliceLister(sliceInformer.GetIndexer()), sliceStore: sliceInformer.GetStore(), byService: byService,
		nodeFactory: nodeFactory, nodes: nodeInformer.Lister()}
	factory.Start(runCtx.Done())
	nodeFactory.Start(runCtx.Done())
	for _, f := range []informers.SharedInformerFactory{factory, nodeFactory} {
		for typ, ok := range f.WaitForCacheSync(runCtx.Done()) {
			if !ok {
				set.stop()
				return nil, fmt.Errorf("%v cache did not sync: %w", typ, ctx.Err())
			}
		}
	}
	// The handlers get the initial list after the caches have it: wait
	// for them too, so that the State built from the caches next is not
	// followed by a build of every Service their late events name.
	if err := waitSynced(runCtx, handled); err != nil {
		set.stop()
		return nil, fmt.Errorf("event handlers did not sync: %w", err)
	}
	return set, nil
}

// waitSynced polls every 2 ms until each of synced holds (client-go's
// WaitForCacheSync polls every 100 ms, a tenth of the start at 10k).
func waitSynced(ctx context.Context, synced []cache.InformerSynced) error {
	return wait.PollUntilContextCancel(ctx, 2*time.Millisecond, true, func(context.Context) (bool, error) {
		for _, ok := range synced {
			if !ok() {
				return false, nil
			}
		}
		return true, nil
	})
}

// buildAll hands the Sink a State made from the whole caches: at the start
// and after the informers were restarted.
func (c *ClusterSource) buildAll(inf *informerSet) {
	c.takeDirty()
	services, err := inf.services.List(labels.Everything())
	if err != nil {
		c.Log.WithError(err).Error("Listing Services from the cache")
		return
	}
	slices, err := inf.slices.List(labels.Everything())
	if err != nil {
		c.Log.WithError(err).Error("Listing EndpointSlices from the cache")
		return
	}
	st := c.buildState(services, slices)
	c.ports = make(map[ServiceName][]ServicePortName, len(st.Ports))
	for name := range st.Ports {
		key := ServiceName{name.Namespace, name.Name}
		c.ports[key] = append(c.ports[key], name)
	}
	c.setNode(inf, st)
	ReuseUnchanged(st, c.last)
	if c.last != nil {
		st.Seq = c.last.Seq + 1 // numbered, but made from nothing: Since stays 0
	} else {
		st.Seq = 1
	}
	c.last = st
	c.Sink.Update(st)
}

// build hands the Sink a State in which only the Services that events named
// since the last build are converted again, with their slices (found by the
// index); every other port is the last State's, the same pointer. The work
// per event is proportional to the event, not to the cluster.
func (c *ClusterSource) build(inf *informerSet) {
	if c.last == nil {
		c.buildAll(inf)
		return
	}
	dirty := c.takeDirty()
	st := &State{Ports: maps.Clone(c.last.Ports), Node: c.Node, Seq: c.last.Seq + 1, Since: c.last.Seq}
	for key := range dirty {
		st.Changed = append(st.Changed, c.ports[key]...)
		for _, name := range c.ports[key] {
			delete(st.Ports, name)
		}
		delete(c.ports, key)
		svc, err := inf.services.Services(key.Namespace).Get(key.Name)
		if err != nil {
			continue // gone, or never proxied: its ports go with it
		}
		b := NewBuilder(c.Node)
		if skip, err := b.AddService(svc); err != nil {
			c.Log.WithFields(logrus.Fields{"service": key.String()}).WithError(err).Warn("Service not proxied")
			continue
		} else if skip != "" {
			continue
		}
		c.noteUnserved(svc)
		for _, sliceName := range inf.byService.slices(key) {
			o, ok, _ := inf.sliceStore.GetByKey(key.Namespace + "/" + sliceName)
			if !ok {
				continue // deleted since: its event comes
			}
			es := o.(*discovery.EndpointSlice)
			if _, err := b.AddSlice(es); err != nil {
				c.Log.WithFields(logrus.Fields{"endpointSlice": es.Namespace + "/" + es.Name}).WithError(err).Warn("EndpointSlice ignored")
			}
		}
		for name, sp := range b.State().Ports {
			if old := c.last.Ports[name]; old != nil && old.Equal(sp) {
				sp = old // unchanged: consumers skip it by its pointer
			}
			st.Ports[name] = sp
			c.ports[key] = append(c.ports[key], name)
			st.Changed = append(st.Changed, name)
		}
	}
	c.setNode(inf, st)
	if c.same(st) {
		return // events that changed nothing the model reads: no sync
	}
	c.last = st
	c.Sink.Update(st)
}

// same reports whether st, made by build, serves what the last State did:
// every changed port is the last one's pointer and the node is as it was.
func (c *ClusterSource) same(st *State) bool {
	if st.Zone != c.last.Zone || st.NodeDeleting != c.last.NodeDeleting || len(st.Ports) != len(c.last.Ports) {
		return false
	}
	for _, name := range st.Changed {
		if st.Ports[name] != c.last.Ports[name] {
			return false
		}
	}
	return true
}

// setNode sets st's zone, NodeDeleting and PodCIDRs from this node's Node
// object.
func (c *ClusterSource) setNode(inf *informerSet, st *State) {
	if n, err := inf.nodes.Get(c.Node); err == nil {
		st.Zone, st.NodeDeleting = NodeState(n)
		st.PodCIDRs, _ = NodePodCIDRs(n) // the API server validates them
	} else if c.last == nil {
		c.Log.WithField("node", c.Node).Warn("No Node object of this name: topology hints and the node's deletion are not seen (set --hostname-override to the node's name)")
	}
}

// changed is every informer event: it records the Services it touches and
// wakes the builder (no key: this node's Node object changed).
func (c *ClusterSource) changed(keys ...ServiceName) {
	c.mu.Lock()
	for _, k := range keys {
		if k.Name == "" {
			continue
		}
		if c.dirty == nil {
			c.dirty = map[ServiceName]bool{}
		}
		c.dirty[k] = true
	}
	c.mu.Unlock()
	select {
	case c.kick <- struct{}{}:
	default:
	}
}

// takeDirty returns the Services changed since the last call, and forgets them.
func (c *ClusterSource) takeDirty() map[ServiceName]bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	d := c.dirty
	c.dirty = nil
	return d
}

// noteUnserved warns, once per Service and message, about its ports that
// are not proxied.
func (c *ClusterSource) noteUnserved(svc *v1.Service) {
	key := ServiceName{svc.Namespace, svc.Name}
	un := UnservedPorts(svc)
	if len(un) == 0 {
		delete(c.unserved, key)
		return
	}
	msg := UnservedMessage(un)
	if c.unserved[key] == msg {
		return
	}
	if c.unserved == nil {
		c.unserved = map[ServiceName]string{}
	}
	c.unserved[key] = msg
	c.Log.WithField("service", key.String()).Warn(msg)
	if c.Unserved != nil {
		c.Unserved(key, msg)
	}
}

// buildState converts the cached objects. Invalid objects are logged and
// skipped: one bad Service must not stop the others.
func (c *ClusterSource) buildState(services []*v1.Service, slices []*discovery.EndpointSlice) *State {
	b := NewBuilder(c.Node)
	for _, svc := range services {
		if skip, err := b.AddService(svc); err != nil {
			c.Log.WithFields(logrus.Fields{"service": svc.Namespace + "/" + svc.Name}).WithError(err).Warn("Service not proxied")
		} else if skip == "" {
			c.noteUnserved(svc)
		}
	}
	for _, es := range slices {
		if _, err := b.AddSlice(es); err != nil {
			c.Log.WithFields(logrus.Fields{"endpointSlice": es.Namespace + "/" + es.Name}).WithError(err).Warn("EndpointSlice ignored")
		}
	}
	return b.State()
}
