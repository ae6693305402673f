package daemon

// explain: "this client, this address: which rule catches it, which
// listener, which endpoint, and why" — offline from manifests (the
// subcommand) or live from the daemon (GET /debug/explain). The rule walk is
// iptables.Trace over the rules as rendered or as installed; the listener's
// answer is proxy's Explain.

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/internal/options"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// explainQuery is one question: a new connection from From to To.
type explainQuery struct {
	From     netip.Addr
	To       netip.AddrPort
	Protocol config.Protocol
}

func parseExplainQuery(from, to, protocol string) (explainQuery, error) {
	var q explainQuery
	var err error
	if q.From, err = netip.ParseAddr(from); err != nil {
		return q, fmt.Errorf("from: want the client's IP address, got %q", from)
	}
	if q.To, err = netip.ParseAddrPort(to); err != nil {
		return q, fmt.Errorf("to: want IP:PORT ([IPv6]:PORT), got %q", to)
	}
	q.From, q.To = q.From.Unmap(), netip.AddrPortFrom(q.To.Addr().Unmap(), q.To.Port())
	switch strings.ToUpper(protocol) {
	case "", "TCP":
		q.Protocol = config.TCP
	case "UDP":
		q.Protocol = config.UDP
	default:
		return q, fmt.Errorf("protocol: want tcp or udp, got %q", protocol)
	}
	if config.Family(q.From) != config.Family(q.To.Addr()) {
		return q, errors.New("from and to are of different IP families")
	}
	return q, nil
}

// explainAnswer is explain's whole answer, JSON as /debug/explain serves it.
type explainAnswer struct {
	From     string          `json:"from"`
	To       string          `json:"to"`
	Protocol config.Protocol `json:"protocol"`
	// Origin: "node" when the node itself connects (nat OUTPUT), else
	// "pod or other host" (nat PREROUTING).
	Origin   string `json:"origin"`
	DstLocal bool   `json:"dstIsNodeAddress"`
	// Rules is the packet's walk through our chains (absent without rules).
	Rules *iptables.TraceResult `json:"rules,omitempty"`
	// Delivery says where the first packet ends up.
	Delivery string `json:"delivery"`
	// Service is the listener's side, when a Service port takes the connection.
	Service *proxy.Explanation `json:"service,omitempty"`
	Notes   []string           `json:"notes,omitempty"`
	// Offline: from manifests, before any listener exists.
	Offline bool   `json:"offline"`
	Node    string `json:"node"`
}

// explainer answers queries from one view of frontends and rules.
type explainer struct {
	node      string
	frontends []config.Frontend
	// nodeAddrs are the node's addresses (NodePorts, and where the client is the node).
	nodeAddrs []netip.Addr
	// rules returns family fam's rules to walk; ok false without rules.
	rules func(fam int) (in iptables.TraceInput, ok bool, err error)
	// placeholders: the rules name listeners by placeholder (offline).
	placeholders bool
	// service explains a matched frontend.
	service func(fe config.Frontend, as string, client netip.Addr) proxy.Explanation
	offline bool
	// guardTCP, guardUDP: the daemon guards the proxy ports itself (no
	// conntrack match; UDP only where conntrack netlink answers).
	guardTCP, guardUDP bool
}

func (e *explainer) isNodeAddr(a netip.Addr) bool {
	return a.IsLoopback() || slices.Contains(e.nodeAddrs, a)
}

