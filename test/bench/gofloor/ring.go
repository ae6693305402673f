// The io_uring engine of gofloor (-engine ring): the same measuring stick as
// the epoll loops, but every socket operation but socket(2) and one
// setsockopt goes through a ring, and one io_uring_enter both submits a
// batch and waits for the next. The question it answers (issue 21): does
// entering the kernel fewer times lift a Go proxy past HAProxy on new
// connections/s and small writes?
//
// Per loop (one per P): a ring created on the loop's locked thread
// (SINGLE_ISSUER and DEFER_TASKRUN: completions are run when the loop asks
// for them, not by interrupting it), a multishot accept on every listener, a
// ring of provided buffers that multishot receives fill, and one send in
// flight per direction. No splice: a socket splice in a ring goes to a
// kernel worker thread.
//
// No io_uring library is served to this project; the little of the ABI that
// is used is written out here, from include/uapi/linux/io_uring.h.
package main

import (
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The ABI (include/uapi/linux/io_uring.h, Linux 6.x).
const (
	opPollAdd  = 6
	opAccept   = 13
	opCancel   = 14
	opConnect  = 16
	opClose    = 19
	opSend     = 26
	opRecv     = 27
	opShutdown = 34

	sqeBufferSelect    = 1 << 5
	sqeCQESkipSuccess  = 1 << 6
	cancelAll          = 1 << 0
	cancelFD           = 1 << 1
	acceptMultishot    = 1 << 0
	recvMultishot      = 1 << 1
	cqeFBuffer         = 1 << 0
	cqeFMore           = 1 << 1
	cqeBufferShift     = 16
	setupCQSize        = 1 << 3
	setupSubmitAll     = 1 << 7
	setupCoopTaskrun   = 1 << 8
	setupSingleIssuer  = 1 << 12
	setupDeferTaskrun  = 1 << 13
	featSingleMmap     = 1 << 0
	enterGetEvents     = 1 << 0
	offSQRing          = 0
	offCQRing          = 0x8000000
	offSQEs            = 0x10000000
	registerPbufRing   = 22
	ringEntries        = 1024
	bufSize            = 16 << 10
	bufGroup           = 0
	wakeIndex          = 1<<32 - 1
	listenerIndexLimit = 1 << 20
)

type sqOffsets struct {
	head, tail, ringMask, ringEntries, flags, dropped, array, resv1 uint32
	userAddr                                                        uint64
}

type cqOffsets struct {
	head, tail, ringMask, ringEntries, overflow, cqes, flags, resv1 uint32
	userAddr                                                        uint64
}

type ringParams struct {
	sqEntries, cqEntries, flags, sqThreadCPU, sqThreadIdle, features, wqFD uint32
	resv                                                                   [3]uint32
	sqOff                                                                  sqOffsets
	cqOff                                                                  cqOffsets
}

type sqe struct {
	opcode      uint8
	flags       uint8
	ioprio      uint16
	fd          int32
	off         uint64
	addr        uint64
	len         uint32
	opFlags     uint32
	userData    uint64
	bufIndex    uint16
	personality uint16
	spliceFDIn  int32
	addr3       uint64
	pad         uint64
}

type cqe struct {
	userData uint64
	res      int32
	flags    uint32
}

type bufReg struct {
	ringAddr    uint64
	ringEntries uint32
	bgid        uint16
	flags       uint16
	resv        [3]uint64
}

type ringBuf struct {
	addr uint64
	len  uint32
	bid  uint16
	resv uint16 // of entry 0: the ring's tail
}

func init() {
	// The ABI's sizes, checked once: a wrong one corrupts the ring.
	if unsafe.Sizeof(sqe{}) != 64 || unsafe.Sizeof(cqe{}) != 16 || unsafe.Sizeof(ringParams{}) != 120 ||
		unsafe.Sizeof(bufReg{}) != 40 || unsafe.Sizeof(ringBuf{}) != 16 {
		panic("io_uring ABI structures have the wrong size")
	}
}

// ring is one io_uring instance: its submission and completion queues.
type ring struct {
	fd               int
	sqHead, sqTail   *uint32
	sqMask           uint32
	sqArray          []uint32
	sqes             []sqe
	tail, submitted  uint32 // the local SQ tail and how much of it the kernel took
	cqHead, cqTail   *uint32
	cqMask           uint32
	cqes             []cqe
	sqMem, cqMem, sq []byte
}

func newRing() (*ring, error) {
	p := ringParams{flags: setupCQSize | setupSubmitAll | setupCoopTaskrun | setupSingleIssuer | setupDeferTaskrun,
		cqEntries: 8 * ringEntries}
	fd, _, errno := unix.Syscall(unix.SYS_IO_URING_SETUP, ringEntries, uintptr(unsafe.Pointer(&p)), 0)
	if errno != 0 {
		return nil, fmt.Errorf("io_uring_setup: %w", errno)
	}
	r := &ring{fd: int(fd)}
	if p.features&featSingleMmap == 0 {
		r.close()
		return nil, errors.New("io_uring: the kernel lacks IORING_FEAT_SINGLE_MMAP")
	}
	sqSize := int(p.sqOff.array + p.sqEntries*4)
	if cqSize := int(p.cqOff.cqes + p.cqEntries*16); cqSize > sqSize {
		sqSize = cqSize
	}
	var err error
	if r.sqMem, err = unix.Mmap(r.fd, offSQRing, sqSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		r.close()
		return nil, fmt.Errorf("mmap SQ ring: %w", err)
	}
	r.cqMem = r.sqMem // IORING_FEAT_SINGLE_MMAP
	if r.sq, err = unix.Mmap(r.fd, offSQEs, int(p.sqEntries)*64, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		r.close()
		return nil, fmt.Errorf("mmap SQEs: %w", err)
	}
	at := func(mem []byte, off uint32) *uint32 { return (*uint32)(unsafe.Pointer(&mem[off])) }
	r.sqHead, r.sqTail, r.sqMask = at(r.sqMem, p.sqOff.head), at(r.sqMem, p.sqOff.tail), *at(r.sqMem, p.sqOff.ringMask)
	r.sqArray = unsafe.Slice(at(r.sqMem, p.sqOff.array), p.sqEntries)
	r.sqes = unsafe.Slice((*sqe)(unsafe.Pointer(&r.sq[0])), p.sqEntries)
	r.cqHead, r.cqTail, r.cqMask = at(r.cqMem, p.cqOff.head), at(r.cqMem, p.cqOff.tail), *at(r.cqMem, p.cqOff.ringMask)
	r.cqes = unsafe.Slice((*cqe)(unsafe.Pointer(&r.cqMem[p.cqOff.cqes])), p.cqEntries)
	r.tail = atomic.LoadUint32(r.sqTail)
	r.submitted = r.tail
	return r, nil
}

func (r *ring) close() {
	if r.sq != nil {
		_ = unix.Munmap(r.sq)
	}
	if r.sqMem != nil {
		_ = unix.Munmap(r.sqMem)
	}
	unix.Close(r.fd)
}

// get returns a zeroed SQE to fill; a full queue is submitted first.
func (r *ring) get() *sqe {
	for r.tail-atomic.LoadUint32(r.sqHead) >= uint32(len(r.sqes)) {
		_ = r.enter(0)
	}
	i := r.tail & r.sqMask
	r.sqArray[i] = i
	s := &r.sqes[i]
	*s = sqe{}
	r.tail++
	return s
}

// enter submits what get handed out and, with wait, blocks until at least
// one completion is there: one system call for both.
func (r *ring) enter(wait uint32) error {
	atomic.StoreUint32(r.sqTail, r.tail)
	for {
		flags := uintptr(0)
		if wait > 0 {
			flags = enterGetEvents
		}
		n, _, errno := syscall.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(r.tail-r.submitted), uintptr(wait), flags, 0, 0)
		if errno == unix.EINTR {
			continue // a signal (the runtime's preemption): again
		}
		if errno != 0 && errno != unix.EBUSY && errno != unix.EAGAIN {
			return fmt.Errorf("io_uring_enter: %w", errno)
		}
		r.submitted += uint32(n)
		return nil
	}
}

