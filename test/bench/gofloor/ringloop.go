package main

// The loop of the io_uring engine (ring.go): one per P, on its locked
// thread, driving every connection of its share through the ring.

import (
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// What a completion is for: user data is the slot (a connection or a
// listener), the operation, the direction and, for a send, its buffer.
const (
	kindAccept = iota + 1
	kindConnect
	kindRecv
	kindSend
	kindShutdown
	kindWake
)

func userData(slot uint32, kind, dir int, bid uint16) uint64 {
	return uint64(slot) | uint64(kind)<<32 | uint64(dir)<<40 | uint64(bid)<<48
}

// chunk is received data not yet sent: part of a buffer.
type chunk struct {
	bid      uint16
	off, len uint32
}

// rconn is one proxied connection; direction d moves fd[d]'s bytes to fd[1-d].
type rconn struct {
	slot      uint32
	fd        [2]int
	queue     [2][]chunk
	sending   [2]bool
	receiving [2]bool // a multishot receive is armed
	eof, shut [2]bool
	ops       int // operations in flight
	dead      bool
}

// starvedDir is a direction of cn whose receive waits for buffers.
type starvedDir struct {
	cn  *rconn
	dir int
}

// ringLoop is one event loop of the ring engine.
type ringLoop struct {
	routes  []route
	raw     []unix.RawSockaddrInet4 // each route's backend, for connect
	wake    int                     // an eventfd: stop writes it
	stopped atomic.Bool
	r       *ring
	bufs    *buffers
	conns   []*rconn
	free    []uint32
	// starved are directions whose receive ended for want of buffers
	// while nothing of theirs was queued: armed again after a batch
	// that gave buffers back.
	starved []starvedDir
}

func newRingLoop(routes []route) (*ringLoop, error) {
	wake, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	l := &ringLoop{routes: routes, wake: wake}
	for _, rt := range routes {
		sa := rt.backend.(*unix.SockaddrInet4)
		raw := unix.RawSockaddrInet4{Family: unix.AF_INET, Addr: sa.Addr}
		raw.Port = uint16(sa.Port>>8) | uint16(sa.Port&0xff)<<8 // network order
		l.raw = append(l.raw, raw)
	}
	return l, nil
}

func (l *ringLoop) stop() error {
	l.stopped.Store(true)
	var one = [8]byte{1}
	_, err := unix.Write(l.wake, one[:])
	return err
}

// run makes the ring on this goroutine's locked thread (its only
// submitter) and serves until stop.
func (l *ringLoop) run() error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	defer unix.Close(l.wake)
	r, err := newRing()
	if err != nil {
		return err
	}
	defer r.close()
	l.r = r
	if l.bufs, err = newBuffers(r); err != nil {
		return err
	}
	if len(l.routes) >= listenerIndexLimit {
		return errors.New("too many listeners")
	}
	for i := range l.routes {
		l.accept(i)
	}
	l.armWake()
	for !l.stopped.Load() {
		if err := r.enter(1); err != nil {
			return err
		}
		head := *r.cqHead
		for tail := atomic.LoadUint32(r.cqTail); head != tail; head++ {
			c := r.cqes[head&r.cqMask]
			l.complete(c)
		}
		atomic.StoreUint32(r.cqHead, head)
		if l.bufs.returned && len(l.starved) > 0 {
			for _, st := range l.starved {
				if l.conns[st.cn.slot] == st.cn {
					l.advance(st.cn, st.dir)
				}
			}
			l.starved = l.starved[:0]
		}
		l.bufs.publish()
	}
	return nil
}

func (l *ringLoop) armWake() {
	s := l.r.get()
	s.opcode, s.fd, s.opFlags = opPollAdd, int32(l.wake), unix.POLLIN
	s.userData = userData(wakeIndex, kindWake, 0, 0)
}

func (l *ringLoop) accept(i int) {
	s := l.r.get()
	s.opcode, s.fd, s.ioprio, s.opFlags = opAccept, int32(l.routes[i].fd), acceptMultishot, unix.SOCK_CLOEXEC
	s.userData = userData(uint32(i), kindAccept, 0, 0)
}

