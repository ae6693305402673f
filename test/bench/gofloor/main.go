// gofloor is the least a Go program can do to proxy TCP: a measuring stick
// for the daemon, not a proxy to use. It does per connection what HAProxy
// does in mode tcp and nothing more (accept4, socket, connect, two epoll
// registrations, splice both ways, shutdown, close): no goroutine per
// connection, no balancer, no metrics, no logs, no timeouts. Each of a few
// event loops owns an epoll set and the connections it accepted; a loop
// parks in Go's poller on its epoll descriptor, so that no thread blocks in
// a system call (a loop thread locked in epoll_wait measured worse: the
// runtime's monitor kept taking its P and handing it back).
//
// If the daemon's figure is close to gofloor's in the same run, what
// separates it from HAProxy is the Go runtime, not the daemon's design.
//
//	gofloor -listen :38080=10.251.19.12:8080 -listen :39000=10.251.19.12:9000
package main

import (
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// route is one listening socket and the backend its connections go to.
type route struct {
	fd      int
	backend unix.Sockaddr
}

type listenFlags []route

func (l *listenFlags) String() string { return fmt.Sprint(len(*l), " routes") }

// Set parses ":PORT=IP:PORT" and opens the listener.
func (l *listenFlags) Set(v string) error {
	port, backend, err := parseRoute(v)
	if err != nil {
		return err
	}
	fd, err := listen(port)
	if err != nil {
		return err
	}
	*l = append(*l, route{fd: fd, backend: &backend})
	return nil
}

// parseRoute parses ":PORT=IP:PORT", a -listen or -udp value.
func parseRoute(v string) (port int, backend unix.SockaddrInet4, err error) {
	from, to, ok := strings.Cut(v, "=")
	if !ok {
		return 0, backend, fmt.Errorf("want :PORT=BACKEND_IP:PORT, got %q", v)
	}
	ln, err := netip.ParseAddrPort("0.0.0.0" + from)
	if err != nil {
		return 0, backend, fmt.Errorf("listen address %q: %w", from, err)
	}
	be, err := netip.ParseAddrPort(to)
	if err != nil || !be.Addr().Is4() {
		return 0, backend, fmt.Errorf("backend %q: want an IPv4 address and port", to)
	}
	return int(ln.Port()), unix.SockaddrInet4{Addr: be.Addr().As4(), Port: int(be.Port())}, nil
}

func listen(port int) (int, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("socket: %w", err)
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("SO_REUSEADDR: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrInet4{Port: port}); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("bind :%d: %w", port, err)
	}
	if err := unix.Listen(fd, 4096); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("listen :%d: %w", port, err)
	}
	return fd, nil
}

