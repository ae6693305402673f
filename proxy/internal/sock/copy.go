package sock

import (
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Copy copies src to dst until EOF (nil) or an error. Like io.Copy
// between two *net.TCPConn it splices bulk data, but it holds no pipe and no
// buffer while the connection is idle: io.Copy takes a pipe (two
// descriptors) for its whole call, so an idle proxied connection held six
// descriptors; here it holds its two sockets.
//
// Each wake-up reads what src has into a pooled 32 KiB buffer and writes it
// on in one piece; a full buffer means bulk data and the rest of the burst
// goes through splice(2) with a pooled pipe. Reading until src would block
// before writing costs no extra system call (the read that finds nothing
// happens either way) and shows an EOF that arrived with the data: then the
// data is written with MSG_MORE so that the FIN the caller sends next leaves
// in the same segment, as it would from the sender itself.
//
// All of it runs inside one RawConn.Read callback that returns false to wait
// for readability: RawConn.Read forgets earlier readiness when it begins, so
// a fresh call would have to try a read first, one more system call per
// message. Waiting uses Go's poller; Abort on either socket ends the copy
// with net.ErrClosed wherever it waits. count gets the bytes of every write,
// so that a live connection's counters move while it runs.
//
// After src.Detach, Copy returns ErrDetached as soon as it waits for src
// (at once if it does already): everything it read has been written to
// dst then, so the pair can move to another process whole.
//
// With idle > 0, Copy returns ErrIdle once src had nothing to read for
// about idle (between idle and twice that): nothing is in flight then, and
// the caller may park src (Parker) instead of holding a goroutine on it,
// then call Copy again when src wakes. One read deadline, set again only
// when it fires after data came, costs an active copy nothing per message.
// Copy leaves no deadline behind.
func Copy(dst, src *Conn, count func(int64), idle time.Duration) (int64, error) {
	c := copiers.Get().(*copier)
	c.start(dst, src, count)
	n, err := c.run(idle)
	c.reset()
	copiers.Put(c)
	return n, err
}

// copier is one Copy's state, its callbacks bound once. Copiers are pooled:
// a connection's two copies cost no allocation (closures and the variables
// they captured cost ten per copy), and no copier is referenced once its Copy
// has returned.
type copier struct {
	out sink
	src *Conn
	// cerr is what ended the copy inside the callback; nil at EOF.
	cerr error
	// bulk: the last wake-up moved more than a buffer, so this one starts
	// with splice(2) instead of copying the first 32 KiB through user space.
	bulk bool
	// useInq: read with TCP_CM_INQ, which saves the read that finds the
	// socket empty after every message (three system calls per message
	// become two). An accepted socket has TCP_INQ from its listener; a
	// dialled one gets it once it carried a second message (a
	// conversation), so that a connection with one request and one reply
	// never pays the setsockopt.
	useInq   bool
	inq      inqReader
	messages int
	wakes    int                   // wake-ups that found data: an idle deadline after one is no idle time
	tryRead  func(fd uintptr) bool // copyAvailable, bound once
}

var copiers = sync.Pool{New: func() any {
	c := &copier{}
	c.out.try = c.out.attempt
	c.tryRead = c.copyAvailable
	return c
}}

func (c *copier) start(dst, src *Conn, count func(int64)) {
	c.out.s, c.out.count = dst, count
	c.src = src
	c.useInq = src.inq
}

// reset leaves the copier holding nothing of the copy it served.
func (c *copier) reset() {
	c.out.s, c.out.count, c.out.err, c.out.total = nil, nil, nil, 0
	c.src, c.cerr = nil, nil
	c.bulk, c.useInq, c.messages, c.wakes = false, false, 0, 0
}

func (c *copier) run(idle time.Duration) (int64, error) {
	src, out := c.src, &c.out
	if src.detach.Load() {
		return 0, ErrDetached
	}
	if idle <= 0 {
		if err := src.read(c.tryRead); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) && src.detach.Load() {
				return out.total, ErrDetached // waiting for src: nothing in flight
			}
			return out.total, err // closed while waiting
		}
		return out.total, c.cerr
	}
	defer src.setReadDeadline(time.Time{})
	for {
		seen := c.wakes
		src.setReadDeadline(time.Now().Add(idle))
		err := src.read(c.tryRead)
		switch {
		case err == nil:
			return out.total, c.cerr
		case errors.Is(err, os.ErrDeadlineExceeded) && src.detach.Load():
			return out.total, ErrDetached // waiting for src: nothing in flight
		case !errors.Is(err, os.ErrDeadlineExceeded):
			return out.total, err // closed while waiting
		case c.wakes == seen:
			return out.total, ErrIdle
		}
	}
}

