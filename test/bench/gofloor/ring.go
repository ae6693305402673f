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
