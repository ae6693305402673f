package main

// The UDP floor (-udp): the least a user-space process can do to proxy UDP
// and still be a proxy. Each client address gets its own socket connected
// to the backend, so that the backend sees one peer per client and its
// replies can be told apart (every UDP proxy does this: the daemon, nginx's
// stream module, the classic proxier). Datagrams move in batches: one
// recvmmsg(2) drains up to udpBatch from a socket, and one sendmmsg(2)
// sends each run of them that goes out of one socket. Nothing else: no GSO,
// no balancer, no timeouts (a flow lives until the process exits, so it is
// for runs of minutes), no metrics, no logs. It answers one question: how
// close to a direct path can any user-space UDP proxy come on this machine?
//
// With -loops N each loop has its own SO_REUSEPORT listener, so the kernel
// keeps a client on one loop and a loop's flows are its own: no locks.

import (
	"fmt"
	"os"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// udpBatch is how many datagrams one recvmmsg takes at most.
const udpBatch = 32

// udpBuffer is each socket's receive and send buffer, the daemon's size
// (proxy/internal/sock): loss, if any, is then not for want of buffer.
const udpBuffer = 4 << 20

// udpRoute is a port to listen on and the backend its datagrams go to.
type udpRoute struct {
	port    int
	backend unix.SockaddrInet4
}

type udpFlags []udpRoute

func (u *udpFlags) String() string { return fmt.Sprint(len(*u), " UDP routes") }

// Set parses ":PORT=IP:PORT"; each loop opens its own listener on PORT.
func (u *udpFlags) Set(v string) error {
	port, backend, err := parseRoute(v)
	if err != nil {
		return err
	}
	*u = append(*u, udpRoute{port: port, backend: backend})
	return nil
}

// udpSocket opens a non-blocking UDP socket with the floor's buffers, bound
// to port (with SO_REUSEPORT) if port ≥ 0, else connected to peer.
func udpSocket(port int, peer *unix.SockaddrInet4) (int, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("socket: %w", err)
	}
	for _, o := range [][2]int{{unix.SO_RCVBUFFORCE, unix.SO_RCVBUF}, {unix.SO_SNDBUFFORCE, unix.SO_SNDBUF}} {
		if unix.SetsockoptInt(fd, unix.SOL_SOCKET, o[0], udpBuffer) != nil {
			_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, o[1], udpBuffer)
		}
	}
	if port >= 0 {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1); err != nil {
			unix.Close(fd)
			return -1, fmt.Errorf("SO_REUSEPORT: %w", err)
		}
		if err := unix.Bind(fd, &unix.SockaddrInet4{Port: port}); err != nil {
			unix.Close(fd)
			return -1, fmt.Errorf("bind udp :%d: %w", port, err)
		}
		return fd, nil
	}
	if err := unix.Connect(fd, peer); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("connect udp: %w", err)
	}
	return fd, nil
}

// udpKey is a client as one listener sees it.
type udpKey struct {
	ln   int
	addr [4]byte
	port uint16
}

// udpFlow is one client's socket to the backend.
type udpFlow struct {
	fd     int
	ln     int                   // the listener its replies leave from
	client unix.RawSockaddrInet4 // where they go
}

// udpLoop is one event loop: its own listeners and the flows they made, in
// one epoll set (level-triggered: each event drains its socket).
type udpLoop struct {
	ep       int
	file     *os.File // ep in Go's poller
	stopped  atomic.Bool
	backends map[int]*unix.SockaddrInet4 // listener → backend
	clients  map[udpKey]*udpFlow
	flows    map[int]*udpFlow // flow socket → flow
	events   [128]unix.EpollEvent

	in    [udpBatch]unix.Mmsghdr // what recvmmsg fills
	out   [udpBatch]unix.Mmsghdr // what sendmmsg sends: the same buffers
	iovs  [udpBatch]unix.Iovec
	names [udpBatch]unix.RawSockaddrInet4
	owner [udpBatch]*udpFlow // the flow of each received datagram
}

func newUDPLoop(routes []udpRoute) (*udpLoop, error) {
	ep, err := newEpoll()
	if err != nil {
		return nil, err
	}
	l := &udpLoop{ep: ep, file: os.NewFile(uintptr(ep), "epoll"), backends: map[int]*unix.SockaddrInet4{},
		clients: map[udpKey]*udpFlow{}, flows: map[int]*udpFlow{}}
	for _, r := range routes {
		fd, err := udpSocket(r.port, nil)
		if err == nil {
			err = l.watch(fd)
		}
		if err != nil {
			l.closeSockets()
			l.file.Close()
			return nil, err
		}
		l.backends[fd] = &r.backend
	}
	buf := make([]byte, udpBatch*65536) // any datagram fits whole
	for i := range l.in {
		l.iovs[i] = unix.Iovec{Base: &buf[i*65536]}
		l.iovs[i].SetLen(65536)
		l.in[i].Hdr.Iov = &l.iovs[i]
		l.in[i].Hdr.SetIovlen(1)
		l.out[i].Hdr.Iov = &l.iovs[i]
		l.out[i].Hdr.SetIovlen(1)
	}
	return l, nil
}

