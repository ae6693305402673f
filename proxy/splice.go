package proxy

import (
	"io"
	"net"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// spliceCopy copies src to dst until EOF (nil) or an error. Like io.Copy
// between two *net.TCPConn it splices bulk data, but it holds no pipe and no
// buffer while the connection is idle: io.Copy takes a pipe (two
// descriptors) for its whole call, so an idle proxied connection held six
// descriptors; here it holds its two sockets. Each wake-up reads into a
// pooled 32 KiB buffer; a small message is written straight on (two
// syscalls), a full buffer means bulk data and the rest of the burst goes
// through splice(2) with a pooled pipe. Waiting uses Go's poller, so src's
// read deadline applies.
func spliceCopy(dst, src *net.TCPConn, count func(int64)) (int64, error) {
	srcRaw, err := src.SyscallConn()
	if err != nil {
		return 0, err
	}
	dstRaw, err := dst.SyscallConn()
	if err != nil {
		return 0, err
	}
	var total int64
	for {
		var buf *[]byte
		var n int
		var rerr error
		err := srcRaw.Read(func(fd uintptr) bool {
			b := bufs.Get().(*[]byte)
			n, rerr = unix.Read(int(fd), *b)
			if rerr == unix.EAGAIN {
				bufs.Put(b) // nothing to read: wait without holding it
				return false
			}
			buf = b
			return true
		})
		if err != nil {
			return total, err
		}
		if rerr == unix.EINTR {
			bufs.Put(buf)
			continue
		}
		if rerr != nil {
			bufs.Put(buf)
			return total, &net.OpError{Op: "read", Net: "tcp", Err: rerr}
		}
		if n == 0 {
			bufs.Put(buf)
			return total, nil
		}
		_, werr := dst.Write((*buf)[:n])
		full := n == len(*buf)
		bufs.Put(buf)
		if werr != nil {
			return total, werr
		}
		total += int64(n)
		count(int64(n))
		if !full {
			continue
		}
		m, eof, err := spliceBurst(dstRaw, srcRaw)
		total += m
		if m > 0 {
			count(m)
		}
		if err != nil {
			return total, err
		}
		if eof {
			return total, nil
		}
	}
}

// bufs holds the read buffers of small messages, shared by all connections.
var bufs = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// maxSplice is how much one splice call moves at most (Go uses the same).
const maxSplice = 1 << 20

// spliceBurst moves what src has now to dst through a pooled pipe, and
// returns the pipe when src would block. eof reports that src is at EOF.
func spliceBurst(dstRaw, srcRaw syscall.RawConn) (moved int64, eof bool, err error) {
	p, err := pipes.get()
	if err != nil {
		return 0, false, err
	}
	defer func() {
		if err != nil {
			p.close() // the pipe may hold data that will never be read
			return
		}
		pipes.put(p)
	}()
	for {
		var n int64
		var serr error
		if cerr := srcRaw.Control(func(fd uintptr) {
			n, serr = unix.Splice(int(fd), nil, p.w, nil, maxSplice, unix.SPLICE_F_MOVE|unix.SPLICE_F_NONBLOCK)
		}); cerr != nil {
			return moved, false, cerr
		}
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
		if err := pump(dstRaw, p.r, int(n)); err != nil {
			return moved, false, err
		}
		moved += n
	}
}

// pump writes exactly n bytes from the pipe to the socket, waiting for the
// socket to become writable as needed.
func pump(dstRaw syscall.RawConn, pipeR int, n int) error {
	for n > 0 {
		var m int64
		var serr error
		err := dstRaw.Write(func(fd uintptr) bool {
			m, serr = unix.Splice(pipeR, nil, int(fd), nil, n, unix.SPLICE_F_MOVE|unix.SPLICE_F_NONBLOCK)
			return serr != unix.EAGAIN
		})
		if err != nil {
			return err
		}
		if serr == unix.EINTR {
			continue
		}
		if serr != nil {
			return &net.OpError{Op: "write", Net: "tcp", Err: serr}
		}
		if m == 0 {
			return io.ErrUnexpectedEOF
		}
		n -= int(m)
	}
	return nil
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