func main() {
	var routes listenFlags
	var udp udpFlags
	flag.Var(&routes, "listen", "`:PORT=IP:PORT` to proxy TCP (repeatable)")
	flag.Var(&udp, "udp", "`:PORT=IP:PORT` to proxy UDP (repeatable; udp.go)")
	loops := flag.Int("loops", runtime.GOMAXPROCS(0), "event loops (of each protocol)")
	engine := flag.String("engine", "epoll", "`epoll` (Go's poller and splice) or ring (io_uring, ring.go); TCP only")
	flag.Parse()
	if len(routes)+len(udp) == 0 || *loops < 1 || (*engine != "epoll" && *engine != "ring") {
		fmt.Fprintln(os.Stderr, "usage: gofloor [-listen :PORT=IP:PORT ...] [-udp :PORT=IP:PORT ...] [-loops N] [-engine epoll|ring]")
		os.Exit(2)
	}
	errs := make(chan error, 2**loops)
	start := func(l eventLoop, err error) {
		if err != nil {
			fmt.Fprintln(os.Stderr, "gofloor:", err)
			os.Exit(1)
		}
		go func() { errs <- l.run() }()
	}
	for range *loops {
		switch {
		case len(routes) == 0:
		case *engine == "ring":
			start(newRingLoop(routes))
		default:
			start(newLoop(routes))
		}
		if len(udp) > 0 {
			start(newUDPLoop(udp))
		}
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	select {
	case <-stop:
	case err := <-errs:
		fmt.Fprintln(os.Stderr, "gofloor:", err)
		os.Exit(1)
	}
}

// eventLoop is one loop of either engine; run serves until stop.
type eventLoop interface {
	run() error
	stop() error
}

// loop is one event loop: an epoll set with every listener (EPOLLEXCLUSIVE,
// so that one loop wakes per new connection) and the connections this loop
// accepted, edge-triggered.
type loop struct {
	ep      int
	file    *os.File // ep in Go's poller
	stopped atomic.Bool
	routes  map[int]unix.Sockaddr // listener → backend
	conns   map[int]*conn         // either socket → its connection
	pipes   []pipe                // empty pipes for reuse
	events  [128]unix.EpollEvent
}

func newLoop(routes []route) (*loop, error) {
	ep, err := newEpoll()
	if err != nil {
		return nil, err
	}
	l := &loop{ep: ep, file: os.NewFile(uintptr(ep), "epoll"), routes: map[int]unix.Sockaddr{}, conns: map[int]*conn{}}
	for _, r := range routes {
		ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLEXCLUSIVE, Fd: int32(r.fd)}
		if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, r.fd, &ev); err != nil {
			l.file.Close()
			return nil, fmt.Errorf("epoll_ctl listener: %w", err)
		}
		l.routes[r.fd] = r.backend
	}
	return l, nil
}

// newEpoll makes an epoll set that Go's poller can wait on (non-blocking,
// so that os.NewFile hands it to the poller).
func newEpoll() (int, error) {
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("epoll_create1: %w", err)
	}
	if err := unix.SetNonblock(ep, true); err != nil {
		unix.Close(ep)
		return -1, fmt.Errorf("epoll descriptor: %w", err)
	}
	return ep, nil
}

// run waits for events and handles them until stop.
func (l *loop) run() error { return waitEvents(l.file, l.events[:], &l.stopped, l.handle) }

// waitEvents waits for events of the epoll set ep on Go's poller and hands
// each ready descriptor to handle, until ep is closed (stopped set first).
func waitEvents(ep *os.File, events []unix.EpollEvent, stopped *atomic.Bool, handle func(fd int)) error {
	rc, err := ep.SyscallConn()
	if err != nil {
		return fmt.Errorf("epoll descriptor: %w", err)
	}
	for {
		err := rc.Read(func(fd uintptr) bool {
			for {
				n, _, errno := unix.RawSyscall6(unix.SYS_EPOLL_PWAIT, fd, uintptr(unsafe.Pointer(&events[0])),
					uintptr(len(events)), 0, 0, 0)
				if errno != 0 || n == 0 {
					return false // nothing ready: park until the epoll set is readable
				}
				for _, ev := range events[:n] {
					handle(int(ev.Fd))
				}
			}
		})
		if stopped.Load() {
			return nil
		}
		if err != nil {
			return fmt.Errorf("waiting for events: %w", err)
		}
	}
}

// stop ends run; the connections' sockets stay as they are (the process exits).
func (l *loop) stop() error {
	l.stopped.Store(true)
	return l.file.Close()
}

func (l *loop) handle(fd int) {
	if backend, ok := l.routes[fd]; ok {
		l.accept(fd, backend)
		return
	}
	if c := l.conns[fd]; c != nil {
		l.pump(c)
	}
}

// accept takes every pending connection of the listener ln and connects each
// to backend (non-blocking: the first pump finds out when it is connected).
func (l *loop) accept(ln int, backend unix.Sockaddr) {
	for {
		client, _, err := unix.Accept4(ln, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
		if err != nil {
			return // EAGAIN, or out of descriptors: the next event retries
		}
		server, err := dial(backend)
		if err != nil {
			unix.Close(client)
			continue
		}
		c := &conn{fd: [2]int{client, server}}
		for _, fd := range c.fd {
			l.conns[fd] = c
			ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd)}
			_ = unix.EpollCtl(l.ep, unix.EPOLL_CTL_ADD, fd, &ev)
		}
		l.pump(c)
	}
}

