package config

// What the cluster source's informers keep, and how they find it: objects
// slimmed before the cache holds them, and the slices of each Service.

import (
	"slices"
	"strings"
	"sync"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
)

// sliceIndex finds a Service's slices by name; the slice handlers keep it.
// (An indexer of client-go keeps a set per Service: 3 MB at 10 000
// Services with one slice each.)
type sliceIndex struct {
	mu    sync.Mutex
	bySvc map[ServiceName][]string
}

// update moves a slice from where old (nil: new slice) was to where o
// (nil: deleted) is; either may be a tombstone.
func (x *sliceIndex) update(old, o any) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if k, name := sliceKey(old), sliceName(old); k.Name != "" {
		names := x.bySvc[k]
		if i := slices.Index(names, name); i >= 0 {
			names = slices.Delete(names, i, i+1)
		}
		if len(names) == 0 {
			delete(x.bySvc, k)
		} else {
			x.bySvc[k] = names
		}
	}
	if k, name := sliceKey(o), sliceName(o); k.Name != "" {
		if x.bySvc == nil {
			x.bySvc = map[ServiceName][]string{}
		}
		if !slices.Contains(x.bySvc[k], name) {
			x.bySvc[k] = append(x.bySvc[k], name)
		}
	}
}

// slices returns the names of the slices of the Service named by key.
func (x *sliceIndex) slices(key ServiceName) []string {
	x.mu.Lock()
	defer x.mu.Unlock()
	return slices.Clone(x.bySvc[key])
}

func sliceName(o any) string {
	if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
		o = t.Obj
	}
	if es, ok := o.(*discovery.EndpointSlice); ok {
		return es.Name
	}
	return ""
}

// serviceKey and sliceKey name the Service an event is about (a deleted
// object may come as a tombstone).
func serviceKey(o any) ServiceName {
	if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
		o = t.Obj
	}
	if svc, ok := o.(*v1.Service); ok {
		return ServiceName{svc.Namespace, svc.Name}
	}
	return ServiceName{}
}

func sliceKey(o any) ServiceName {
	if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
		o = t.Obj
	}
	if es, ok := o.(*discovery.EndpointSlice); ok {
		return ServiceName{es.Namespace, es.Labels[LabelServiceName]}
	}
	return ServiceName{}
}

// slim drops from an object, before the cache keeps it, what the model never
// reads: managed fields, annotations other than this proxy's, a Node's status,
// UIDs and owner references, an endpoint's Pod reference. It keeps the
// resource version (client-go reads it) and a Service's creation time (the
// oldest Service wins a NodePort).
func slim(o any) (any, error) {
	if m, ok := o.(metav1.Object); ok {
		m.SetManagedFields(nil)
		if a := m.GetAnnotations(); len(a) > 0 {
			var keep map[string]string
			for k, v := range a {
				if strings.HasPrefix(k, annotationPrefix) {
					if keep == nil {
						keep = map[string]string{}
					}
					keep[k] = v
				}
			}
			m.SetAnnotations(keep)
		}
	}
	switch o := o.(type) {
	case *v1.Node:
		o.Status = v1.NodeStatus{}
	case *v1.Service:
		o.UID, o.GenerateName, o.OwnerReferences, o.Finalizers = "", "", nil, nil
	case *discovery.EndpointSlice:
		// The endpointslice controller's slices carry an owner reference,
		// a Pod reference per endpoint and three *bool per endpoint: at
		// 50 000 endpoints several MB the model never reads.
		o.UID, o.GenerateName, o.OwnerReferences, o.Finalizers = "", "", nil, nil
		o.CreationTimestamp = metav1.Time{}
		for i := range o.Endpoints {
			ep := &o.Endpoints[i]
			ep.TargetRef, ep.DeprecatedTopology = nil, nil
			ep.Conditions.Ready = sharedBool(ep.Conditions.Ready)
			ep.Conditions.Serving = sharedBool(ep.Conditions.Serving)
			ep.Conditions.Terminating = sharedBool(ep.Conditions.Terminating)
		}
	}
	return o, nil
}

// sharedBool replaces a decoded *bool by one of two shared ones: one
// allocation less per condition (the cache's objects are never written).
func sharedBool(b *bool) *bool {
	switch {
	case b == nil:
		return nil
	case *b:
		return &boolTrue
	default:
		return &boolFalse
	}
}

var boolTrue, boolFalse = true, false
