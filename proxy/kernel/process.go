package kernel

// The process's own dealings with the kernel: its peers' credentials on a
// unix socket, scheduling, priority, descriptors and children.

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Cred is a unix socket peer's credentials (SO_PEERCRED), as of its
// connect.
type Cred struct {
	UID, PID uint32
}

// PeerCred reads the credentials of c's peer.
func PeerCred(c *net.UnixConn) (Cred, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return Cred{}, err
	}
	var u *unix.Ucred
	var uerr error
	if err := raw.Control(func(fd uintptr) {
		u, uerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return Cred{}, err
	}
	if uerr != nil {
		return Cred{}, os.NewSyscallError("getsockopt SO_PEERCRED", uerr)
	}
	return Cred{UID: u.Uid, PID: uint32(u.Pid)}, nil
}

// Dup duplicates c's descriptor (close-on-exec) into a file named name,
// leaving c as it is: its mode stays non-blocking, its owner keeps it.
func Dup(c syscall.Conn, name string) (*os.File, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var f *os.File
	var ferr error
	if err := raw.Control(func(fd uintptr) {
		d, err := unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			ferr = os.NewSyscallError("fcntl", err)
			return
		}
		f = os.NewFile(uintptr(d), name)
	}); err != nil {
		return nil, err
	}
	return f, ferr
}

// SetBatchScheduling puts every thread of the process under SCHED_BATCH:
// the scheduler then treats the process as a throughput task whose
// wake-ups do not preempt what runs. Threads the Go runtime starts later
// inherit the policy from the thread that creates them, which is one of
// these. It returns the number of threads changed. No privilege is needed
// to choose a non-real-time policy.
func SetBatchScheduling() (int, error) {
	attr := unix.SchedAttr{Size: uint32(unsafe.Sizeof(unix.SchedAttr{})), Policy: unix.SCHED_BATCH}
	done := map[int]bool{}
	// A thread started during a pass by one not yet switched would keep the
	// normal policy: pass again until a pass finds no new thread.
	for pass := 0; pass < 10; pass++ {
		tasks, err := os.ReadDir("/proc/self/task")
		if err != nil {
			return len(done), fmt.Errorf("listing threads: %w", err)
		}
		fresh := 0
		for _, t := range tasks {
			tid, err := strconv.Atoi(t.Name())
			if err != nil || done[tid] {
				continue
			}
			if err := unix.SchedSetAttr(tid, &attr, 0); err != nil {
				if err == unix.ESRCH {
					continue // the thread has exited
				}
				return len(done), fmt.Errorf("sched_setattr thread %d: %w", tid, err)
			}
			done[tid] = true
			fresh++
		}
		if fresh == 0 {
			break
		}
	}
	return len(done), nil
}

// Renice sets the scheduling priority (nice value) of process pid.
func Renice(pid, nice int) error {
	return os.NewSyscallError("setpriority", unix.Setpriority(unix.PRIO_PROCESS, pid, nice))
}

// ReapChildren waits for every child of this process that has exited,
// without blocking: for a process that adopts orphans (a container's first
// process), whose children's children come to it when their parent dies.
func ReapChildren() {
	for {
		var ws unix.WaitStatus
		if pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil); pid <= 0 || err != nil {
			return
		}
	}
}

// Signaled says whether the process whose end state is ended was killed
// by a signal.
func Signaled(ended *os.ProcessState) bool {
	ws, ok := ended.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled()
}