func (e *explainer) explain(q explainQuery) explainAnswer {
	fam := config.Family(q.To.Addr())
	ans := explainAnswer{From: q.From.String(), To: q.To.String(), Protocol: q.Protocol, Origin: "pod or other host",
		DstLocal: e.isNodeAddr(q.To.Addr()), Offline: e.offline, Node: e.node}
	fromNode := e.isNodeAddr(q.From)
	if fromNode {
		ans.Origin = "node"
	}
	pkt := iptables.Packet{Src: q.From, Dst: q.To.Addr(), Port: int(q.To.Port()), Protocol: strings.ToLower(string(q.Protocol)),
		FromNode: fromNode, DstLocal: ans.DstLocal}

	matched, as, found := proxy.Match(e.frontends, q.To, q.Protocol, ans.DstLocal)
	var fe config.Frontend
	haveFE := false
	in, haveRules, err := e.rules(fam)
	if err != nil {
		ans.Notes = append(ans.Notes, "packet counters unavailable: "+err.Error())
	}
	if haveRules {
		tr := iptables.Trace(in, pkt)
		ans.Rules = &tr
		switch tr.NAT.Target {
		case "REDIRECT", "DNAT":
			for _, f := range e.frontends {
				if f.Family == fam && f.Protocol == q.Protocol && f.Err == nil && iptables.TargetPort(f, e.placeholders) == tr.NAT.ToPort {
					fe, haveFE = f, true
					break
				}
			}
			where := "the address it arrived on"
			if fromNode {
				where = map[int]string{4: "127.0.0.1", 6: "::1"}[fam]
			}
			if tr.NAT.Target == "DNAT" {
				where = tr.NAT.ToAddr
			}
			ans.Delivery = fmt.Sprintf("%s to port %s on %s: the listener there accepts the connection", tr.NAT.Target, tr.NAT.ToPort, where)
			if !haveFE {
				ans.Notes = append(ans.Notes, "no listener has port "+tr.NAT.ToPort+" now: the rules are older than the listeners (a sync is pending)")
			}
		default:
			if found && as == proxy.AsNodePort && (matched.OnNodePort() || (e.offline && matched.Listen.Port() != 0)) {
				fe, haveFE = matched, true
				ans.Delivery = fmt.Sprintf("no nat rule needed: the listener sits on NodePort %d itself", matched.Service.NodePort)
			} else if direct, ok := e.reachedDirectly(q, fromNode); ok {
				fe, haveFE = e.directDelivery(&ans, direct, q.Protocol)
			} else if ans.DstLocal {
				ans.Delivery = "no rule of ours catches it: it goes to whatever listens on that port of the node"
			} else {
				ans.Delivery = "no rule of ours catches it: the packet goes on to its destination unchanged"
			}
		}
		switch tr.Filter.Target {
		case "DROP":
			if last := tr.Guard[len(tr.Guard)-1]; last.Chain == iptables.ChainGuard {
				ans.Delivery += "; then the guard DROPS it in filter " + tr.FilterHook + ": a proxy port reached directly, not through a Service address"
			} else {
				ans.Delivery += "; then filter " + tr.FilterHook + " DROPS it: the client is outside the Service's loadBalancerSourceRanges"
			}
			haveFE = false
		case "RETURN":
			ans.Notes = append(ans.Notes, "the guard lets it through: a listener on its NodePort inside the proxy port range")
		}
	} else {
		fe, haveFE = matched, found
		ans.Delivery = "no rules on this node (--iptables=false): only connections to a listener's own port reach it"
	}
	if haveFE {
		if !found || matched.Service != fe.Service || matched.Kind != fe.Kind {
			// The rules caught it for a frontend; say what the
			// destination is to that Service.
			_, as, _ = proxy.Match([]config.Frontend{fe}, q.To, q.Protocol, true)
			if as == "" {
				as, _ = proxy.MatchLocalClient(fe, q.To, q.Protocol)
			}
		}
		x := e.service(fe, as, q.From)
		ans.Service = &x
	} else if found && ans.Rules != nil && ans.Rules.Filter.Target != "DROP" {
		ans.Notes = append(ans.Notes, fmt.Sprintf("%s has %s as its %s, but no rule leads there: its listener failed, or its NodePort is held by another process (see /debug/services)",
			matched.Service.Name, q.To, as))
	}
	return ans
}

// explainHTTP is GET /debug/explain?from=IP&to=IP:PORT&protocol=TCP: JSON,
// or text with ?format=text or Accept: text/plain.
func (d *debugServer) explainHTTP(w http.ResponseWriter, r *http.Request) {
	q, err := parseExplainQuery(r.URL.Query().Get("from"), r.URL.Query().Get("to"), r.URL.Query().Get("protocol"))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	ans := d.explainer().explain(q)
	if wantsText(r) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		writeExplainText(w, ans)
		return
	}
	writeJSON(w, ans)
}

// reachedDirectly is the frontend whose listener of the proxy port range
// a packet from another host to q.To reaches without a rule, where the
// daemon guards those ports itself.
func (e *explainer) reachedDirectly(q explainQuery, fromNode bool) (config.Frontend, bool) {
	if !e.guardTCP || fromNode || !e.isNodeAddr(q.To.Addr()) {
		return config.Frontend{}, false
	}
	for _, f := range e.frontends {
		if f.Protocol == q.Protocol && f.Err == nil && !f.OnNodePort() && f.Listen.Port() == q.To.Port() {
			return f, true
		}
	}
	return config.Frontend{}, false
}