func (l *ringLoop) complete(c cqe) {
	slot, kind, dir, bid := uint32(c.userData), int(c.userData>>32&0xff), int(c.userData>>40&1), uint16(c.userData>>48)
	switch kind {
	case kindWake:
		return // stop was called; run sees it
	case kindAccept:
		if c.flags&cqeFMore == 0 {
			l.accept(int(slot)) // the multishot ended (an error): again
		}
		if c.res >= 0 {
			l.connect(int(c.res), int(slot))
		}
		return
	}
	if kind == 0 {
		return // a close or a cancel that failed: nothing to do
	}
	cn := l.conns[slot]
	switch kind {
	case kindConnect:
		cn.ops--
		if c.res < 0 {
			l.abort(cn)
			break
		}
		l.advance(cn, 0)
		l.advance(cn, 1)
	case kindRecv:
		if c.flags&cqeFMore == 0 {
			cn.receiving[dir] = false
			cn.ops--
		}
		switch {
		case c.flags&cqeFBuffer != 0 && c.res > 0:
			b := uint16(c.flags >> cqeBufferShift)
			if cn.dead {
				l.bufs.put(b)
				break
			}
			cn.queue[dir] = append(cn.queue[dir], chunk{bid: b, len: uint32(c.res)})
			l.advance(cn, dir)
		case c.res == 0:
			cn.eof[dir] = true
			l.advance(cn, dir)
		case c.res == -int32(unix.ENOBUFS):
			// Out of buffers: armed again once this direction's queue
			// drains, or after buffers come back.
			if len(cn.queue[dir]) == 0 {
				l.starved = append(l.starved, starvedDir{cn, dir})
			}
		case c.res < 0:
			l.abort(cn)
		}
	case kindSend:
		cn.ops--
		cn.sending[dir] = false
		q := &cn.queue[dir]
		if cn.dead {
			l.bufs.put(bid) // the chunk abort left to this send
			break
		}
		if c.res < 0 {
			l.abort(cn)
			break
		}
		ch := &(*q)[0]
		if ch.bid != bid {
			panic("send completion out of order")
		}
		ch.off += uint32(c.res)
		ch.len -= uint32(c.res)
		if ch.len == 0 {
			l.bufs.put(ch.bid)
			*q = (*q)[1:]
		}
		l.advance(cn, dir)
	case kindShutdown:
		cn.ops--
	}
	if cn.ops == 0 && (cn.dead || cn.shut[0] && cn.shut[1]) {
		l.finish(slot, cn)
	}
}

// connect opens the backend socket (two plain system calls: the ring's
// socket operation would cost a round of completions) and connects it
// through the ring.
func (l *ringLoop) connect(client, route int) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		unix.Close(client)
		return
	}
	_ = unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1) // as HAProxy does
	cn := &rconn{fd: [2]int{client, fd}, ops: 1}
	if n := len(l.free); n > 0 {
		cn.slot = l.free[n-1]
		l.free = l.free[:n-1]
		l.conns[cn.slot] = cn
	} else {
		cn.slot = uint32(len(l.conns))
		l.conns = append(l.conns, cn)
	}
	slot := cn.slot
	s := l.r.get()
	s.opcode, s.fd = opConnect, int32(fd)
	s.addr, s.off = uint64(uintptr(unsafe.Pointer(&l.raw[route]))), uint64(unsafe.Sizeof(l.raw[route]))
	s.userData = userData(slot, kindConnect, 0, 0)
}

// advance moves direction d on: send the next chunk, or pass the FIN on
// once everything was sent, or receive again.
func (l *ringLoop) advance(cn *rconn, d int) {
	if cn.dead || cn.sending[d] {
		return
	}
	slot := cn.slot
	if q := cn.queue[d]; len(q) > 0 {
		ch := q[0]
		s := l.r.get()
		s.opcode, s.fd = opSend, int32(cn.fd[1-d])
		s.addr, s.len, s.opFlags = l.bufs.addr(ch.bid)+uint64(ch.off), ch.len, unix.MSG_NOSIGNAL
		s.userData = userData(slot, kindSend, d, ch.bid)
		cn.sending[d] = true
		cn.ops++
		return
	}
	if cn.eof[d] {
		if !cn.shut[d] {
			cn.shut[d] = true
			s := l.r.get()
			s.opcode, s.fd, s.len = opShutdown, int32(cn.fd[1-d]), unix.SHUT_WR
			s.userData = userData(slot, kindShutdown, d, 0)
			cn.ops++
		}
		return
	}
	if !cn.receiving[d] {
		s := l.r.get()
		s.opcode, s.fd, s.ioprio, s.flags, s.bufIndex = opRecv, int32(cn.fd[d]), recvMultishot, sqeBufferSelect, bufGroup
		s.userData = userData(slot, kindRecv, d, 0)
		cn.receiving[d] = true
		cn.ops++
	}
}

// abort ends a connection on an error: a reset to both peers. Everything
// in flight on its sockets is cancelled; finish closes once nothing is.
func (l *ringLoop) abort(cn *rconn) {
	if cn.dead {
		return
	}
	cn.dead = true
	for d, fd := range cn.fd {
		_ = unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1})
		s := l.r.get()
		s.opcode, s.fd, s.opFlags, s.flags = opCancel, int32(fd), cancelFD|cancelAll, sqeCQESkipSuccess
		s.userData = userData(cn.slot, 0, 0, 0)
		q := cn.queue[d]
		if cn.sending[d] && len(q) > 0 {
			q = q[1:] // its buffer goes back when the send completes
		}
		for _, ch := range q {
			l.bufs.put(ch.bid)
		}
		cn.queue[d] = nil
	}
}

// finish closes both sockets through the ring (no completion on success)
// and frees the slot.
func (l *ringLoop) finish(slot uint32, cn *rconn) {
	for _, fd := range cn.fd {
		s := l.r.get()
		s.opcode, s.fd, s.flags = opClose, int32(fd), sqeCQESkipSuccess
		s.userData = userData(slot, 0, 0, 0)
	}
	l.conns[slot] = nil
	l.free = append(l.free, slot)
}
