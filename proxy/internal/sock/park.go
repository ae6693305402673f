package sock

// Parking: an idle proxied connection holds no goroutine. A Copy given an idle time returns ErrIdle once its source
// had nothing to read for that long; the caller parks the source here, on
// an epoll set of the Parker's own, and its goroutine returns. When the
// socket becomes readable (data, a FIN, a reset) or is aborted, the Parker
// calls the wake function given with it, once, and forgets the socket.
//
// The descriptor is in Go's poller too (edge-triggered); this second,
// level-triggered registration does not disturb it, and readiness that came
// before the registration is reported at once, so no wake-up is lost
// between the last read and Park. The registration is one-shot: a wake
// disarms it, the next Park arms it again (EPOLL_CTL_MOD), and closing the
// socket removes it, so a pause costs one epoll_ctl, not two.

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ErrIdle is Copy's answer when its source had nothing to read for the idle
// time it was given: nothing is in flight, and the caller may park the
// source (Parker.Park) or call Copy again.
var ErrIdle = errors.New("sock: no data for the idle time")

// ErrNotParked is Park's answer when the Parker is not running (or has
// stopped): the caller waits on the socket itself.
var ErrNotParked = errors.New("sock: the parker is not running")

// Parker holds idle sockets without a goroutine each. Its Run goroutine
// waits on them all, through Go's poller: a thread blocked in epoll_wait
// would get a P back from the scheduler on every wake-up, a delay on a
// parked connection's next request on a busy node. Safe for
// concurrent use.
type Parker struct {
	epfd, wakefd int // the epoll set; an eventfd in it that stops Run
	ep           *os.File
	raw          syscall.RawConn

	mu      sync.Mutex
	running bool
	parked  map[uint64]*parked
	next    uint64 // the key of the next parked socket (0: the eventfd)
	count   atomic.Int64
}

// parked is one socket waiting in the set.
type parked struct {
	p    *Parker
	key  uint64
	c    *Conn
	fd   int
	wake func()
}

// NewParker makes a Parker; Run starts it.
func NewParker() (*Parker, error) {
	ep, raw, epfd, err := newPolledEpoll("parker")
	if err != nil {
		return nil, err
	}
	wakefd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		ep.Close()
		return nil, os.NewSyscallError("eventfd", err)
	}
	ev := unix.EpollEvent{Events: unix.EPOLLIN}
	if err := unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, wakefd, &ev); err != nil {
		ep.Close()
		unix.Close(wakefd)
		return nil, os.NewSyscallError("epoll_ctl", err)
	}
	return &Parker{epfd: epfd, wakefd: wakefd, ep: ep, raw: raw, parked: map[uint64]*parked{}, next: 1}, nil
}

// Parked is how many sockets wait in the set now (0 for a nil Parker).
func (p *Parker) Parked() int64 {
	if p == nil {
		return 0
	}
	return p.count.Load()
}

// Park puts c's descriptor in the set: wake is called once, on a goroutine
// of the Parker's (it must not block: it hands the work on), when c becomes
// readable or hung up, or when c is aborted. ErrNotParked: the Parker is not
// running; wake will not be called.
func (p *Parker) Park(c *Conn, wake func()) error {
	if p == nil {
		return ErrNotParked
	}
	e := &parked{p: p, c: c, wake: wake}
	var cerr error
	if err := c.control(func(fd int) { e.fd = fd }); err != nil {
		return err // closed or aborted: the caller's Copy says so next
	}
	p.mu.Lock()
	if !p.running {
		p.mu.Unlock()
		return ErrNotParked
	}
	e.key = p.next
	p.next++
	p.parked[e.key] = e
	p.count.Add(1)
	c.parked.Store(e)
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP | unix.EPOLLONESHOT}
	*(*uint64)(epollData(&ev)) = e.key
	op := unix.EPOLL_CTL_ADD
	if c.inSet {
		op = unix.EPOLL_CTL_MOD
	}
	err := unix.EpollCtl(p.epfd, op, e.fd, &ev)
	if err == unix.ENOENT && op == unix.EPOLL_CTL_MOD {
		err = unix.EpollCtl(p.epfd, unix.EPOLL_CTL_ADD, e.fd, &ev)
	}
	if err == nil {
		c.inSet = true
	} else {
		delete(p.parked, e.key)
		p.count.Add(-1)
		c.parked.Store(nil)
		cerr = os.NewSyscallError("epoll_ctl", err)
	}
	p.mu.Unlock()
	if cerr != nil {
		return fmt.Errorf("parking a socket: %w", cerr)
	}
	// An Abort or a Detach between the Copy's return and the registration
	// found nothing parked: it is seen here instead.
	if c.done.Load() || c.detach.Load() {
		p.unpark(e)
	}
	return nil
}