// burst splices what the socket has; true ends the wait.
func (c *copier) burst(fd int) bool {
	m, eof, err := spliceBurst(&c.out, fd, &c.src.detach)
	if err != nil {
		c.cerr = err
		return true
	}
	if m > 0 {
		c.wakes++
	}
	c.bulk = m >= bufSize
	return eof // drained (the pipe is back in the pool): wait, unless at EOF
}

// copyAvailable is the read callback: it moves what src has now, and says
// whether the copy is over (true) or waits for src (false).
func (c *copier) copyAvailable(fd uintptr) bool {
	if c.bulk {
		return c.burst(int(fd))
	}
	var inq *inqReader
	if c.useInq {
		inq = &c.inq
	}
	b := bufs.Get().(*[]byte)
	n, eof, rerr := readAvailable(int(fd), *b, inq)
	if n > 0 {
		c.wakes++
		if c.messages++; c.messages == 2 && !c.useInq {
			// Kept on the Conn: a copy resumed after a pause
			// starts with it instead of counting again.
			c.useInq = setInq(int(fd))
			c.src.inq = c.useInq
		}
		flags := 0
		if eof {
			flags = unix.MSG_MORE // the caller's FIN follows at once
		}
		if werr := c.out.send((*b)[:n], flags); werr != nil {
			bufs.Put(b)
			c.cerr = werr
			return true
		}
	}
	full := n == len(*b)
	bufs.Put(b) // never held while waiting
	switch {
	case rerr != nil:
		c.cerr = &net.OpError{Op: "read", Net: "tcp", Err: rerr}
		return true
	case eof:
		return true
	case !full:
		return false // src is drained: wait for more
	}
	return c.burst(int(fd))
}

// readAvailable reads from the non-blocking socket fd into b until b is
// full, the socket has nothing more (EAGAIN, or inq says nothing is left),
// EOF or an error. It returns the bytes read; eof and err describe what ended
// the reading (neither: drained or full). inq may be nil: plain read(2).
func readAvailable(fd int, b []byte, inq *inqReader) (n int, eof bool, err error) {
	for n < len(b) {
		var m, left int
		if inq != nil {
			m, left, err = inq.read(fd, b[n:])
		} else {
			m, err = rawRead(fd, b[n:])
			left = -1
		}
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			return n, false, nil
		case err != nil:
			return n, false, err
		case m == 0:
			return n, true, nil
		}
		n += m
		if left == 0 {
			return n, false, nil // drained, and no FIN waiting
		}
	}
	return n, false, nil
}

// inqReader reads with recvmsg(2) on a socket with TCP_INQ set: each read
// comes with a TCP_CM_INQ control message saying how many bytes are left
// to read, a received FIN counted as one (tcp_inq_hint in the kernel), so
// "0 left" means the socket is drained and the next wake-up will tell of
// new data or the FIN.
type inqReader struct {
	hdr unix.Msghdr
	iov unix.Iovec
	oob [unix.SizeofCmsghdr + 8]byte // one cmsg with an int, aligned
}

// setInq sets TCP_INQ on fd; false when the kernel refuses (before Linux
// 4.18): plain reads then.
func setInq(fd int) bool {
	return unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_INQ, 1) == nil
}

