//go:build crashtest

package daemon

// Crashes on demand, for the keeper's tests only: this file is built with
// -tags crashtest alone, so no production binary can be made to crash so.
//
//	SIGUSR1  a panic in a goroutine of its own
//	SIGUSR2  allocate and touch memory until the OOM killer ends the process
//
// and, with KUP_CRASHTEST_LEAK=1 in its environment, leaks a descriptor and
// a goroutine every 100 ms for as long as it serves: the build the soak
// (test/e2e/soak_test.go) is shown to fail on.

import (
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/sirupsen/logrus"
)

func init() { crashHooks = startCrashHooks }

func startCrashHooks(log logrus.FieldLogger) {
	if os.Getenv("KUP_CRASHTEST_LEAK") == "1" {
		log.Warn("crashtest: leaking a descriptor and a goroutine every 100 ms")
		go leak()
	}
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGUSR1, syscall.SIGUSR2)
	go func() {
		for sig := range c {
			switch sig {
			case syscall.SIGUSR1:
				go func() { panic("crashtest: a panic injected by SIGUSR1") }()
			case syscall.SIGUSR2:
				log.Warn("crashtest: allocating until the OOM killer comes")
				var hoard [][]byte
				for {
					b := make([]byte, 16<<20)
					for i := 0; i < len(b); i += 4096 {
						b[i] = 1
					}
					hoard = append(hoard, b)
				}
			}
		}
	}()
}

// leak opens /dev/null and parks a goroutine every 100 ms, keeping both.
func leak() {
	var kept []*os.File
	for range time.Tick(100 * time.Millisecond) {
		if f, err := os.Open(os.DevNull); err == nil {
			kept = append(kept, f)
		}
		go func() { select {} }()
	}
}