// unpark takes e out of the set and calls its wake, unless someone else
// (readiness, an Abort, Stop) did so first.
func (p *Parker) unpark(e *parked) {
	if !e.c.parked.CompareAndSwap(e, nil) {
		return
	}
	p.mu.Lock()
	if p.parked[e.key] == e {
		delete(p.parked, e.key)
		p.count.Add(-1)
		// Left registered: a wake by readiness disarmed it, and one by
		// Abort or Stop fires at most once more, with a key no longer
		// parked. Closing the descriptor takes it out of the set.
	}
	p.mu.Unlock()
	e.wake()
}

// Run waits on the parked sockets until stop is closed. Then every socket
// still parked is woken (its copy finds it as it is), and Park refuses.
func (p *Parker) Run(stop <-chan struct{}) {
	p.mu.Lock()
	p.running = true
	p.mu.Unlock()
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.wait()
	}()
	<-stop
	var one = [8]byte{1}
	_, _ = unix.Write(p.wakefd, one[:])
	<-done
	p.mu.Lock()
	p.running = false
	left := make([]*parked, 0, len(p.parked))
	for _, e := range p.parked {
		left = append(left, e)
	}
	p.mu.Unlock()
	for _, e := range left {
		p.unpark(e)
	}
}

// wait is the epoll loop: it wakes the sockets that became ready, and
// returns when the eventfd is written. Go's poller watches the set's own
// descriptor (edge-triggered): it turns readable again whenever a parked
// socket became ready after the last epoll_wait, so a batch shorter than
// events leaves nothing behind (every ready socket is taken out).
func (p *Parker) wait() {
	events := make([]unix.EpollEvent, 128)
	var ready []*parked
	_ = p.raw.Read(func(fd uintptr) bool {
		for {
			n, err := unix.EpollWait(int(fd), events, 0)
			if err == unix.EINTR {
				continue
			}
			if err != nil {
				// Only a programming error gets here (EBADF, EFAULT):
				// stop parking; Run's stop still wakes whoever is parked.
				return true
			}
			ready = ready[:0]
			stopped := false
			p.mu.Lock()
			for _, ev := range events[:n] {
				key := *(*uint64)(epollData(&ev))
				if key == 0 {
					stopped = true
					continue
				}
				if e := p.parked[key]; e != nil {
					ready = append(ready, e)
				}
			}
			p.mu.Unlock()
			for i, e := range ready {
				p.unpark(e)
				ready[i] = nil
			}
			if stopped {
				return true
			}
			if n < len(events) {
				return false
			}
		}
	})
}

// Close releases the epoll set and the eventfd, after Run returned (or if
// it never ran).
func (p *Parker) Close() error {
	return errors.Join(p.ep.Close(), unix.Close(p.wakefd))
}

// epollData points at an epoll_event's data (the Fd and Pad fields of
// x/sys's layout, 8 bytes on every architecture).
func epollData(ev *unix.EpollEvent) unsafe.Pointer { return unsafe.Pointer(&ev.Fd) }
