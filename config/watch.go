package config

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/sirupsen/logrus"
)

// ManifestSource feeds a Sink from a manifests file or directory and reloads it
// when it changes. A reload that fails keeps the last good State in place.
type ManifestSource struct {
	Path string
	Node string
	Sink Sink
	Log  logrus.FieldLogger

	// Debounce merges the burst of events one save makes (it restarts with
	// every event, so a save of many writes is read once, after the last);
	// 0 means 5 ms.
	Debounce time.Duration
	// Poll re-reads the files this often as a safety net for file systems
	// without inotify; 0 means 2 s.
	Poll time.Duration
	// Settle is how long the files must have been unchanged before a
	// reload may remove a service port or an endpoint; 0 means 1 s. A file
	// rewritten in place (`kubectl get -o yaml > f.yaml` truncates it
	// first) is read half-written at times: what it adds or changes is
	// applied at once, what it seems to remove only once it is stable. A
	// file replaced by a rename is whole: its removals apply at once.
	Settle time.Duration

	cache *manifestCache // owned by the watch goroutine after Start
	last  *State         // the last State handed on, for ReuseUnchanged
	// settleAt is when held-back removals may apply (zero: none held).
	settleAt time.Time
	// owed are the ports whose version in last is an older one than the
	// files have (held removals): the next State names them as changed.
	owed []ServicePortName
	// lastSig is the files' signature at the last State handed on.
	lastSig map[string]fileSig
}

// Start loads the manifests once, hands the State to the Sink and then watches
// for changes until ctx ends. The returned error (a *ManifestError for a bad
// document) is only for the first load; done is closed when the watcher stops.
func (m *ManifestSource) Start(ctx context.Context) (done <-chan struct{}, err error) {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, fmt.Errorf("watching manifests: %w", err)
	}
	// Watch the directory that holds the file so that editors that save by
	// renaming a temporary file over it, and ConfigMap symlink swaps, are seen.
	dir := m.Path
	if fi, err := os.Stat(m.Path); err == nil && !fi.IsDir() {
		dir = filepath.Dir(m.Path)
	}
	if err := w.Add(dir); err != nil {
		w.Close()
		return nil, fmt.Errorf("watching manifests %s: %w", dir, err)
	}
	sig, err := m.load()
	if err != nil {
		w.Close()
		return nil, err
	}
	ch := make(chan struct{})
	go func() {
		defer close(ch)
		defer w.Close()
		m.watch(ctx, w, sig)
	}()
	return ch, nil
}

// Check loads the manifests once without handing them to the Sink, to fail
// early on a bad file; Start then reuses what it parsed.
func (m *ManifestSource) Check() error {
	if m.cache == nil {
		m.cache = newManifestCache()
	}
	_, _, err := m.cache.load(m.Path, m.Node)
	return err
}

// fileSig is what tells the poller a file changed. A new inode at a known
// path is a file replaced whole (renamed over): it was written completely.
type fileSig struct {
	size  int64
	mtime time.Time
	ino   uint64
}

func (m *ManifestSource) signature() map[string]fileSig {
	files, _ := manifestFiles(m.Path)
	sig := make(map[string]fileSig, len(files))
	for _, f := range files {
		if fi, err := os.Stat(f); err == nil {
			s := fileSig{size: fi.Size(), mtime: fi.ModTime()}
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				s.ino = st.Ino
			}
			sig[f] = s
		}
	}
	return sig
}

func (m *ManifestSource) load() (map[string]fileSig, error) {
	sig := m.signature()
	if m.cache == nil {
		m.cache = newManifestCache()
	}
	start := time.Now()
	st, skipped, err := m.cache.load(m.Path, m.Node)
	if err != nil {
		return sig, err
	}
	for _, s := range skipped {
		entry := m.Log.WithFields(logrus.Fields{"object": s.Object, "reason": s.Reason})
		if s.Warning {
			entry.Warn("Ports not proxied")
		} else {
			entry.Info("Not proxied")
		}
	}
	st = m.handOn(st, sig)
	ReuseUnchanged(st, m.last)
	m.last = st
	m.Log.WithFields(logrus.Fields{"path": m.Path, "servicePorts": len(st.Ports), "took": time.Since(start).String()}).Info("Manifests loaded")
	m.Sink.Update(st)
	return sig, nil
}