func dial(backend unix.Sockaddr) (int, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	_ = unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1) // as HAProxy does
	if err := unix.Connect(fd, backend); err != nil && !errors.Is(err, unix.EINPROGRESS) {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// conn is one proxied connection: direction 0 copies fd[0] (client) to
// fd[1] (backend), direction 1 the other way.
type conn struct {
	fd   [2]int
	pipe [2]pipe // data read from direction d's source, not yet written
	eof  [2]bool // direction d's source is at EOF
	shut [2]bool // direction d's FIN was passed on
}

// pipe is a pipe pair; n bytes are inside it. The zero pipe is none.
type pipe struct {
	r, w, n int
	held    bool
}

// pump moves both directions as far as they go; at the end of both, or on
// an error, it closes the connection.
func (l *loop) pump(c *conn) {
	ok := l.move(c, 0) && l.move(c, 1)
	if ok && (!c.shut[0] || !c.shut[1]) {
		return
	}
	for d, fd := range c.fd {
		if !ok {
			// An error (a reset, a refused dial): pass it on as a reset.
			_ = unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1})
		}
		delete(l.conns, fd)
		unix.Close(fd) // also leaves the epoll set
		if p := c.pipe[d]; p.held {
			unix.Close(p.r) // it may hold data no one will read
			unix.Close(p.w)
		}
	}
}

// move copies direction d until its source or destination would block,
// passing a FIN on once the source's data is all written. false: an error.
func (l *loop) move(c *conn, d int) bool {
	src, dst := c.fd[d], c.fd[1-d]
	p := &c.pipe[d]
	for {
		if p.n > 0 {
			m, errno := splice(p.r, dst, p.n)
			if errno == unix.EAGAIN {
				return true // the destination's EPOLLOUT resumes this
			}
			if errno != 0 {
				return false
			}
			p.n -= m
			continue
		}
		if c.eof[d] {
			if !c.shut[d] {
				c.shut[d] = true
				_, _, _ = unix.RawSyscall(unix.SYS_SHUTDOWN, uintptr(dst), unix.SHUT_WR, 0)
			}
			l.release(p)
			return true
		}
		if !p.held {
			var err error
			if *p, err = l.pipe(); err != nil {
				return false
			}
		}
		m, errno := splice(src, p.w, 1<<20)
		switch {
		case errno == unix.EAGAIN:
			l.release(p) // drained: hold no pipe while waiting
			return true
		case errno != 0:
			return false
		case m == 0:
			c.eof[d] = true
		}
		p.n += m
	}
}

func (l *loop) pipe() (pipe, error) {
	if n := len(l.pipes); n > 0 {
		p := l.pipes[n-1]
		l.pipes = l.pipes[:n-1]
		return p, nil
	}
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_NONBLOCK|unix.O_CLOEXEC); err != nil {
		return pipe{}, err
	}
	_, _ = unix.FcntlInt(uintptr(fds[1]), unix.F_SETPIPE_SZ, 1<<20)
	return pipe{r: fds[0], w: fds[1], held: true}, nil
}

// release keeps an empty pipe for the next burst of any connection.
func (l *loop) release(p *pipe) {
	if !p.held {
		return
	}
	if len(l.pipes) < 32 {
		l.pipes = append(l.pipes, *p)
	} else {
		unix.Close(p.r)
		unix.Close(p.w)
	}
	*p = pipe{}
}

func splice(in, out, n int) (int, syscall.Errno) {
	m, _, errno := unix.RawSyscall6(unix.SYS_SPLICE, uintptr(in), 0, uintptr(out), 0, uintptr(n),
		unix.SPLICE_F_MOVE|unix.SPLICE_F_NONBLOCK)
	return int(m), errno
}
