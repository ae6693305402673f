package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
)

// The lab's network, all of it in namespaces this program makes and
// deletes: kupc-net holds the control plane, the e2e binary and the bridge
// that joins the nodes; kupc-nodeN is node N's own network, where its
// containerd, kubelet, host-network pods and Service proxy live. Nothing
// is routed out of kupc-net, so no packet leaves the lab.
const (
	netNS       = "kupc-net"
	labPrefix   = "kupc-"
	bridgeAddr  = "10.88.0.1"
	apiServer   = "https://" + bridgeAddr + ":6443"
	clusterCIDR = "10.244.0.0/16"
	serviceCIDR = "10.96.0.0/16"
	clusterDNS  = "10.96.0.10"
)

func nodeName(i int) string { return fmt.Sprintf("kupc-node%d", i) }
func nodeAddr(i int) string { return fmt.Sprintf("10.88.0.%d", 10+i) }

// proc is a process the lab started; done closes once it was reaped.
type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
}

// lab owns everything a run makes on the machine: namespaces, processes,
// mounts, cgroups and its folder. close undoes all of it, also after a
// failure half-way, and sweep undoes what a killed run left.
type lab struct {
	dir   string
	log   io.Writer
	procs []*proc
	nodes int
	// keepLogs is where close copies the logs (e2e, daemons, kubelets)
	// before the lab's folder goes.
	keepLogs string
}

// start runs bin inside the network namespace ns (nsenter enters only the
// network: ip netns exec would also remount /sys and hide the cgroups a
// kubelet needs), its output in logs/NAME.log.
func (l *lab) start(name, ns string, env []string, bin string, args ...string) (*proc, error) {
	if err := os.MkdirAll(filepath.Join(l.dir, "logs"), 0o755); err != nil {
		return nil, err
	}
	logf, err := os.OpenFile(filepath.Join(l.dir, "logs", name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command("nsenter", append([]string{"--net=/run/netns/" + ns, "--", bin}, args...)...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// nsenter execs bin in place, so bin dies with this program.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); logf.Close(); close(p.done) }()
	l.procs = append(l.procs, p)
	return p, nil
}

func stopProc(p *proc, grace time.Duration) { cluster.StopProcess(p.cmd, p.done, grace) }

// ip runs `ip` inside ns ("" for this namespace).
func ip(ns string, args ...string) error {
	if ns != "" {
		args = append([]string{"-n", ns}, args...)
	}
	return run("", "ip", args...)
}

func sysctlIn(ns string, kv ...string) error {
	for _, s := range kv {
		if err := run("", "nsenter", "--net=/run/netns/"+ns, "--", "sysctl", "-qw", s); err != nil {
			return err
		}
	}
	return nil
}

// network makes the namespaces: the bridge in kupc-net and one veth per
// node, with routes to each node's pod subnet added later (routePods).
func (l *lab) network() error {
	steps := [][]string{
		{"netns", "add", netNS},
		{"-n", netNS, "link", "set", "lo", "up"},
		{"-n", netNS, "link", "add", "br0", "type", "bridge"},
		{"-n", netNS, "addr", "add", bridgeAddr + "/24", "dev", "br0"},
		{"-n", netNS, "link", "set", "br0", "up"},
	}
	for i := 1; i <= l.nodes; i++ {
		n := nodeName(i)
		steps = append(steps,
			[]string{"netns", "add", n},
			[]string{"-n", n, "link", "set", "lo", "up"},
			[]string{"-n", n, "link", "add", "eth0", "type", "veth", "peer", "name", fmt.Sprintf("n%d", i), "netns", netNS},
			[]string{"-n", n, "addr", "add", nodeAddr(i) + "/24", "dev", "eth0"},
			[]string{"-n", n, "link", "set", "eth0", "up"},
			[]string{"-n", n, "route", "add", "default", "via", bridgeAddr},
			[]string{"-n", netNS, "link", "set", fmt.Sprintf("n%d", i), "master", "br0", "up"},
		)
	}
	for _, s := range steps {
		if err := ip("", s...); err != nil {
			return err
		}
	}
	forward := []string{"net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"}
	for _, ns := range l.namespaces() {
		if err := sysctlIn(ns, forward...); err != nil {
			return err
		}
	}
	return nil
}

func (l *lab) namespaces() []string {
	ns := []string{netNS}
	for i := 1; i <= l.nodes; i++ {
		ns = append(ns, nodeName(i))
	}
	return ns
}

// routePods sends node i's pod subnet to it from the network and the
// other nodes (pod addresses are not masqueraded between nodes).
func (l *lab) routePods(i int, podCIDR string) error {
	for _, ns := range l.namespaces() {
		if ns == nodeName(i) {
			continue
		}
		if err := ip(ns, "route", "replace", podCIDR, "via", nodeAddr(i)); err != nil {
			return err
		}
	}
	return nil
}

// close undoes the lab: processes, then what they left (container
// processes and shims, mounts, cgroups, namespaces), then the folder
// unless keep.
func (l *lab) close(keep bool) {
	// Kubelets first, so that nothing restarts what is being stopped.
	for i := len(l.procs) - 1; i >= 0; i-- {
		if strings.HasPrefix(l.procs[i].name, "kubelet") {
			stopProc(l.procs[i], 10*time.Second)
		}
	}
	killLeftovers(l.dir)
	for i := len(l.procs) - 1; i >= 0; i-- {
		stopProc(l.procs[i], 10*time.Second)
	}
	if l.keepLogs != "" {
		os.RemoveAll(l.keepLogs)
		_ = os.MkdirAll(filepath.Dir(l.keepLogs), 0o755)
		if err := os.Rename(filepath.Join(l.dir, "logs"), l.keepLogs); err == nil {
			fmt.Fprintf(l.log, "   logs kept in %s\n", l.keepLogs)
		}
	}
	sweep(l.dir, keep)
}

// sweep removes what a lab in dir left behind, a killed run's included.
func sweep(dir string, keep bool) {
	killLeftovers(dir)
	unmountUnder(dir)
	removeCgroups()
	for _, ns := range labNamespaces() {
		_ = ip("", "netns", "delete", ns)
	}
	if !keep {
		os.RemoveAll(dir)
	}
	matches, _ := filepath.Glob("/var/lib/cni/results/kupc-*")
	for _, m := range matches {
		os.Remove(m)
	}
}

func labNamespaces() []string {
	entries, _ := os.ReadDir("/run/netns")
	var out []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), labPrefix) {
			out = append(out, e.Name())
		}
	}
	return out
}

