// Command vminit is the init of the throwaway VM of test/realkernel.sh: it
// loads the modules /modules.list names (virtio, 9p, overlay) from the
// initramfs, mounts the host's root read-only over 9p under a tmpfs overlay,
// binds the kernel's module tree (without the netfilter extras) on
// /lib/modules, and runs /opt/kup-realkernel/run.sh there; it powers the VM off after.
package main

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"syscall"

	"golang.org/x/sys/unix"
)

func must(what string, err error) {
	if err != nil {
		fmt.Fprintf(os.Stderr, "init: %s: %v\n", what, err)
		unix.Sync()
		unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
	}
}

func main() {
	os.MkdirAll("/dev", 0o755)
	must("devtmpfs", unix.Mount("devtmpfs", "/dev", "devtmpfs", 0, ""))
	os.MkdirAll("/proc", 0o755)
	must("proc", unix.Mount("proc", "/proc", "proc", 0, ""))
	f, err := os.Open("/modules.list")
	must("modules.list", err)
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		m, err := os.Open(sc.Text())
		must("open "+sc.Text(), err)
		if err := unix.FinitModule(int(m.Fd()), "", 0); err != nil && err != unix.EEXIST {
			must("load "+sc.Text(), err)
		}
		m.Close()
	}
	for _, d := range []string{"/lower", "/upper", "/newroot"} {
		os.MkdirAll(d, 0o755)
	}
	must("9p", unix.Mount("hostroot", "/lower", "9p", unix.MS_RDONLY, "trans=virtio,version=9p2000.L,msize=524288,cache=loose"))
	must("tmpfs", unix.Mount("tmpfs", "/upper", "tmpfs", 0, "size=12g"))
	os.MkdirAll("/upper/u", 0o755)
	os.MkdirAll("/upper/w", 0o755)
	must("overlay", unix.Mount("overlay", "/newroot", "overlay", 0, "lowerdir=/lower,upperdir=/upper/u,workdir=/upper/w"))
	must("chroot", unix.Chroot("/newroot"))
	must("chdir", os.Chdir("/"))
	must("proc2", unix.Mount("proc", "/proc", "proc", 0, ""))
	must("sys", unix.Mount("sysfs", "/sys", "sysfs", 0, ""))
	must("dev", unix.Mount("devtmpfs", "/dev", "devtmpfs", 0, ""))
	os.MkdirAll("/dev/pts", 0o755)
	unix.Mount("devpts", "/dev/pts", "devpts", 0, "")
	must("modules", unix.Mount("/opt/kup-realkernel/mods/lib/modules", "/lib/modules", "", unix.MS_BIND, ""))
	must("tmp", unix.Mount("tmpfs", "/tmp", "tmpfs", 0, ""))
	must("run", unix.Mount("tmpfs", "/run", "tmpfs", 0, ""))
	os.MkdirAll("/run/netns", 0o755)
	cmd := exec.Command("/bin/bash", "/opt/kup-realkernel/run.sh")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = []string{"PATH=/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root"}
	err = cmd.Run()
	fmt.Println("run.sh:", err)
	unix.Sync()
	syscall.Reboot(syscall.LINUX_REBOOT_CMD_POWER_OFF)
}