func (l *udpLoop) watch(fd int) error {
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}
	if err := unix.EpollCtl(l.ep, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		unix.Close(fd)
		return fmt.Errorf("epoll_ctl udp socket: %w", err)
	}
	return nil
}

// run serves until stop, then closes the loop's sockets: on this
// goroutine, so that none is closed (and its number reused) under a read.
func (l *udpLoop) run() error {
	err := waitEvents(l.file, l.events[:], &l.stopped, l.handle)
	l.closeSockets()
	return err
}

// stop ends run.
func (l *udpLoop) stop() error {
	l.stopped.Store(true)
	return l.file.Close()
}

func (l *udpLoop) closeSockets() {
	for fd := range l.backends {
		unix.Close(fd)
	}
	for fd := range l.flows {
		unix.Close(fd)
	}
}

func (l *udpLoop) handle(fd int) {
	if backend, ok := l.backends[fd]; ok {
		l.fromClients(fd, backend)
		return
	}
	if fl := l.flows[fd]; fl != nil {
		l.fromBackend(fl)
	}
}

// receive takes up to udpBatch datagrams from fd, with their senders if
// names; 0 when none is queued (or on an error: the next event retries).
func (l *udpLoop) receive(fd int, names bool) int {
	for i := range l.in {
		l.iovs[i].SetLen(65536)
		l.in[i].Hdr.Name, l.in[i].Hdr.Namelen = nil, 0
		if names {
			l.in[i].Hdr.Name = (*byte)(unsafe.Pointer(&l.names[i]))
			l.in[i].Hdr.Namelen = unix.SizeofSockaddrInet4
		}
	}
	n, _, errno := unix.RawSyscall6(unix.SYS_RECVMMSG, uintptr(fd), uintptr(unsafe.Pointer(&l.in[0])), udpBatch,
		unix.MSG_DONTWAIT, 0, 0)
	if errno != 0 {
		return 0
	}
	for i := range int(n) {
		l.iovs[i].SetLen(int(l.in[i].Len))
	}
	return int(n)
}

// send sends out[from:to] on fd; what the socket refuses is dropped, as a
// full queue would drop it.
func (l *udpLoop) send(fd, from, to int) {
	for from < to {
		n, _, errno := unix.RawSyscall6(unix.SYS_SENDMMSG, uintptr(fd), uintptr(unsafe.Pointer(&l.out[from])),
			uintptr(to-from), unix.MSG_DONTWAIT, 0, 0)
		if errno != 0 || n == 0 {
			from++ // skip the datagram it failed on (an ICMP error reported, a full buffer)
			continue
		}
		from += int(n)
	}
}

// fromClients moves every datagram queued on listener ln to its client's
// flow, making the flow on a client's first datagram; a run of one
// client's datagrams leaves in one sendmmsg.
func (l *udpLoop) fromClients(ln int, backend *unix.SockaddrInet4) {
	for {
		n := l.receive(ln, true)
		if n == 0 {
			return
		}
		for i := range n {
			l.owner[i] = l.flowFor(ln, &l.names[i], backend)
			l.out[i].Hdr.Name, l.out[i].Hdr.Namelen = nil, 0
		}
		for i := 0; i < n; {
			j := i + 1
			for j < n && l.owner[j] == l.owner[i] {
				j++
			}
			if fl := l.owner[i]; fl != nil {
				l.send(fl.fd, i, j)
			}
			i = j
		}
	}
}

// flowFor returns the client's flow, opening it if needed (nil: no socket;
// the datagram is dropped).
func (l *udpLoop) flowFor(ln int, client *unix.RawSockaddrInet4, backend *unix.SockaddrInet4) *udpFlow {
	k := udpKey{ln: ln, addr: client.Addr, port: client.Port}
	if fl := l.clients[k]; fl != nil {
		return fl
	}
	fd, err := udpSocket(-1, backend)
	if err == nil {
		err = l.watch(fd)
	}
	if err != nil {
		return nil
	}
	fl := &udpFlow{fd: fd, ln: ln, client: *client}
	l.clients[k] = fl
	l.flows[fd] = fl
	return fl
}

// fromBackend moves every datagram queued on fl's socket to its client,
// from the listener (conntrack turns the source back into the address the
// client sent to), a batch per sendmmsg.
func (l *udpLoop) fromBackend(fl *udpFlow) {
	for {
		n := l.receive(fl.fd, false)
		if n == 0 {
			return
		}
		for i := range n {
			l.out[i].Hdr.Name = (*byte)(unsafe.Pointer(&fl.client))
			l.out[i].Hdr.Namelen = unix.SizeofSockaddrInet4
		}
		l.send(fl.ln, 0, n)
	}
}