// read reads once into b. left is what the kernel says remains, or -1 when
// no TCP_CM_INQ came back (the caller reads on until EAGAIN).
func (r *inqReader) read(fd int, b []byte) (n, left int, err error) {
	r.iov.Base = &b[0]
	r.iov.SetLen(len(b))
	r.hdr.Iov = &r.iov
	r.hdr.SetIovlen(1)
	r.hdr.Control = &r.oob[0]
	r.hdr.SetControllen(len(r.oob))
	m, errno := msgCall(unix.SYS_RECVMSG, uintptr(fd), &r.hdr)
	r.iov.Base, r.hdr.Iov, r.hdr.Control = nil, nil, nil // hold no buffer between reads
	if errno != 0 {
		return 0, -1, errno
	}
	left = -1
	if r.hdr.Controllen >= unix.SizeofCmsghdr+4 {
		h := (*unix.Cmsghdr)(unsafe.Pointer(&r.oob[0]))
		if h.Level == unix.IPPROTO_TCP && h.Type == unix.TCP_CM_INQ {
			left = int(*(*int32)(unsafe.Pointer(&r.oob[unix.SizeofCmsghdr])))
		}
	}
	return m, left, nil
}

// sink writes to the destination socket of one copy (a copier's, or one
// write's: newSink). Its wait callback is bound once, so that a message costs
// no allocation (closures per write cost six per message).
type sink struct {
	s   *Conn
	try func(fd uintptr) bool // s.attempt
	// The write in progress: from buf with send(2) flags, or, when buf is
	// nil, n bytes spliced from the pipe pipeR.
	buf        []byte
	flags      int
	pipeR      int
	n, done, m int
	err        error

	total int64       // bytes written so far
	count func(int64) // told of every write; nil: nobody asks
}

func newSink(dst *Conn) *sink {
	s := &sink{s: dst}
	s.try = s.attempt
	return s
}

// send writes b with send(2) flags, waiting for the socket to become
// writable as needed.
func (s *sink) send(b []byte, flags int) error {
	s.buf, s.flags, s.n = b, flags, len(b)
	err := s.writeAll()
	s.buf = nil // hold no buffer between writes
	return err
}

// pump writes exactly n bytes from the pipe pipeR, waiting for the socket to
// become writable as needed.
func (s *sink) pump(pipeR, n int) error {
	s.pipeR, s.n = pipeR, n
	return s.writeAll()
}

// writeAll attempts until n bytes are written, waiting on EAGAIN.
func (s *sink) writeAll() error {
	for s.done = 0; s.done < s.n; {
		if err := s.s.write(s.try); err != nil {
			return err
		}
		switch {
		case s.err == unix.EINTR:
			continue
		case s.err != nil:
			return &net.OpError{Op: "write", Net: "tcp", Err: s.err}
		case s.m == 0:
			return io.ErrUnexpectedEOF
		}
		s.done += s.m
		s.total += int64(s.m)
		if s.count != nil {
			s.count(int64(s.m))
		}
	}
	return nil
}

// attempt is one write; it returns false (wait for writability) on EAGAIN.
func (s *sink) attempt(fd uintptr) bool {
	var m uintptr
	var errno syscall.Errno
	switch {
	case s.buf == nil:
		s.m, s.err = rawSplice(s.pipeR, int(fd), s.n-s.done)
		return s.err != unix.EAGAIN
	case s.flags == 0:
		m, _, errno = unix.RawSyscall(unix.SYS_WRITE, fd, uintptr(unsafe.Pointer(&s.buf[s.done])), uintptr(s.n-s.done))
	default:
		m, _, errno = unix.RawSyscall6(unix.SYS_SENDTO, fd, uintptr(unsafe.Pointer(&s.buf[s.done])), uintptr(s.n-s.done),
			uintptr(s.flags|unix.MSG_NOSIGNAL), 0, 0)
	}
	s.m, s.err = int(m), nil
	if errno != 0 {
		s.m, s.err = 0, errno
	}
	return s.err != unix.EAGAIN
}

// bufs holds the read buffers of small messages, shared by all connections.
var bufs = sync.Pool{New: func() any { b := make([]byte, bufSize); return &b }}

const bufSize = 32 << 10

// maxSplice is how much one splice call moves at most (Go uses the same).
const maxSplice = 1 << 20

