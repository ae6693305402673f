package cluster

import (
	"os"
	"os/exec"
	"strings"
)

// GoCommand returns the go command with args, to run in dir, in the one
// build configuration every non-race build of the suite shares: static
// (CGO_ENABLED=0, as the lab's images and nodes want) and -trimpath. Go's
// build cache reuses a compiled package only for the same flags and the
// same module versions below it (TestModulesThatShareACacheAgree), so with
// one configuration client-go and the rest compile once on a fresh machine
// for the daemon, the end-to-end tests and Kubernetes' programs alike. The
// Makefile exports the same for the builds it runs itself.
func GoCommand(dir string, args ...string) *exec.Cmd {
	cmd := exec.Command("go", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), buildEnv()...)
	return cmd
}

// buildEnv returns the environment GoCommand adds: CGO_ENABLED=0 and
// -trimpath added to the caller's GOFLAGS.
func buildEnv() []string {
	flags := os.Getenv("GOFLAGS")
	if !strings.Contains(" "+flags+" ", " -trimpath ") {
		flags = strings.TrimSpace(flags + " -trimpath")
	}
	return []string{"CGO_ENABLED=0", "GOFLAGS=" + flags}
}
