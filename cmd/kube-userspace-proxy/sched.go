package main

import (
	"fmt"
	"os"
	"strconv"
	"unsafe"

	"golang.org/x/sys/unix"
)

// setBatchScheduling puts every thread of the process under SCHED_BATCH:
// the scheduler then treats the daemon as a throughput task whose wake-ups
// do not preempt what runs. Threads the Go runtime starts later inherit the
// policy from the thread that creates them, which is one of these. It returns
// the number of threads changed. No privilege is needed to choose a non-real-
// time policy.
func setBatchScheduling() (int, error) {
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
