package daemon

import (
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
)

// endpointView is one endpoint of a service port, as the source gave it.
type endpointView struct {
	Address     string `json:"address"`
	Ready       bool   `json:"ready"`
	Serving     bool   `json:"serving"`
	Terminating bool   `json:"terminating,omitempty"`
	Node        string `json:"node,omitempty"`
	// ZoneHints and NodeHints are the EndpointSlice's hints (comma-separated).
	ZoneHints string `json:"zoneHints,omitempty"`
	NodeHints string `json:"nodeHints,omitempty"`
	text      string // as the text view shows it
}

type serviceView struct {
	Service     string             `json:"service"`
	Kind        config.Kind        `json:"kind"`
	Family      int                `json:"family"`
	Protocol    string             `json:"protocol"`
	Listen      string             `json:"listen,omitempty"`
	Error       string             `json:"error,omitempty"`
	NodePortErr string             `json:"nodePortError,omitempty"`
	Port        int                `json:"port"`
	NodePort    int                `json:"nodePort,omitempty"`
	ClusterIPs  []string           `json:"clusterIPs"`
	ExternalIPs []string           `json:"externalIPs,omitempty"`
	LBIPs       []string           `json:"loadBalancerIPs,omitempty"`
	Endpoints   []endpointView     `json:"endpoints"`
	Affinity    string             `json:"affinityTimeout,omitempty"`
	Pins        []balance.Affinity `json:"affinity,omitempty"`
	UDPFlows    *int               `json:"udpFlows,omitempty"`
	// Refusing: no endpoint can serve, so connections are refused at
	// connect (a TCP reset, a UDP port unreachable).
	Refusing bool `json:"refusing,omitempty"`
	// Scheduler picks among the endpoints: rr, lc, sh or random.
	Scheduler string `json:"scheduler,omitempty"`
	// TrafficDistribution is the Service's; Topology the hints in use for
	// this listener (PreferSameNode, PreferSameZone, or none), for Zone.
	TrafficDistribution string   `json:"trafficDistribution,omitempty"`
	Topology            string   `json:"topology,omitempty"`
	Zone                string   `json:"zone,omitempty"`
	HealthCheckNodePort int      `json:"healthCheckNodePort,omitempty"`
	SourceRanges        []string `json:"loadBalancerSourceRanges,omitempty"`
	// Health is the state of the endpoints this listener picks from:
	// failures in a row, ejection, drain, connections open.
	Health []balance.EndpointHealth `json:"endpointHealth,omitempty"`
}

// services maps each service port to its listener, addresses, endpoints
// (with their conditions) and affinity table.
// pageOf reads ?limit=N (default 1000) and ?offset=M, or answers 400.
func pageOf(w http.ResponseWriter, r *http.Request) (limit, offset int, ok bool) {
	limit = 1000
	for _, q := range []struct {
		name string
		v    *int
	}{{"limit", &limit}, {"offset", &offset}} {
		if s := r.URL.Query().Get(q.name); s != "" {
			n, err := strconv.Atoi(s)
			if err != nil || n < 0 {
				http.Error(w, q.name+": want a number ≥ 0", http.StatusBadRequest)
				return 0, 0, false
			}
			*q.v = n
		}
	}
	return limit, offset, true
}

