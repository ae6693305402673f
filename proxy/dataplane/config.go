package dataplane

import (
	"net/netip"
	"slices"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/clientaddr"
)

// Config is what the data path is told by the Proxier that owns it (its
// fields are proxy.Config's of the same names, which document them); the
// zero value of every field is a working default.
type Config struct {
	BindAddress         netip.Addr
	PortRange           config.PortRange
	Families            []int // nil: both
	NodePortsRestricted bool

	DialTimeouts   []time.Duration // DefaultDialTimeouts when nil
	TCPIdleTimeout time.Duration   // 0: none
	ParkIdleAfter  time.Duration   // DefaultParkIdleAfter when 0, never when negative
	FileLimit      int             // 0: the process's RLIMIT_NOFILE
	UDPTimeout     time.Duration   // DefaultUDPTimeout when 0
	UDPMaxFlows    int             // per frontend; DefaultUDPMaxFlows when 0

	BackendSource clientaddr.Mode
	LocalTraffic  config.LocalTraffic
	GuardAtAccept bool
	Kernel        *config.KernelReport

	Log         logrus.FieldLogger // logrus.StandardLogger() when nil
	ConnLog     logrus.FieldLogger // Log when nil
	ConnLogMode ConnLogMode
	ConnLogRate float64 // DefaultConnLogRate when 0, unbounded when negative
}

// DefaultConnLogRate is ConnLogRate's default (lines per second).
const DefaultConnLogRate = 100

// ConnLogMode selects the per-connection log lines.
type ConnLogMode string

const (
	// ConnLogErrors logs connections that did not end by a normal close:
	// resets, no endpoints, failed dials, idle timeouts, shutdown. It does
	// not flood under normal traffic.
	ConnLogErrors ConnLogMode = "errors"
	ConnLogAll    ConnLogMode = "all"
	ConnLogNone   ConnLogMode = "none"
)

func (c *Config) logConn(protocol config.Protocol, cause Cause) bool {
	switch c.ConnLogMode {
	case ConnLogAll:
		return true
	case ConnLogNone:
		return false
	}
	return !cause.Normal(protocol)
}

// DefaultParkIdleAfter: an idle connection costs no goroutine after this.
// A pause of one costs an epoll_ctl and a goroutine hand-off, small beside
// a pause this long. Shorter is less memory in a burst of new connections:
// every copy holds its goroutine's stack until it parks, and the Go heap
// keeps the high-water mark.
const DefaultParkIdleAfter = 25 * time.Millisecond

func (c *Config) parkIdleAfter() time.Duration {
	switch {
	case c.ParkIdleAfter < 0:
		return 0
	case c.ParkIdleAfter == 0:
		return DefaultParkIdleAfter
	}
	return c.ParkIdleAfter
}

func (c *Config) dialTimeouts() []time.Duration {
	if len(c.DialTimeouts) == 0 {
		return DefaultDialTimeouts
	}
	return c.DialTimeouts
}

func (c *Config) udpTimeout() time.Duration {
	if c.UDPTimeout <= 0 {
		return DefaultUDPTimeout
	}
	return c.UDPTimeout
}

func (c *Config) udpMaxFlows() int {
	if c.UDPMaxFlows <= 0 {
		return DefaultUDPMaxFlows
	}
	return c.UDPMaxFlows
}

func (c *Config) connLog() logrus.FieldLogger {
	if c.ConnLog == nil {
		return c.log()
	}
	return c.ConnLog
}

// DebugEnabled says whether log writes debug lines: a line per listener
// is not even made otherwise.
func DebugEnabled(log logrus.FieldLogger) bool {
	switch l := log.(type) {
	case *logrus.Entry:
		return l.Logger.IsLevelEnabled(logrus.DebugLevel)
	case *logrus.Logger:
		return l.IsLevelEnabled(logrus.DebugLevel)
	}
	return true
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
