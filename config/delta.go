package config

import (
	"slices"
)

// The change protocol between sources and consumers, in one place:
//
//   - A source numbers its States (Seq). A State made from the one before
//     says so (Since) and lists the only ports that may differ (Changed).
//   - A source hands on an unchanged port as the same pointer
//     (ReuseUnchanged), so a consumer tells it unchanged without comparing.
//
// Consumers read neither by hand: Diff turns two States into a Delta, Merge
// joins two Deltas, and ComparePorts says how much one port changed.

// Delta is the change from one State to another.
type Delta struct {
	From, To *State // From is nil before the first State
	// Changed names the only ports that may differ, each once; nil: any
	// may have (every port must be looked at).
	Changed []ServicePortName
}

// Diff returns the change from → to: the ports to's source says changed
// since from, or every port when it cannot say (from is not the State to was
// made from).
func Diff(from, to *State) Delta {
	d := Delta{From: from, To: to}
	switch {
	case from == to:
		d.Changed = []ServicePortName{}
	case from != nil && from.Seq != 0 && to.Since == from.Seq:
		d.Changed = dedup(to.Changed)
	}
	return d
}

// Merge returns the change d and then next (next.From is d.To): from
// d.From to next.To.
func (d Delta) Merge(next Delta) Delta {
	m := Delta{From: d.From, To: next.To}
	if d.Changed != nil && next.Changed != nil && next.From == d.To {
		m.Changed = dedup(slices.Concat(d.Changed, next.Changed))
	}
	return m
}

// All reports whether every port must be looked at.
func (d Delta) All() bool { return d.Changed == nil }

// Names returns the ports that may differ: Changed, or every port of From
// and To.
func (d Delta) Names() []ServicePortName {
	if !d.All() {
		return d.Changed
	}
	var names []ServicePortName
	for name := range d.To.Ports {
		names = append(names, name)
	}
	if d.From != nil {
		for name := range d.From.Ports {
			if d.To.Ports[name] == nil {
				names = append(names, name)
			}
		}
	}
	return names
}

// Port returns how the port name changed.
func (d Delta) Port(name ServicePortName) PortChange {
	var from *ServicePort
	if d.From != nil {
		from = d.From.Ports[name]
	}
	return ComparePorts(from, d.To.Ports[name])
}

// Counts returns the service ports added, removed or changed in their
// frontend or affinity, and those whose endpoints changed (kube-proxy's
// service and endpoint change counts).
func (d Delta) Counts() (services, endpoints int) {
	for _, name := range d.Names() {
		var from, to *ServicePort
		if d.From != nil {
			from = d.From.Ports[name]
		}
		to = d.To.Ports[name]
		switch {
		case from == to:
		case ComparePorts(from, to) == PortFrontend || from.AffinityTimeout != to.AffinityTimeout:
			services++
		case !slices.Equal(from.Endpoints, to.Endpoints):
			endpoints++
		}
	}
	return services, endpoints
}

func dedup(names []ServicePortName) []ServicePortName {
	out := make([]ServicePortName, 0, len(names))
	seen := make(map[ServicePortName]bool, len(names))
	for _, n := range names {
		if !seen[n] {
			seen[n] = true
			out = append(out, n)
		}
	}
	return out
}

// PortChange says how much a service port changed, least first.
type PortChange int

const (
	// PortSame: equal in every field.
	PortSame PortChange = iota
	// PortBalancing: the listener and the rules stay; what the balancer
	// does changes (endpoints, affinity, scheduler, annotations, the
	// health check port).
	PortBalancing
	// PortRules: the listener stays, its rules change (source ranges,
	// traffic policies: a policy changes which endpoints a listener
	// serves and which rules lead to it, and may add or remove a
	// listener of another kind, but one whose kind stays keeps serving).
	PortRules
	// PortFrontend: the listener must be opened anew (addresses, ports,
	// protocol), or the port was added or removed.
	PortFrontend
)

// ComparePorts returns how b differs from a; nil is a port that does not
// exist. It is the one comparison of ServicePorts: every field is in exactly
// one of its groups (TestComparePortsSeesEveryField).
func ComparePorts(a, b *ServicePort) PortChange {
	switch {
	case a == b:
		return PortSame // sources hand on an unchanged port as the same pointer
	case a == nil || b == nil:
		return PortFrontend
	case a.Name != b.Name || a.Protocol != b.Protocol || a.Port != b.Port || a.NodePort != b.NodePort ||
		!slices.Equal(a.ClusterIPs, b.ClusterIPs) || !slices.Equal(a.ExternalIPs, b.ExternalIPs) ||
		!slices.Equal(a.LoadBalancerIPs, b.LoadBalancerIPs):
		return PortFrontend
	case !slices.Equal(a.SourceRanges, b.SourceRanges) || a.InternalLocal != b.InternalLocal || a.ExternalLocal != b.ExternalLocal:
		return PortRules
	case a.AffinityTimeout != b.AffinityTimeout || a.OutlierDetection != b.OutlierDetection ||
		a.Scheduler != b.Scheduler || a.ProxyProtocol != b.ProxyProtocol || !a.Created.Equal(b.Created) ||
		a.BackendSource != b.BackendSource ||
		a.HealthCheckNodePort != b.HealthCheckNodePort || a.TrafficDistribution != b.TrafficDistribution ||
		!slices.Equal(a.Endpoints, b.Endpoints):
		return PortBalancing
	}
	return PortSame
}

// SameFrontend reports whether a listener opened for sp can keep serving o.
func (sp *ServicePort) SameFrontend(o *ServicePort) bool { return ComparePorts(sp, o) < PortFrontend }

// SameRules reports whether sp and o need the same kernel rules.
func (sp *ServicePort) SameRules(o *ServicePort) bool { return ComparePorts(sp, o) < PortRules }

// Equal reports whether sp and o are the same in every field.
func (sp *ServicePort) Equal(o *ServicePort) bool { return ComparePorts(sp, o) == PortSame }
