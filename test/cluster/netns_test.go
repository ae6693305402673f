package cluster

import (
	"os"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/testutil"
)

// The main goroutine keeps the main thread through init into TestMain, so
// that TestMain calls InNetns from the main thread for certain.
func init() { runtime.LockOSThread() }

// onMainThread is what f saw when TestMain called InNetns from the main
// thread: whether it ran there (it must not), or the error.
var onMainThread struct {
	ran, main bool
	err       error
}

func TestMain(m *testing.M) {
	if os.Geteuid() == 0 { // setns needs CAP_SYS_ADMIN
		onMainThread.err = InNetns("/proc/self/ns/net", func() error {
			onMainThread.ran = true
			onMainThread.main = unix.Gettid() == unix.Getpid()
			return nil
		})
	}
	runtime.UnlockOSThread()
	os.Exit(m.Run())
}

// InNetns never enters a namespace on the main thread, whose namespace
// stands for the whole process's (/proc/PID/ns/net): a lab's teardown
// would take the test for one of the lab's processes and kill it.
func TestInNetnsLeavesTheMainThreadAlone(t *testing.T) {
	testutil.RequireRoot(t, "setns")
	if onMainThread.err != nil {
		t.Fatal(onMainThread.err)
	}
	if !onMainThread.ran {
		t.Fatal("f did not run")
	}
	if onMainThread.main {
		t.Fatal("f ran on the main thread inside the namespace")
	}
}
