package daemon

// `kube-userspace-proxy keep [flags]`: the keeper, a supervising process
// that runs the daemon (its worker: this binary with the same flags) and
// holds a duplicate of every listening socket the worker opens
// (handover.Keeper), so that a crash of the worker — kill -9, the OOM
// killer, a panic, a fatal runtime error — refuses nothing: the sockets
// stay open in the keeper, connections wait in their backlogs, and the
// next worker, started at once, takes the sockets back through the
// handover exchange and accepts them. The keeper never parses a
// Kubernetes object, never serves a byte and shares no lock with the
// worker; it reads the worker's crash output (a pipe besides its stderr)
// only to name a panic, and kills a worker whose heartbeat stops.
//
// Who owns what: RunKeeper's goroutine owns the worker and its sockets, one
// worker at a time; a worker's Receive goroutine, crash output reader and
// the handover exchange offered to it end with it.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
)

// crashHooks starts the crashes on demand of a -tags crashtest build
// (crashtest.go); nil in every other build.
var crashHooks func(log logrus.FieldLogger)

// Restart backoff: a worker that served is started again at once (every
// moment without one is a moment of connections waiting in the backlogs);
// one that died before it served (a crash at start would come again)
// waits, twice as long each time, up to restartMax.
const (
	restartFirst = 100 * time.Millisecond
	restartMax   = 30 * time.Second
)

// hangTimeout is how long a worker's sync goroutine may not answer before
// the keeper kills it (keep --hang-timeout; its heartbeat comes every
// heartbeatEvery): well before docs/deploy's liveness probe (60 s) would
// restart the container.
const (
	defaultHangTimeout = 30 * time.Second
	heartbeatEvery     = 2 * time.Second
)

// keeperArgs splits keep's own flags (--hang-timeout D, then an optional
// --) from the daemon's.
func keeperArgs(args []string) (hang time.Duration, daemon []string, err error) {
	hang = defaultHangTimeout
	for len(args) > 0 {
		a := args[0]
		switch {
		case a == "--":
			return hang, args[1:], nil
		case a == "--hang-timeout" && len(args) > 1:
			a, args = "--hang-timeout="+args[1], args[1:]
			fallthrough
		case strings.HasPrefix(a, "--hang-timeout="):
			hang, err = time.ParseDuration(strings.TrimPrefix(a, "--hang-timeout="))
			if err != nil || hang < 3*heartbeatEvery {
				return 0, nil, fmt.Errorf("keep --hang-timeout %q: a duration of at least %v", strings.TrimPrefix(a, "--hang-timeout="), 3*heartbeatEvery)
			}
			args = args[1:]
		default:
			return hang, args, nil
		}
	}
	return hang, args, nil
}

// heartbeat tells the keeper every heartbeatEvery that the Proxier's sync
// goroutine answers, with the pick states changed since, until ctx ends.
func heartbeat(ctx context.Context, p *proxy.Proxier, k *handover.KeeperLink, log logrus.FieldLogger) {
	t := time.NewTicker(heartbeatEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		cctx, cancel := context.WithTimeout(ctx, 10*heartbeatEvery)
		picks, err := p.KeptPicks(cctx)
		cancel()
		if err != nil {
			continue
		}
		_ = k.Alive()
		if len(picks) > 0 {
			if err := k.Picks(picks); err == nil {
				log.WithField("frontends", len(picks)).Debug("Gave the keeper the pick states changed")
			}
		}
	}
}

// workerEnd is how a worker ended.
type workerEnd struct {
	state *os.ProcessState
	panic string // the first line of a Go panic or fatal error in its crash output, or its hang
	said  handover.WorkerSaid
	lived time.Duration
}

// crashed says whether the end is a crash, to be restarted: killed by a
// signal the keeper did not send, a panic or fatal error, or a failure
// after it had served. A failure before it served (bad flags, a refused
// takeover) is the worker's verdict on its start: the keeper ends with it.
func (e workerEnd) crashed() bool {
	if e.said.Released {
		return false
	}
	if e.panic != "" {
		return true
	}
	if kernel.Signaled(e.state) {
		return true
	}
	return e.state.ExitCode() != 0 && e.said.Serving
}

