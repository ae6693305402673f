package cluster

import (
	"context"
	"fmt"
	"net"
	"runtime"
	"strings"

	"golang.org/x/sys/unix"
)

// InNetns runs f with the calling thread inside the named network namespace
// (/var/run/netns/NAME, or NAME itself when it is an absolute path); sockets
// f creates stay in it. Empty name: just f.
func InNetns(name string, f func() error) error {
	if name == "" {
		return f()
	}
	runtime.LockOSThread()
	if unix.Gettid() == unix.Getpid() {
		// The main thread's namespace is what /proc/PID/ns/net shows for
		// the whole process: there, a lab namespace makes the test look
		// like one of the lab's processes, and the lab's teardown (ip
		// netns pids, kill -9) kills it. A goroutine started while this
		// one holds the main thread runs on another.
		errc := make(chan error, 1)
		go func() { errc <- InNetns(name, f) }()
		err := <-errc
		runtime.UnlockOSThread()
		return err
	}
	orig, err := unix.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer unix.Close(orig)
	path := name
	if !strings.HasPrefix(name, "/") {
		path = "/var/run/netns/" + name
	}
	target, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer unix.Close(target)
	if err := unix.Setns(target, unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("setns %s: %w", name, err)
	}
	ferr := f()
	if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
		// The thread is stuck in the namespace: leave it locked so that
		// the runtime throws it away when this goroutine ends.
		return fmt.Errorf("setns back: %w", err)
	}
	runtime.UnlockOSThread()
	return ferr
}

// DialContextIn returns a dialer whose sockets live in the named network
// namespace, for clients of servers that run inside a test namespace.
func DialContextIn(name string) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		var c net.Conn
		err := InNetns(name, func() error {
			var err error
			c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
			return err
		})
		return c, err
	}
}
