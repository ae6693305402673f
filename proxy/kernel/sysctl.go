package kernel

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Sysctls reads and writes the kernel's settings under /proc/sys by their
// dotted names ("net.ipv4.ip_local_port_range"), for the network namespace
// of the calling thread. The zero value is the node's; a test sets Root to
// a directory of copies.
type Sysctls struct {
	Root string // "" means /proc/sys
}

// ProcSys is the node's /proc/sys.
var ProcSys = Sysctls{}

// ErrNoSysctl is returned (wrapped) for a setting the kernel does not have,
// often a module not loaded (nf_conntrack, br_netfilter).
var ErrNoSysctl = errors.New("no such sysctl")

// Path is the file of the setting name.
func (s Sysctls) Path(name string) string {
	root := s.Root
	if root == "" {
		root = "/proc/sys"
	}
	return filepath.Join(root, strings.ReplaceAll(name, ".", "/"))
}

// Read returns the setting's value without the trailing newline.
func (s Sysctls) Read(name string) (string, error) {
	b, err := os.ReadFile(s.Path(name))
	if errors.Is(err, os.ErrNotExist) {
		return "", fmt.Errorf("%s: %w", name, ErrNoSysctl)
	}
	if err != nil {
		return "", fmt.Errorf("sysctl %s: %w", name, err)
	}
	return strings.TrimSpace(string(b)), nil
}

// ReadInt returns an integer setting.
func (s Sysctls) ReadInt(name string) (int, error) {
	v, err := s.Read(name)
	if err != nil {
		return 0, err
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		return 0, fmt.Errorf("sysctl %s: %w", name, err)
	}
	return n, nil
}

// Set writes value when the kernel holds another one, and reports whether
// it wrote.
func (s Sysctls) Set(name, value string) (changed bool, err error) {
	cur, err := s.Read(name)
	if errors.Is(err, ErrNoSysctl) {
		return false, err
	}
	if err == nil && cur == value {
		return false, nil
	}
	if err := os.WriteFile(s.Path(name), []byte(value), 0o644); err != nil {
		return false, fmt.Errorf("sysctl %s: %w", name, err)
	}
	return true, nil
}

// SetInt is Set for an integer setting.
func (s Sysctls) SetInt(name string, value int) (changed bool, err error) {
	return s.Set(name, strconv.Itoa(value))
}

// Writable reports whether this process may write name (access(2),
// W_OK): false in a container whose /proc/sys is read-only, whatever the
// file's mode says.
func (s Sysctls) Writable(name string) bool {
	return unix.Access(s.Path(name), unix.W_OK) == nil
}
