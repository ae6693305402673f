package daemon

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/internal/options"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/config"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
)

// Where the settings live; tests point these at copies.
var (
	conntrackSysctls      = kernel.ProcSys
	conntrackHashsizePath = "/sys/module/nf_conntrack/parameters/hashsize"
)

// applyConntrack writes what differs from the kernel's values, as kube-proxy does,
// and says what it could not: a setting the kernel refuses is a warning
// naming the sysctl, never a reason not to serve. The table size is
// host-wide, so it is raised only where the kernel lets this namespace
// write it (the host's own network namespace). A refusal goes to report,
// said in the start line, or without one (--sysctls-only) to the log.
func applyConntrack(c options.Conntrack, log logrus.FieldLogger, report *config.KernelReport) {
	refused := func(entry *logrus.Entry, err error, what string) {
		if report == nil {
			entry.WithError(err).Warn(what)
			return
		}
		entry.WithError(err).Debug(what)
		report.Lacks(config.PieceConntrackSysctl, "kube-proxy's conntrack settings are not all applied (the kernel's values stay; debug log)", err)
	}
	if want := c.Max(runtime.NumCPU()); want > 0 {
		raiseConntrackMax(want, log, refused)
	}
	secs := func(d time.Duration) int { return int(d / time.Second) }
	for _, s := range []struct {
		name  string
		value int
		set   bool
	}{
		{"nf_conntrack_tcp_timeout_established", secs(c.TCPEstablished), c.TCPEstablished > 0},
		{"nf_conntrack_tcp_timeout_close_wait", secs(c.TCPCloseWait), c.TCPCloseWait > 0},
		{"nf_conntrack_tcp_be_liberal", 1, c.TCPBeLiberal},
		{"nf_conntrack_udp_timeout", secs(c.UDPTimeout), c.UDPTimeout > 0},
		{"nf_conntrack_udp_timeout_stream", secs(c.UDPStream), c.UDPStream > 0},
	} {
		if !s.set {
			continue
		}
		changed, err := setSysctl(s.name, s.value)
		entry := log.WithFields(logrus.Fields{"sysctl": "net.netfilter." + s.name, "value": s.value})
		switch {
		case err != nil:
			refused(entry, err, "Cannot set the conntrack sysctl; the kernel's value stays")
		case changed:
			entry.Info("Set conntrack sysctl")
		}
	}
}

func raiseConntrackMax(want int, log logrus.FieldLogger, refused func(*logrus.Entry, error, string)) {
	entry := log.WithFields(logrus.Fields{"sysctl": "net.netfilter.nf_conntrack_max", "value": want})
	fi, err := os.Stat(conntrackSysctls.Path("net.netfilter.nf_conntrack_max"))
	if err != nil {
		refused(entry, err, "Cannot read the conntrack table size (is nf_conntrack loaded?)")
		return
	}
	if fi.Mode().Perm()&0o200 == 0 {
		entry.Info("The conntrack table size is host-wide and read-only in this network namespace: left to the host")
		return
	}
	cur, err := conntrackSysctls.ReadInt("net.netfilter.nf_conntrack_max")
	if err != nil || cur >= want {
		return // kube-proxy only raises it
	}
	if _, err := setSysctl("nf_conntrack_max", want); err != nil {
		refused(entry, err, "Cannot raise the conntrack table size")
		return
	}
	entry.Info("Raised the conntrack table size")
	if hs, err := readInt(conntrackHashsizePath); err == nil && hs < want/4 {
		if err := os.WriteFile(conntrackHashsizePath, []byte(strconv.Itoa(want/4)), 0o640); err != nil {
			refused(entry, err, "Cannot raise the conntrack hash table (nf_conntrack hashsize)")
		}
	}
}

// readInt reads a file holding one integer (a module parameter).
func readInt(p string) (int, error) {
	data, err := os.ReadFile(p)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(string(data)))
}

// setSysctl writes net.netfilter.name when the kernel holds another value.
func setSysctl(name string, value int) (bool, error) {
	changed, err := conntrackSysctls.SetInt("net.netfilter."+name, value)
	if errors.Is(err, kernel.ErrNoSysctl) {
		return false, fmt.Errorf("%w (is nf_conntrack loaded?)", err)
	}
	return changed, err
}