// killLeftovers kills every process whose command line or working folder
// names the lab folder (containerd shims outlive containerd) and every
// process in the lab's cgroups (the containers).
func killLeftovers(dir string) {
	for round := 0; round < 20; round++ {
		pids := labPids(dir)
		if len(pids) == 0 {
			return
		}
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func labPids(dir string) []int {
	self, parent := os.Getpid(), os.Getppid()
	seen := map[int]bool{}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self || pid == parent {
			continue
		}
		cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if dir != "" && strings.Contains(string(cmdline), dir) {
			seen[pid] = true
		}
	}
	cgs, _ := filepath.Glob("/sys/fs/cgroup/pids/" + labPrefix + "*")
	for _, cg := range cgs {
		_ = filepath.Walk(cg, func(p string, fi os.FileInfo, err error) error {
			if err == nil && fi.Name() == "cgroup.procs" {
				data, _ := os.ReadFile(p)
				for _, f := range strings.Fields(string(data)) {
					if pid, err := strconv.Atoi(f); err == nil && pid != self {
						seen[pid] = true
					}
				}
			}
			return nil
		})
	}
	var out []int
	for pid := range seen {
		out = append(out, pid)
	}
	return out
}

// unmountUnder lazily unmounts every mount below dir, deepest first.
func unmountUnder(dir string) {
	if dir == "" {
		return
	}
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return
	}
	var mounts []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && (fields[4] == dir || strings.HasPrefix(fields[4], dir+"/")) {
			mounts = append(mounts, fields[4])
		}
	}
	f.Close()
	sort.Slice(mounts, func(i, j int) bool { return len(mounts[i]) > len(mounts[j]) })
	for _, m := range mounts {
		_ = syscall.Unmount(m, syscall.MNT_DETACH)
	}
}

// removeCgroups removes the nodes' cgroup trees in every hierarchy,
// deepest first (a cgroup goes only once empty).
func removeCgroups() {
	roots, _ := filepath.Glob("/sys/fs/cgroup/*/" + labPrefix + "*")
	for _, root := range roots {
		var dirs []string
		_ = filepath.Walk(root, func(p string, fi os.FileInfo, err error) error {
			if err == nil && fi.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		sort.Slice(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
		for _, d := range dirs {
			_ = syscall.Rmdir(d)
		}
	}
}

// makeCgroupRoot creates /NAME in every cgroup v1 hierarchy for a
// kubelet's cgroupRoot (cpuset needs its cpus and mems filled in).
func makeCgroupRoot(name string) error {
	hier, _ := filepath.Glob("/sys/fs/cgroup/*")
	for _, h := range hier {
		if fi, err := os.Lstat(h); err != nil || !fi.IsDir() || filepath.Base(h) == "unified" {
			continue
		}
		d := filepath.Join(h, name)
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("cgroup %s: %w", d, err)
		}
		if filepath.Base(h) == "cpuset" {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				data, err := os.ReadFile(filepath.Join(h, f))
				if err != nil {
					return err
				}
				if err := os.WriteFile(filepath.Join(d, f), data, 0o644); err != nil {
					return err
				}
			}
		}
	}
	return nil
}