// buffers is a provided-buffer ring: receives take a buffer from it, and a
// buffer goes back once its bytes were sent.
type buffers struct {
	count   int    // a power of two
	mem     []byte // count × bufSize
	ringMem []byte
	entries []ringBuf
	tail    uint16
	// returned: a buffer was put back since the last publish.
	returned bool
}

// ringBuffers is how many buffers a loop provides (a power of two); a test
// makes it small to run out.
var ringBuffers = 2048

func newBuffers(r *ring) (*buffers, error) {
	b := &buffers{count: ringBuffers}
	var err error
	if b.ringMem, err = unix.Mmap(-1, 0, b.count*16, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
		return nil, fmt.Errorf("mmap buffer ring: %w", err)
	}
	if b.mem, err = unix.Mmap(-1, 0, b.count*bufSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
		return nil, fmt.Errorf("mmap buffers: %w", err)
	}
	b.entries = unsafe.Slice((*ringBuf)(unsafe.Pointer(&b.ringMem[0])), b.count)
	reg := bufReg{ringAddr: uint64(uintptr(unsafe.Pointer(&b.ringMem[0]))), ringEntries: uint32(b.count), bgid: bufGroup}
	if _, _, errno := unix.Syscall6(unix.SYS_IO_URING_REGISTER, uintptr(r.fd), registerPbufRing, uintptr(unsafe.Pointer(&reg)), 1, 0, 0); errno != 0 {
		return nil, fmt.Errorf("registering the buffer ring: %w", errno)
	}
	for bid := range b.count {
		b.put(uint16(bid))
	}
	b.publish()
	return b, nil
}

func (b *buffers) addr(bid uint16) uint64 {
	return uint64(uintptr(unsafe.Pointer(&b.mem[int(bid)*bufSize])))
}

// put hands buffer bid back (seen by the kernel at the next publish).
func (b *buffers) put(bid uint16) {
	b.returned = true
	e := &b.entries[int(b.tail)&(b.count-1)]
	e.addr, e.len, e.bid = b.addr(bid), bufSize, bid
	b.tail++
}

// publish stores the tail, which shares a 32-bit word with entry 0's bid:
// both are ours to write, so the word is stored whole, with release order.
func (b *buffers) publish() {
	b.returned = false
	word := (*uint32)(unsafe.Pointer(&b.ringMem[12]))
	atomic.StoreUint32(word, uint32(b.entries[0].bid)|uint32(b.tail)<<16)
}

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
	wakeBuf [8]byte
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