// services is every listener with its Service port, endpoints and their
// health: JSON, or ?format=text. ?limit=N (default 1000) and ?offset=M page
// it; X-Total-Count says how many there are (the whole list of a big node
// would cost more memory than the daemon's own state).
func (d *debugServer) services(w http.ResponseWriter, r *http.Request) {
	limit, offset, ok := pageOf(w, r)
	if !ok {
		return
	}
	page, total := d.p.StatusPage(offset, limit)
	w.Header().Set("X-Total-Count", strconv.Itoa(total))
	out := make([]serviceView, 0, len(page))
	for _, fe := range page {
		out = append(out, newServiceView(fe))
	}
	if !wantsText(r) {
		writeJSON(w, out)
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	for _, v := range out {
		v.writeText(w)
	}
	if len(out) < total {
		fmt.Fprintf(w, "(%d of %d listeners from offset %d: ?limit= and ?offset= show others)\n", len(out), total, offset)
	}
}

// newServiceView is the view of one frontend's status.
func newServiceView(fe proxy.FrontendStatus) serviceView {
	sp := fe.Service
	v := serviceView{Service: sp.Name.String(), Kind: fe.Kind, Family: fe.Family, Protocol: string(fe.Protocol),
		Port: sp.Port, NodePort: sp.NodePort, Pins: fe.Affinities, Health: fe.EndpointHealth,
		Scheduler: fe.Scheduler}
	if fe.Err != nil {
		v.Error = fe.Err.Error()
	} else {
		v.Listen = fe.Listen.String()
	}
	v.Refusing = fe.Refusing
	if fe.NodePortErr != nil {
		v.NodePortErr = fe.NodePortErr.Error()
	}
	for _, ip := range sp.ClusterIPs {
		v.ClusterIPs = append(v.ClusterIPs, ip.String())
	}
	for _, ip := range sp.ExternalIPs {
		v.ExternalIPs = append(v.ExternalIPs, ip.String())
	}
	for _, ip := range sp.LoadBalancerIPs {
		v.LBIPs = append(v.LBIPs, ip.String())
	}
	v.Endpoints = []endpointView{}
	for _, ep := range sp.Endpoints {
		text := ep.String()
		if ep.NodeName != "" {
			text += " node=" + ep.NodeName
		}
		if ep.ZoneHints != "" || ep.NodeHints != "" {
			text += " hints=" + strings.Trim(ep.ZoneHints+"/"+ep.NodeHints, "/")
		}
		v.Endpoints = append(v.Endpoints, endpointView{Address: ep.Addr.String(), Ready: ep.Ready, Serving: ep.Serving,
			Terminating: ep.Terminating, Node: ep.NodeName, ZoneHints: ep.ZoneHints, NodeHints: ep.NodeHints, text: text})
	}
	if sp.AffinityTimeout > 0 {
		v.Affinity = sp.AffinityTimeout.String()
	}
	v.TrafficDistribution, v.HealthCheckNodePort = sp.TrafficDistribution, sp.HealthCheckNodePort
	v.Topology, v.Zone = fe.Topology, fe.Zone
	for _, r := range sp.SourceRanges {
		v.SourceRanges = append(v.SourceRanges, r.String())
	}
	if fe.Protocol == config.UDP {
		v.UDPFlows = &fe.UDPFlows
	}
	return v
}

// writeText writes v as the text page's lines.
func (v serviceView) writeText(w io.Writer) {
	fmt.Fprintf(w, "%s %s (IPv%d, %s) listen %s port %d", v.Service, v.Protocol, v.Family, v.Kind, v.Listen, v.Port)
	if v.NodePort != 0 {
		fmt.Fprintf(w, " nodePort %d", v.NodePort)
	}
	fmt.Fprintf(w, "\n  addresses: %s\n", strings.Join(append(append(append([]string(nil), v.ClusterIPs...), v.ExternalIPs...), v.LBIPs...), " "))
	for _, e := range []string{v.Error, v.NodePortErr} {
		if e != "" {
			fmt.Fprintf(w, "  ERROR: %s\n", e)
		}
	}
	texts := make([]string, len(v.Endpoints))
	for i, e := range v.Endpoints {
		texts[i] = e.text
	}
	fmt.Fprintf(w, "  endpoints: %s\n", strings.Join(texts, " "))
	if v.Refusing {
		fmt.Fprintf(w, "  refusing: no endpoint can serve; connections are refused at connect\n")
	}
	if v.Scheduler != "" {
		fmt.Fprintf(w, "  scheduler: %s\n", v.Scheduler)
	}
	if v.Topology != "" || v.TrafficDistribution != "" {
		mode := v.Topology
		if mode == "" {
			mode = "none used (every endpoint counts)"
		}
		fmt.Fprintf(w, "  topology: trafficDistribution %q, hints %s, zone %q\n", v.TrafficDistribution, mode, v.Zone)
	}
	if v.HealthCheckNodePort != 0 {
		fmt.Fprintf(w, "  healthCheckNodePort: %d\n", v.HealthCheckNodePort)
	}
	if len(v.SourceRanges) > 0 {
		fmt.Fprintf(w, "  loadBalancerSourceRanges: %s\n", strings.Join(v.SourceRanges, " "))
	}
	for _, h := range v.Health {
		var notes []string
		if h.EjectedUntil != nil {
			notes = append(notes, fmt.Sprintf("EJECTED until %s (ejection %d in a row)", h.EjectedUntil.Format(time.RFC3339), h.Ejections))
		} else if h.Failures > 0 {
			notes = append(notes, fmt.Sprintf("%d failure(s) in a row", h.Failures))
		}
		if h.Drained {
			notes = append(notes, "DRAINED")
		}
		if len(notes) > 0 || h.Active > 0 {
			fmt.Fprintf(w, "    %s %d open %s\n", h.Endpoint, h.Active, strings.Join(notes, ", "))
		}
	}
	if v.Affinity != "" {
		fmt.Fprintf(w, "  affinity: ClientIP for %s\n", v.Affinity)
		for _, pin := range v.Pins {
			fmt.Fprintf(w, "    %s -> %s until %s\n", pin.Client, pin.Endpoint, pin.Expires.Format(time.RFC3339))
		}
	}
}