// handOn returns the State to hand on for the files' st: with removals
// held (holdRemovals) and saying what changed since the State handed on
// last, so that the proxier looks at those ports alone. A State made
// without its Since (the first, a new node) makes a full visit.
func (m *ManifestSource) handOn(st *State, sig map[string]fileSig) *State {
	out, held := m.holdRemovals(st, sig, time.Now())
	if out == st {
		copied := *st // st is the cache's too
		out = &copied
	}
	out.Seq = st.Seq
	if st.Since == 0 || m.last == nil || st.Since != m.last.Seq {
		out.Since, out.Changed = 0, nil
	} else {
		out.Since = st.Since
		out.Changed = slices.Concat(st.Changed, m.owed)
	}
	m.owed = held
	m.lastSig = sig
	return out
}

// holdRemovals returns st, but with the last State's version of every
// service port that st drops or that lost an endpoint, while the files
// changed less than Settle ago, and the names of those; then it records
// when to look again.
func (m *ManifestSource) holdRemovals(st *State, sig map[string]fileSig, now time.Time) (*State, []ServicePortName) {
	m.settleAt = time.Time{}
	if m.last == nil {
		return st, nil
	}
	settle := m.Settle
	if settle <= 0 {
		settle = time.Second
	}
	// Only files written in place can be half-written: one renamed over
	// (a new inode where the last load read another) is whole.
	var newest time.Time
	for f, s := range sig {
		if prev, known := m.lastSig[f]; known && prev.ino != s.ino && s.ino != 0 {
			continue
		}
		if s.mtime.After(newest) {
			newest = s.mtime
		}
	}
	if now.Sub(newest) >= settle {
		return st, nil
	}
	var held []ServicePortName
	var out *State
	for name, old := range m.last.Ports {
		// An unchanged port keeps its pointer (combineChanged,
		// ReuseUnchanged): only changed ones are compared.
		if sp := st.Ports[name]; sp != nil && (sp == old || !lostEndpoints(old, sp)) {
			continue
		}
		if out == nil {
			out = &State{Ports: make(map[ServicePortName]*ServicePort, len(st.Ports)+1), Node: st.Node}
			for n, sp := range st.Ports {
				out.Ports[n] = sp
			}
		}
		out.Ports[name] = old
		held = append(held, name)
	}
	if out == nil {
		return st, nil
	}
	m.settleAt = newest.Add(settle)
	m.Log.WithFields(logrus.Fields{"servicePorts": len(held), "until": m.settleAt.Format(time.RFC3339Nano)}).
		Info("Manifests changed less than the settle time ago: removals wait until the files are stable (write files atomically: a temporary file renamed over)")
	return out, held
}

// lostEndpoints reports whether an endpoint address of old is missing from sp.
func lostEndpoints(old, sp *ServicePort) bool {
	have := make(map[netip.AddrPort]bool, len(sp.Endpoints))
	for _, e := range sp.Endpoints {
		have[e.Addr] = true
	}
	for _, e := range old.Endpoints {
		if !have[e.Addr] {
			return true
		}
	}
	return false
}

func (m *ManifestSource) watch(ctx context.Context, w *fsnotify.Watcher, sig map[string]fileSig) {
	debounce, poll := m.Debounce, m.Poll
	if debounce <= 0 {
		debounce = 5 * time.Millisecond
	}
	if poll <= 0 {
		poll = 2 * time.Second
	}
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	ticker := time.NewTicker(poll)
	defer ticker.Stop()
	defer timer.Stop()
	settled := time.NewTimer(time.Hour)
	settled.Stop()
	defer settled.Stop()
	for {
		if !m.settleAt.IsZero() {
			settled.Reset(time.Until(m.settleAt) + time.Millisecond)
		}
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-w.Events:
			if !ok {
				return
			}
			if m.relevant(ev.Name) {
				timer.Reset(debounce)
			}
		case err, ok := <-w.Errors:
			if !ok {
				return
			}
			m.Log.WithError(err).Warn("Manifests watcher error; polling continues")
		case <-ticker.C:
			if !sameSig(sig, m.signature()) {
				timer.Reset(0)
			}
		case <-settled.C:
			timer.Reset(0) // the files were stable: load again, removals apply
		case <-timer.C:
			next, err := m.load()
			sig = next
			if err != nil {
				m.Log.WithError(err).Error("Manifests reload failed; still serving the last good state")
			}
		}
	}
}

func (m *ManifestSource) relevant(name string) bool {
	fi, err := os.Stat(m.Path)
	if err == nil && fi.IsDir() {
		return true
	}
	// Kubernetes mounts a ConfigMap as symlinks into a "..data" directory that
	// it swaps atomically: an event on a ".." name may change our file.
	return filepath.Clean(name) == filepath.Clean(m.Path) || strings.HasPrefix(filepath.Base(name), "..")
}

func sameSig(a, b map[string]fileSig) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}