// cause names the end for the log.
func (e workerEnd) cause() string {
	c := e.state.String() // "exit status 2", "signal: killed"
	if e.panic != "" {
		c += ": " + e.panic
	}
	return c
}

// RunKeeper is the keep subcommand: it runs the daemon of args as its
// worker, again after each crash; it returns the exit code.
func RunKeeper(args []string, stdout, stderr io.Writer) int {
	log := logrus.New()
	log.SetOutput(stderr)
	log.SetFormatter(&logrus.TextFormatter{FullTimestamp: true})
	l := log.WithField("component", "keeper")
	hang, args, err := keeperArgs(args)
	if err != nil {
		fmt.Fprintf(stderr, "kube-userspace-proxy: %v\n", err)
		return ExitUsage
	}
	exe, err := os.Executable()
	if err != nil {
		l.WithError(err).Error("Cannot find this binary to run the worker")
		return ExitFailure
	}
	// The OOM killer is to pick the worker: the keeper below it where it
	// may lower its score, else equal, and the worker the larger process.
	if err := os.WriteFile("/proc/self/oom_score_adj", []byte("-1000"), 0o644); err != nil {
		l.WithError(err).Debug("The keeper's oom_score_adj stays (lowering it needs CAP_SYS_RESOURCE): the OOM killer picks the larger process, the worker")
	}
	signals := make(chan os.Signal, 2)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	defer signal.Stop(signals)

	k := handover.NewKeeper()
	defer k.Close()
	delay := time.Duration(0)
	for restarts := 0; ; restarts++ {
		end, stopping, err := runWorker(exe, args, k, hang, signals, stdout, stderr, l)
		if err != nil {
			l.WithError(err).Error("Cannot start the worker")
			return ExitFailure
		}
		if stopping || !end.crashed() {
			l.WithFields(logrus.Fields{"worker": end.state.Pid(), "end": end.cause()}).Info("The worker ended; so does the keeper")
			if code := end.state.ExitCode(); code >= 0 {
				return code
			}
			return ExitFailure
		}
		if end.said.Serving {
			delay = 0
		} else {
			delay = min(max(2*delay, restartFirst), restartMax)
		}
		fds, _ := os.ReadDir("/proc/self/fd")
		l.WithFields(logrus.Fields{"worker": end.state.Pid(), "cause": end.cause(), "lived": end.lived.Round(time.Millisecond).String(),
			"sockets": k.Held(), "restarts": restarts + 1, "in": delay.String(), "keeperFDs": len(fds), "keeperGoroutines": runtime.NumGoroutine()}).
			Error("The worker died; starting another on the sockets kept")
		// The dead worker's children (iptables-restore, say) came to the
		// keeper, the container's first process: reaped between workers, so
		// that no worker's own end is taken.
		kernel.ReapChildren()
		select {
		case <-time.After(delay):
		case sig := <-signals:
			l.WithField("signal", sig.String()).Info("Stopped before the next worker started")
			return 0
		}
	}
}