// directDelivery says what the daemon's guard does with a packet that
// reached fe's listener directly; the frontend that serves it, if any.
func (e *explainer) directDelivery(ans *explainAnswer, fe config.Frontend, proto config.Protocol) (config.Frontend, bool) {
	what := "no rule of ours catches it: it reaches the listener of " + fe.Service.Name.String() + " directly, "
	switch {
	case proto == config.TCP:
		ans.Delivery = what + "which RESETS it at accept: a proxy port reached directly, not through a Service address (no conntrack match: the daemon guards the ports)"
	case e.guardUDP:
		ans.Delivery = what + "which DROPS the flow's datagrams: a proxy port reached directly, not through a Service address (no conntrack match: the daemon guards the ports, asking conntrack netlink)"
	default:
		ans.Delivery = what + "which serves it: without the conntrack match and conntrack netlink nothing tells a direct UDP flow from a redirected one (docs/iptables.md)"
		return fe, true
	}
	return config.Frontend{}, false
}

// explainer is the live view: the frontends as last synced, the rules as
// last written with the kernel's counters, the real balancers.
func (d *debugServer) explainer() *explainer {
	e := &explainer{node: d.node, frontends: d.p.Frontends(), guardTCP: d.guardTCP, guardUDP: d.guardUDP,
		service: func(fe config.Frontend, as string, client netip.Addr) proxy.Explanation {
			return d.p.Explain(fe, as, client)
		},
		rules: func(int) (iptables.TraceInput, bool, error) { return iptables.TraceInput{}, false, nil },
	}
	for _, fam := range []int{4, 6} {
		e.nodeAddrs = append(e.nodeAddrs, iptables.LocalAddrs(fam, nil)...)
	}
	if d.rules != nil {
		e.rules = func(fam int) (iptables.TraceInput, bool, error) { return d.rules.TraceInput(fam, true) }
	}
	return e
}

// RunExplain is the explain subcommand; it returns the exit code.
func RunExplain(args []string, stdout, stderr io.Writer) int {
	fs := pflag.NewFlagSet("kube-userspace-proxy explain", pflag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.SortFlags = false
	var manifests, from, to, protocol, node, bind, output, server, clusterCIDR string
	var nodeIPs, nodePortAddrs []string
	fs.StringVar(&manifests, "manifests", "", "The Services and EndpointSlices to explain (a YAML/JSON file or directory).")
	fs.StringVar(&from, "from", "", "The client's IP address: a pod, another host, or one of the node's own addresses (then the node connects).")
	fs.StringVar(&to, "to", "", "The destination IP:PORT ([IPv6]:PORT): a ClusterIP, externalIP or LoadBalancer IP with the Service port, or a node address with a NodePort.")
	fs.StringVar(&protocol, "protocol", "tcp", "tcp or udp.")
	fs.StringVar(&node, "hostname-override", "", "The node's name, for traffic policy Local (default: $NODE_NAME, else the hostname).")
	fs.StringSliceVar(&nodeIPs, "node-ip", nil, "The node's addresses, for NodePorts and to tell the node's own connections (comma-separated; default: this machine's).")
	fs.StringVar(&bind, "bind-address", "0.0.0.0", "As the daemon's flag: where listeners would bind.")
	fs.StringSliceVar(&nodePortAddrs, "nodeport-addresses", nil, "As the daemon's flag: NodePorts only on node addresses inside these CIDRs.")
	fs.StringVar(&clusterCIDR, "cluster-cidr", "", "As the daemon's flag: the pods' range(s), so that a pod on this node counts as a local client of externalTrafficPolicy: Local Services.")
	fs.StringVar(&output, "output", "text", "text or json.")
	fs.StringVar(&server, "server", "", "Ask a running daemon instead, at its metrics address (http://127.0.0.1:10249): its real listeners, rules, counters, pins and round-robin positions.")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: kube-userspace-proxy explain --manifests FILE --from IP --to IP:PORT [--protocol tcp|udp]\n"+
			"       kube-userspace-proxy explain --server http://127.0.0.1:10249 --from IP --to IP:PORT\n\n"+
			"Walks a connection's first packet through the rules the daemon installs, to the listener and the endpoint\n"+
			"the balancer would choose, and says why. Needs no root and changes nothing.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	fail := func(err error) int {
		fmt.Fprintf(stderr, "kube-userspace-proxy explain: %v\n", err)
		return ExitUsage
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			return 0
		}
		return ExitUsage
	}
	if output != "text" && output != "json" {
		return fail(fmt.Errorf("--output: want text or json, got %q", output))
	}
	q, err := parseExplainQuery(from, to, protocol)
	if err != nil {
		return fail(fmt.Errorf("--%w", err))
	}
	if server != "" {
		return explainRemote(server, q, output, stdout, stderr)
	}
	if manifests == "" {
		return fail(errors.New("--manifests (or --server) is required"))
	}
	o := &options.Options{HostnameOverride: node}
	if o.BindAddress, err = netip.ParseAddr(bind); err != nil {
		return fail(fmt.Errorf("--bind-address: %w", err))
	}
	for _, c := range nodePortAddrs {
		p, err := netip.ParsePrefix(c)
		if err != nil {
			return fail(fmt.Errorf("--nodeport-addresses: %w", err))
		}
		o.NodePortCIDRs = append(o.NodePortCIDRs, p)
	}
	o.Local.Mode = config.LocalModeClusterCIDR
	if o.Local.CIDRs, err = config.ParseCIDRs(clusterCIDR); err != nil {
		return fail(fmt.Errorf("--cluster-cidr: %w", err))
	}
	e, err := offlineExplainer(o, nodeIPs, manifests)
	if err != nil {
		if errors.As(err, new(UsageError)) {
			return fail(err)
		}
		fmt.Fprintf(stderr, "kube-userspace-proxy explain: %v\n", err)
		return ExitFailure
	}
	ans := e.explain(q)
	if output == "json" {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		_ = enc.Encode(ans)
	} else {
		writeExplainText(stdout, ans)
	}
	return 0
}

