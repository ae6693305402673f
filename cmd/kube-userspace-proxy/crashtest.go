//go:build crashtest

package main

// Crashes on demand, for the keeper's tests only: this file is built with
// -tags crashtest alone, so no production binary can be made to crash so.
//
//	SIGUSR1  a panic in a goroutine of its own
//	SIGUSR2  allocate and touch memory until the OOM killer ends the process

import (
	"os"
	"os/signal"
	"syscall"

	"github.com/sirupsen/logrus"
)

func init() { crashHooks = startCrashHooks }

func startCrashHooks(log logrus.FieldLogger) {
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
