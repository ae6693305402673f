package sock

// Batches: under load a UDP socket holds many datagrams at once. One
// recvmmsg(2) takes up to batchSize of them, and a run of one flow's
// datagrams of one size leaves in one sendmsg(2) with UDP_SEGMENT (GSO):
// one route lookup, one pass through netfilter and conntrack, one skb down
// the stack until the device or the receiving socket cuts it up. A batch
// is borrowed only while a socket has more queued, so that an idle service
// port holds no batch. Each batch is batchSize × 64 KiB (the largest
// datagram: nothing is ever truncated) of anonymous memory mapped outside
// Go's heap: the kernel fills only the pages a datagram needs, so a batch
// of small datagrams takes little RSS, where a heap allocation (zeroed by
// the runtime) would take it all. At most batchesKept wait for reuse.

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// batchSize is how many datagrams one recvmmsg takes and one GSO send
// carries at most (the kernel's limit is 64 segments).
const batchSize = 16

// maxDatagram is the largest UDP payload.
const maxDatagram = 64 * 1024

// maxGSOBytes bounds one GSO send's payload: the segments travel as one
// IP packet until cut up, and an IP packet holds 64 KiB.
const maxGSOBytes = 65000

// Batch holds datagrams taken from a socket by one ReceiveMore.
type Batch struct {
	mem   []byte // the buffers' mapping (nil: on the heap)
	msgs  [batchSize]unix.Mmsghdr
	iovs  [batchSize]unix.Iovec
	names [batchSize]unix.RawSockaddrInet6
	oobs  [batchSize][8]uint64
	bufs  [batchSize][]byte
	n     int
	addrs bool
}

// batchesKept bounds the batches kept for reuse (a burst on many flows at
// once borrows more; they are unmapped when given back).
const batchesKept = 32

var batches struct {
	mu   sync.Mutex
	free []*Batch
}