// spliceBurst moves what the socket srcFd has now to dst through a pooled
// pipe, and returns the pipe when srcFd would block. eof reports that srcFd
// is at EOF. Once detach is set it stops after the next pump, the pipe
// empty, with ErrDetached: a source that never runs dry (a download into a
// slow reader) pauses there.
func spliceBurst(dst *sink, srcFd int, detach *atomic.Bool) (moved int64, eof bool, err error) {
	p, err := pipes.get()
	if err != nil {
		return 0, false, err
	}
	defer func() {
		switch {
		case p == nil: // given back already (detached, the pipe empty)
		case err != nil:
			p.close() // the pipe may hold data that will never be read
		default:
			pipes.put(p)
		}
	}()
	for {
		n, serr := rawSplice(srcFd, p.w, maxSplice)
		switch {
		case serr == unix.EAGAIN:
			return moved, false, nil // drained: give the pipe back, wait again
		case serr == unix.EINTR:
			continue
		case serr != nil:
			return moved, false, &net.OpError{Op: "read", Net: "tcp", Err: serr}
		case n == 0:
			return moved, true, nil
		}
		if err := dst.pump(p.r, int(n)); err != nil {
			return moved, false, err
		}
		moved += int64(n)
		if detach.Load() {
			pipes.put(p)
			p = nil
			return moved, false, ErrDetached
		}
	}
}

// pipe is a non-blocking pipe pair used by one burst at a time.
type pipe struct{ r, w int }

func (p *pipe) close() {
	unix.Close(p.r)
	unix.Close(p.w)
}

// pipePool keeps a few empty pipes for reuse; beyond maxIdlePipes they are
// closed, so idle connections never pin descriptors.
type pipePool struct {
	mu   sync.Mutex
	free []*pipe
}

const maxIdlePipes = 32

var pipes pipePool

func (pp *pipePool) get() (*pipe, error) {
	pp.mu.Lock()
	if n := len(pp.free); n > 0 {
		p := pp.free[n-1]
		pp.free = pp.free[:n-1]
		pp.mu.Unlock()
		return p, nil
	}
	pp.mu.Unlock()
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_NONBLOCK|unix.O_CLOEXEC); err != nil {
		return nil, &net.OpError{Op: "pipe", Net: "tcp", Err: err}
	}
	// A larger pipe moves more per splice call; failing is harmless.
	_, _ = unix.FcntlInt(uintptr(fds[1]), unix.F_SETPIPE_SZ, maxSplice)
	return &pipe{r: fds[0], w: fds[1]}, nil
}

func (pp *pipePool) put(p *pipe) {
	pp.mu.Lock()
	if len(pp.free) < maxIdlePipes {
		pp.free = append(pp.free, p)
		p = nil
	}
	pp.mu.Unlock()
	if p != nil {
		p.close()
	}
}

// The copy's system calls go through RawSyscall, not Syscall: on
// non-blocking sockets and pipes they never block, and Syscall's
// entersyscall lets the runtime's monitor thread take the P away from a
// call that runs for over ~20 µs, which a write carrying the TCP transmit
// path (and the receiver's softirq) often does: with every copy doing that,
// the monitor polled without rest and handed Ps between threads.

// rawRead is read(2) on a non-blocking descriptor.
func rawRead(fd int, b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	n, _, errno := unix.RawSyscall(unix.SYS_READ, uintptr(fd), uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
	if errno != 0 {
		return 0, errno
	}
	return int(n), nil
}

// rawSplice moves up to n bytes from in to out, both non-blocking.
func rawSplice(in, out, n int) (int, error) {
	m, _, errno := unix.RawSyscall6(unix.SYS_SPLICE, uintptr(in), 0, uintptr(out), 0, uintptr(n),
		unix.SPLICE_F_MOVE|unix.SPLICE_F_NONBLOCK)
	if errno != 0 {
		return 0, errno
	}
	return int(m), nil
}

// msgCall is sendmsg(2) or recvmsg(2) (trap) on fd, retried on EINTR.
func msgCall(trap, fd uintptr, hdr *unix.Msghdr) (int, syscall.Errno) {
	for {
		n, _, errno := unix.RawSyscall(trap, fd, uintptr(unsafe.Pointer(hdr)), 0)
		if errno != unix.EINTR {
			return int(n), errno
		}
	}
}
