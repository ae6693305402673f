package kernel

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// RaiseFileLimit sets the soft RLIMIT_NOFILE to the hard limit and returns
// it: every proxied TCP connection holds two sockets, and the default soft
// limit of 1024 would cap the proxy at a few hundred connections.
func RaiseFileLimit() (uint64, error) {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return 0, fmt.Errorf("getrlimit: %w", err)
	}
	if lim.Cur < lim.Max {
		lim.Cur = lim.Max
		if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
			return 0, fmt.Errorf("setrlimit NOFILE %d: %w", lim.Max, err)
		}
	}
	return lim.Cur, nil
}