// GetBatch borrows a batch; Put gives it back.
func GetBatch() *Batch {
	batches.mu.Lock()
	if n := len(batches.free); n > 0 {
		b := batches.free[n-1]
		batches.free = batches.free[:n-1]
		batches.mu.Unlock()
		return b
	}
	batches.mu.Unlock()
	b := &Batch{}
	mem, err := unix.Mmap(-1, 0, batchSize*maxDatagram, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err == nil {
		b.mem = mem
	} else {
		mem = make([]byte, batchSize*maxDatagram) // no mapping: the heap will do
	}
	for i := range b.bufs {
		b.bufs[i] = mem[i*maxDatagram : (i+1)*maxDatagram : (i+1)*maxDatagram]
	}
	return b
}

// Put gives b back; b must not be used after.
func (b *Batch) Put() {
	b.n = 0
	batches.mu.Lock()
	if len(batches.free) < batchesKept {
		batches.free = append(batches.free, b)
		batches.mu.Unlock()
		return
	}
	batches.mu.Unlock()
	if b.mem != nil {
		_ = unix.Munmap(b.mem)
	}
}

// Len is how many datagrams the last ReceiveMore took.
func (b *Batch) Len() int { return b.n }

// Datagram is the i-th datagram; it stays valid until the next ReceiveMore
// or Put.
func (b *Batch) Datagram(i int) []byte { return b.bufs[i][:b.msgs[i].Len] }

// From is the i-th datagram's sender (a Receiver with addrs only).
func (b *Batch) From(i int) netip.AddrPort { return sockaddrAddrPort(&b.names[i]) }

// To is the local address the i-th datagram arrived on (addrs only).
func (b *Batch) To(i int) netip.Addr {
	return pktinfoAddr(unsafe.Pointer(&b.oobs[i]), uint64(b.msgs[i].Hdr.Controllen))
}

// Next waits until datagrams are queued on the socket (its read deadline
// applies), then takes them a batch at a time (recvmmsg) and hands each
// batch to each (its datagrams valid only during the call), until the
// socket is empty. No buffer is held while it waits: a batch is borrowed
// when datagrams arrive, so an idle flow costs none, and the first datagram
// and those queued behind it come in one system call.
func (r *Receiver) Next(each func(b *Batch)) error {
	err := r.raw.Read(r.tryBatch)
	b := r.batch
	r.batch = nil
	if b == nil {
		return err // closed, or the deadline passed, while waiting
	}
	defer b.Put()
	switch {
	case err != nil:
		return err
	case r.errno != 0:
		return recvmmsgError(r.errno)
	}
	for {
		each(b)
		if b.n < batchSize {
			return nil // the socket was emptied
		}
		if k, err := r.ReceiveMore(b); err != nil || k == 0 {
			return err
		}
	}
}

// attemptBatch is one recvmmsg into a borrowed batch, given back on
// EAGAIN: false then says wait for readability.
func (r *Receiver) attemptBatch(fd uintptr) bool {
	if r.batch == nil {
		r.batch = GetBatch()
	}
	r.errno = r.recvmmsg(fd, r.batch)
	if r.errno == unix.EAGAIN {
		r.batch.Put()
		r.batch = nil
		return false
	}
	return true
}

// ReceiveMore fills b with the datagrams queued on the socket now, without
// waiting, and returns how many: 0 when there were none.
func (r *Receiver) ReceiveMore(b *Batch) (int, error) {
	var errno syscall.Errno
	err := r.raw.Read(func(fd uintptr) bool {
		errno = r.recvmmsg(fd, b)
		return true // never wait: Next waits
	})
	switch {
	case err != nil:
		return 0, err
	case errno == unix.EAGAIN:
		return 0, nil
	case errno != 0:
		return 0, recvmmsgError(errno)
	}
	return b.n, nil
}

// recvmmsg takes up to a batch of datagrams into b (MSG_DONTWAIT, retried
// on EINTR) and sets b.n to how many.
func (r *Receiver) recvmmsg(fd uintptr, b *Batch) syscall.Errno {
	b.n, b.addrs = 0, r.addrs
	for i := range b.msgs {
		b.iovs[i].Base = &b.bufs[i][0]
		b.iovs[i].SetLen(len(b.bufs[i]))
		h := &b.msgs[i].Hdr
		*h = unix.Msghdr{Iov: &b.iovs[i]}
		h.SetIovlen(1)
		if r.addrs {
			h.Name = (*byte)(unsafe.Pointer(&b.names[i]))
			h.Namelen = unix.SizeofSockaddrInet6
			h.Control = (*byte)(unsafe.Pointer(&b.oobs[i]))
			h.SetControllen(int(unsafe.Sizeof(b.oobs[i])))
		}
		b.msgs[i].Len = 0
	}
	for {
		r1, _, e := unix.RawSyscall6(unix.SYS_RECVMMSG, fd, uintptr(unsafe.Pointer(&b.msgs[0])), batchSize,
			unix.MSG_DONTWAIT, 0, 0)
		if e != unix.EINTR {
			if e == 0 {
				b.n = int(r1)
			}
			return e
		}
	}
}

// recvmmsgError is a failed recvmmsg as a read error: an ICMP error the
// kernel reports on a connected socket (ECONNREFUSED, EHOSTUNREACH) among
// others.
func recvmmsgError(errno syscall.Errno) error {
	return &net.OpError{Op: "read", Net: "udp", Err: os.NewSyscallError("recvmmsg", errno)}
}

// SendSegments sends bufs in order, as Send would one by one (to the
// connected peer when to is not valid, from src when it is valid). Runs of
// datagrams of one size (the last of a run may be shorter) leave as one GSO
// send when the kernel takes it; sent counts the datagrams that left before
// an error.
func (s *Sender) SendSegments(bufs [][]byte, src netip.Addr, to netip.AddrPort) (sent int, err error) {
	for sent < len(bufs) {
		size := len(bufs[sent])
		k := 1
		total := size
		for sent+k < len(bufs) && k < batchSize && len(bufs[sent+k]) <= size && len(bufs[sent+k]) > 0 &&
			total+len(bufs[sent+k]) <= maxGSOBytes {
			last := len(bufs[sent+k]) < size
			total += len(bufs[sent+k])
			k++
			if last {
				break
			}
		}
		if k > 1 && size > 0 && size < s.gsoRefused {
			err := s.sendGSO(bufs[sent:sent+k], size, src, to)
			if err == nil {
				sent += k
				continue
			}
			var errno syscall.Errno
			if !errors.As(err, &errno) || (errno != unix.EINVAL && errno != unix.EIO && errno != unix.EOPNOTSUPP &&
				errno != unix.ENOPROTOOPT && errno != unix.EMSGSIZE) {
				return sent, err
			}
			// Refused (no UDP GSO, or segments too big for the
			// route's MTU): this size and larger go one by one.
			s.gsoRefused = size
		}
		if err := s.Send(bufs[sent], src, to); err != nil {
			return sent, err
		}
		sent++
	}
	return sent, nil
}

// sendGSO sends bufs, segments of size bytes but the last, in one sendmsg
// with a UDP_SEGMENT control message.
func (s *Sender) sendGSO(bufs [][]byte, size int, src netip.Addr, to netip.AddrPort) error {
	s.hdr = unix.Msghdr{}
	for i, b := range bufs {
		s.iovs[i].Base = &b[0]
		s.iovs[i].SetLen(len(b))
	}
	s.hdr.Iov = &s.iovs[0]
	s.hdr.SetIovlen(len(bufs))
	if to.IsValid() {
		s.hdr.Name = (*byte)(unsafe.Pointer(&s.name))
		s.hdr.Namelen = putSockaddr(&s.name, to, s.family)
	}
	controllen := 0
	if src.IsValid() {
		controllen = s.pktinfo(src)
	}
	h := (*unix.Cmsghdr)(unsafe.Add(unsafe.Pointer(&s.oob), controllen))
	h.Level, h.Type = unix.SOL_UDP, unix.UDP_SEGMENT
	h.SetLen(unix.CmsgLen(2))
	*(*uint16)(unsafe.Add(unsafe.Pointer(h), unix.CmsgLen(0))) = uint16(size)
	controllen += unix.CmsgSpace(2)
	s.hdr.Control = (*byte)(unsafe.Pointer(&s.oob))
	s.hdr.SetControllen(controllen)
	err := s.raw.Write(s.try)
	for i := range bufs {
		s.iovs[i].Base = nil // hold no buffer between datagrams
	}
	s.hdr = unix.Msghdr{}
	if err != nil {
		return err
	}
	if s.errno != 0 {
		return &net.OpError{Op: "write", Net: "udp", Err: os.NewSyscallError("sendmsg", s.errno)}
	}
	return nil
}

// pktinfoAddr is the address of the IP_PKTINFO or IPV6_PKTINFO control
// message among the controllen bytes at base.
func pktinfoAddr(base unsafe.Pointer, controllen uint64) netip.Addr {
	for off := uint64(0); off+unix.SizeofCmsghdr <= controllen; {
		h := (*unix.Cmsghdr)(unsafe.Add(base, off))
		if h.Len < unix.SizeofCmsghdr || off+h.Len > controllen {
			break
		}
		data := unsafe.Add(base, off+uint64(unix.CmsgLen(0)))
		switch {
		case h.Level == unix.IPPROTO_IP && h.Type == unix.IP_PKTINFO && h.Len >= uint64(unix.CmsgLen(unix.SizeofInet4Pktinfo)):
			return netip.AddrFrom4((*unix.Inet4Pktinfo)(data).Addr)
		case h.Level == unix.IPPROTO_IPV6 && h.Type == unix.IPV6_PKTINFO && h.Len >= uint64(unix.CmsgLen(unix.SizeofInet6Pktinfo)):
			return netip.AddrFrom16((*unix.Inet6Pktinfo)(data).Addr).Unmap()
		}
		off += uint64(unix.CmsgSpace(int(h.Len) - unix.CmsgLen(0)))
	}
	return netip.Addr{}
}
