package proxy

import (
	"net/netip"
	"slices"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/balance"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/clientaddr"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/dataplane"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/healthcheck"
)

// Config holds the Proxier's settings; the zero value of every field is a
// working default.
type Config struct {
	// BindAddress is where listeners bind. Unspecified (the default) binds
	// 0.0.0.0 for IPv4 frontends and :: for IPv6 ones; a specific address is
	// used for frontends of its family.
	BindAddress netip.Addr
	PortRange   config.PortRange
	// Families are the address families frontends open for: those whose
	// rules (and guard of the proxy port range) are in place. Nil: both.
	// A family without its guard must not open listeners, which other
	// hosts could then reach directly.
	Families []int

	DialTimeouts   []time.Duration // per attempt; dataplane.DefaultDialTimeouts when nil
	TCPIdleTimeout time.Duration   // 0: no idle timeout
	// ParkIdleAfter is how long a direction of a TCP connection has
	// nothing to read before its goroutine is given up and the socket
	// waits in the dataplane's Parker; dataplane.DefaultParkIdleAfter when 0,
	// never when negative.
	ParkIdleAfter time.Duration
	// Events, when set, records a Service's own trouble as an Event on it
	// (the cluster source): reason "NodePortConflict".
	Events func(sp *config.ServicePort, reason, message string)
	// FileLimit is the descriptor limit the data path's budget is derived from;
	// 0: the process's RLIMIT_NOFILE when New is called.
	FileLimit int
	// Outlier is passive outlier detection (package balance); the zero value
	// turns it off. A Service turns it off for itself with the annotation
	// kube-userspace-proxy.io/outlier-detection: "off".
	Outlier     balance.OutlierConfig
	UDPTimeout  time.Duration // dataplane.DefaultUDPTimeout when 0
	UDPMaxFlows int           // per frontend; dataplane.DefaultUDPMaxFlows when 0

	// NodePortsRestricted is set when NodePorts are served on some node
	// addresses only (--nodeport-addresses). A listener then cannot sit on
	// 0.0.0.0:NodePort (it would answer on every address); a bound,
	// non-listening socket holds the port instead.
	NodePortsRestricted bool

	MinSyncPeriod time.Duration // at most one sync per period (bursts are merged); 0: no limit
	SyncPeriod    time.Duration // rules are re-checked this often; 30 s when 0

	// BackendSource is --backend-source-address: whose address backends
	// see (package clientaddr); "" is auto.
	BackendSource clientaddr.Mode
	// LocalTraffic is --detect-local-mode and its values: the pods of this
	// node, whose own address their backends see.
	LocalTraffic config.LocalTraffic

	// Rules programs the kernel redirects; nil means none (listeners only).
	Rules Rules
	// GuardAtAccept resets a TCP connection that reached a listener of
	// the proxy port range directly from another host (not redirected by
	// a rule), before any byte or dial, and drops the datagrams of a UDP
	// flow that did so (asked of conntrack netlink once per new flow,
	// where the kernel has it): the guard where the kernel has no
	// conntrack match for the filter table's (package dataplane).
	GuardAtAccept bool
	// Kernel gathers the optional kernel pieces the dataplane found at New
	// (the source NAT per family, br_netfilter); nil: not gathered.
	Kernel *config.KernelReport
	// Keeper keeps a duplicate of every frontend's listening socket in a
	// supervising process (handover.KeeperLink), so that the sockets
	// outlive this one's crash; nil keeps none (keeper.go).
	Keeper SocketKeeper
	// ServiceHealth serves the Services' health check node ports
	// (healthcheck.Server); nil serves none.
	ServiceHealth interface{ Sync([]healthcheck.Service) }

	Log     logrus.FieldLogger // logrus.StandardLogger() when nil
	ConnLog logrus.FieldLogger // per-connection lines; Log when nil
	// ConnLogMode says which connections get their line (at info level):
	// dataplane.ConnLogErrors (the zero value), ConnLogAll or ConnLogNone.
	ConnLogMode dataplane.ConnLogMode
	// ConnLogRate bounds the connection log lines per second (a burst of
	// twice as many passes): a flood of resets or spoofed datagrams must
	// not become a log flood. The lines over it are counted and the count
	// logged with the next line that passes. 0: dataplane.DefaultConnLogRate;
	// negative: unbounded.
	ConnLogRate float64
}

// serves says whether frontends of family fam open.
func (c *Config) serves(fam int) bool {
	return c.Families == nil || slices.Contains(c.Families, fam)
}

func (c *Config) log() logrus.FieldLogger {
	if c.Log == nil {
		return logrus.StandardLogger()
	}
	return c.Log
}

// outlierFor is the outlier detection of sp's frontends.
func (c *Config) outlierFor(sp *config.ServicePort) balance.OutlierConfig {
	if sp.OutlierDetection == "off" {
		return balance.OutlierConfig{}
	}
	return c.Outlier
}

// dataplane is what the data path is told of c.
func (c *Config) dataplane() *dataplane.Config {
	return &dataplane.Config{
		BindAddress: c.BindAddress, PortRange: c.PortRange, Families: c.Families, NodePortsRestricted: c.NodePortsRestricted,
		DialTimeouts: c.DialTimeouts, TCPIdleTimeout: c.TCPIdleTimeout, ParkIdleAfter: c.ParkIdleAfter, FileLimit: c.FileLimit,
		UDPTimeout: c.UDPTimeout, UDPMaxFlows: c.UDPMaxFlows,
		BackendSource: c.BackendSource, LocalTraffic: c.LocalTraffic, GuardAtAccept: c.GuardAtAccept, Kernel: c.Kernel,
		Log: c.Log, ConnLog: c.ConnLog, ConnLogMode: c.ConnLogMode, ConnLogRate: c.ConnLogRate,
	}
}