// runWorker runs one worker until it ends, offering it the sockets k
// holds (through the handover exchange on a socket pair of its own) and
// passing signals on;
// stopping says a signal was passed on.
func runWorker(
	exe string,
	args []string,
	k *handover.Keeper,
	hang time.Duration,
	signals <-chan os.Signal,
	stdout, stderr io.Writer,
	l logrus.FieldLogger,
) (workerEnd, bool, error) {
	c, wf, err := handover.WorkerSocket()
	if err != nil {
		return workerEnd{}, false, err
	}
	defer c.Close()
	cmd := exec.Command(exe, args...)
	cmd.ExtraFiles = []*os.File{wf} // descriptor 3
	cmd.Env = append(os.Environ(), handover.EnvKeeperFD+"=3")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	closeWorkerEnds := func() {
		for _, f := range cmd.ExtraFiles {
			f.Close()
		}
	}
	// The worker's crash output (a panic, a fatal error) comes here too
	// (debug.SetCrashOutput), for the log of its cause; its stderr is
	// ours, shared, not a pipe through us, so that it can write on when
	// the keeper is gone.
	crash, cw, err := os.Pipe()
	if err != nil {
		closeWorkerEnds()
		return workerEnd{}, false, err
	}
	cmd.ExtraFiles = append(cmd.ExtraFiles, cw) // descriptor 4
	cmd.Env = append(cmd.Env, envKeeperCrashFD+"=4")
	var offer *net.UnixConn
	if k.Held() > 0 {
		var of *os.File
		if offer, of, err = handover.WorkerSocket(); err != nil {
			closeWorkerEnds()
			crash.Close()
			return workerEnd{}, false, err
		}
		cmd.ExtraFiles = append(cmd.ExtraFiles, of) // descriptor 5
		cmd.Env = append(cmd.Env, handover.EnvKeeperHandover+"=5")
	}
	cmd.Stdout, cmd.Stderr = stdout, stderr
	start := time.Now()
	err = cmd.Start()
	closeWorkerEnds() // the worker's now: its end closes with it
	if err != nil {
		if offer != nil {
			offer.Close()
		}
		crash.Close()
		return workerEnd{}, false, err
	}
	var offered sync.WaitGroup
	if offer != nil {
		offered.Go(func() { handover.GiveTo(ctx, offer, k, l) })
	}
	var copying sync.WaitGroup
	var panicLine string
	copying.Go(func() { panicLine = crashLine(crash); crash.Close() })
	saidc := make(chan handover.WorkerSaid, 1)
	copying.Go(func() { saidc <- k.Receive(c) })
	waited := make(chan error, 1)
	go func() {
		copying.Wait() // the crash output and the link read to their end
		waited <- cmd.Wait()
	}()
	stopping, hung := false, false
	watch := time.NewTicker(time.Second)
	defer watch.Stop()
	var werr error
	for done := false; !done; {
		select {
		case sig := <-signals:
			stopping = true
			_ = cmd.Process.Signal(sig)
		case now := <-watch.C:
			if silent := k.Silent(now); !stopping && !hung && silent > hang {
				hung = true
				l.WithFields(logrus.Fields{"worker": cmd.Process.Pid, "silent": silent.Round(time.Second).String()}).
					Error("The worker hangs: its sync goroutine stopped answering; killing it")
				_ = cmd.Process.Kill()
			}
		case werr = <-waited:
			done = true
		}
	}
	cancel()
	offered.Wait()
	var exitErr *exec.ExitError
	if werr != nil && !errors.As(werr, &exitErr) {
		return workerEnd{}, stopping, fmt.Errorf("waiting for the worker: %w", werr)
	}
	if hung {
		panicLine = fmt.Sprintf("hung (no sign of life for %v)", hang)
	}
	return workerEnd{state: cmd.ProcessState, panic: panicLine, said: <-saidc, lived: time.Since(start)}, stopping, nil
}

// crashLine reads the worker's crash output to its end and returns the
// first line of a Go panic or fatal runtime error in it.
func crashLine(r io.Reader) string {
	var first string
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if first == "" && (strings.HasPrefix(line, "panic: ") || strings.HasPrefix(line, "fatal error: ")) {
			first = strings.TrimSpace(line)
		}
	}
	_, _ = io.Copy(io.Discard, r) // past a line too long for the scanner
	return first
}

// envKeeperCrashFD is the descriptor number of the pipe a kept worker
// writes its crash output to, besides its stderr.
const envKeeperCrashFD = "KUP_KEEPER_CRASH_FD"

// keepCrashOutput sends this process's crash output to its keeper too,
// when one runs it.
func keepCrashOutput(log logrus.FieldLogger) {
	v := os.Getenv(envKeeperCrashFD)
	if v == "" {
		return
	}
	os.Unsetenv(envKeeperCrashFD)
	fd, err := strconv.Atoi(v)
	if err != nil || fd < 3 {
		log.WithField("value", v).Warn("$" + envKeeperCrashFD + " is not a descriptor number: the keeper will not see a panic's line")
		return
	}
	f := os.NewFile(uintptr(fd), "keeper crash output")
	if err := debug.SetCrashOutput(f, debug.CrashOptions{}); err != nil {
		log.WithError(err).Warn("The keeper will not see a panic's line")
	}
	f.Close() // SetCrashOutput keeps a duplicate
}
