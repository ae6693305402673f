package sock

import (
	"fmt"
	"os"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// Acceptor accepts the connections of many listeners on one goroutine.
//
// A listener parked in an accept goroutine of its own costs a goroutine's
// stack and Go's poller state: with many Services, most of the daemon's
// memory. Here the listeners sit in an epoll set of their own
// (edge-triggered), and the acceptor waits for that set's descriptor through
// Go's poller, so no thread blocks in epoll_wait either. A wake-up costs one
// epoll_wait more than a listener's own goroutine did, then the same
// accept4 calls until the queue is empty.
type Acceptor struct {
	ep  *os.File // the epoll set, itself waited on by Go's poller
	raw syscall.RawConn

	mu        sync.Mutex
	listeners map[uint32]*Listener // by the id in the epoll event
	nextID    uint32

	done chan struct{} // closed when the goroutine has returned
}

// NewAcceptor creates the epoll set and starts the acceptor's goroutine;
// Close stops it.
func NewAcceptor() (*Acceptor, error) {
	ep, raw, _, err := newPolledEpoll("acceptor")
	if err != nil {
		return nil, err
	}
	a := &Acceptor{ep: ep, raw: raw, listeners: make(map[uint32]*Listener), done: make(chan struct{})}
	go a.run()
	return a, nil
}

// newPolledEpoll creates an epoll set whose own descriptor Go's poller
// watches (non-blocking, so that os.NewFile hands it to the poller): one
// goroutine waits on many sockets without blocking a thread in epoll_wait.
// The file owns the descriptor, also returned as a number for epoll_ctl.
func newPolledEpoll(name string) (*os.File, syscall.RawConn, int, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, nil, -1, os.NewSyscallError("epoll_create1", err)
	}
	if err := unix.SetNonblock(epfd, true); err != nil {
		unix.Close(epfd)
		return nil, nil, -1, os.NewSyscallError("fcntl", err)
	}
	ep := os.NewFile(uintptr(epfd), name)
	raw, err := ep.SyscallConn()
	if err != nil {
		ep.Close()
		return nil, nil, -1, fmt.Errorf("%s's epoll descriptor: %w", name, err)
	}
	return ep, raw, epfd, nil
}

// Close stops the acceptor and waits for its goroutine. Listeners still
// served accept nothing more; their owners close them.
func (a *Acceptor) Close() error {
	err := a.ep.Close()
	<-a.done
	return err
}

// Listeners is how many listeners the acceptor serves.
func (a *Acceptor) Listeners() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.listeners)
}

// run waits for ready listeners and accepts on each until its queue is
// empty, until the acceptor is closed.
func (a *Acceptor) run() {
	defer close(a.done)
	events := make([]unix.EpollEvent, 128)
	ready := make([]*Listener, 0, len(events))
	// Read waits for the epoll set to be readable, then calls the function
	// until it returns true; false means "wait again". The set is readable
	// again after any listener became ready since its last epoll_wait, so
	// a batch shorter than events empties it.
	_ = a.raw.Read(func(fd uintptr) bool {
		for {
			n, err := unix.EpollWait(int(fd), events, 0)
			if err != nil {
				if err == unix.EINTR {
					continue
				}
				return false
			}
			ready = ready[:0]
			a.mu.Lock()
			for _, ev := range events[:n] {
				if l := a.listeners[uint32(ev.Fd)]; l != nil {
					ready = append(ready, l)
				}
			}
			a.mu.Unlock()
			for i, l := range ready {
				l.accept()
				ready[i] = nil
			}
			if n < len(events) {
				return false
			}
		}
	})
}

// add puts l in the epoll set and returns its id. A connection queued
// before is reported at once (epoll checks readiness when a descriptor is
// added).
func (a *Acceptor) add(l *Listener) (uint32, error) {
	a.mu.Lock()
	id := a.nextID
	for a.listeners[id] != nil || id == 0 {
		id++
	}
	a.nextID = id + 1
	a.listeners[id] = l
	a.mu.Unlock()
	var cerr error
	// Control keeps the epoll descriptor from being closed (and its number
	// reused) meanwhile.
	err := a.raw.Control(func(epfd uintptr) {
		ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLET, Fd: int32(id)}
		cerr = unix.EpollCtl(int(epfd), unix.EPOLL_CTL_ADD, l.fd, &ev)
	})
	if err == nil && cerr != nil {
		err = os.NewSyscallError("epoll_ctl", cerr)
	}
	if err != nil {
		a.mu.Lock()
		delete(a.listeners, id)
		a.mu.Unlock()
		return 0, fmt.Errorf("adding listener to the acceptor: %w", err)
	}
	return id, nil
}

// remove takes l out of the epoll set before its descriptor is closed.
func (a *Acceptor) remove(l *Listener) {
	_ = a.raw.Control(func(epfd uintptr) {
		_ = unix.EpollCtl(int(epfd), unix.EPOLL_CTL_DEL, l.fd, nil)
	})
	a.mu.Lock()
	delete(a.listeners, l.id)
	a.mu.Unlock()
}