// offlineExplainer explains with the rules and balancers the daemon would
// make of manifests, without one running.
func offlineExplainer(o *options.Options, nodeIPs []string, manifests string) (*explainer, error) {
	e := &explainer{node: o.NodeName(), placeholders: true, offline: true}
	for _, s := range nodeIPs {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return nil, UsageError{fmt.Errorf("--node-ip: %w", err)}
		}
		e.nodeAddrs = append(e.nodeAddrs, a.Unmap())
	}
	if len(nodeIPs) == 0 {
		e.nodeAddrs = append(iptables.LocalAddrs(4, nil), iptables.LocalAddrs(6, nil)...)
	}
	st, _, err := config.LoadManifests(manifests, e.node)
	if err != nil {
		return nil, err
	}
	e.frontends = proxy.Plan(st, o.BindAddress, len(o.NodePortCIDRs) > 0)
	features := iptables.Features{Comment: true, Addrtype: true, Conntrack: true}
	e.rules = func(fam int) (iptables.TraceInput, bool, error) {
		ro := iptables.RenderOptions{Family: fam, Features: features, AllLocal: len(o.NodePortCIDRs) == 0, Placeholders: true,
			ProxyPorts: config.DefaultPortRange, LocalTraffic: o.Local}
		if !ro.AllLocal {
			for _, a := range e.nodeAddrs {
				for _, c := range o.NodePortCIDRs {
					if config.Family(a) == fam && c.Contains(a) {
						ro.NodePortAddresses = append(ro.NodePortAddresses, a)
					}
				}
			}
		}
		return iptables.TraceInput{Rules: iptables.Render(e.frontends, ro), Features: features}, true, nil
	}
	e.service = func(fe config.Frontend, as string, client netip.Addr) proxy.Explanation {
		return proxy.ExplainPlanned(fe, as, client, e.node, st.Zone)
	}
	return e, nil
}

// explainRemote asks a running daemon's /debug/explain.
func explainRemote(server string, q explainQuery, output string, stdout, stderr io.Writer) int {
	v := url.Values{"from": {q.From.String()}, "to": {q.To.String()}, "protocol": {string(q.Protocol)}}
	if output == "text" {
		v.Set("format", "text")
	}
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(strings.TrimRight(server, "/") + "/debug/explain?" + v.Encode())
	if err != nil {
		fmt.Fprintf(stderr, "kube-userspace-proxy explain: asking the daemon: %v\n", err)
		return ExitFailure
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		fmt.Fprintf(stderr, "kube-userspace-proxy explain: %s: %s\n", resp.Status, strings.TrimSpace(string(body)))
		return ExitFailure
	}
	_, _ = io.Copy(stdout, resp.Body)
	return 0
}
