package config

import (
	"crypto/sha256"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"
)

// ManifestError locates a problem in a manifests file: which file, which
// document (1-based), which List item, and what is wrong.
type ManifestError struct {
	File     string
	Document int
	Item     string // "items[3]" inside a List, else ""
	Object   string // "Service dev/devpaasy" once known
	Err      error
}

func (e *ManifestError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: document %d", e.File, e.Document)
	if e.Item != "" {
		b.WriteString(" " + e.Item)
	}
	if e.Object != "" {
		b.WriteString(" (" + e.Object + ")")
	}
	b.WriteString(": " + e.Err.Error())
	return b.String()
}

func (e *ManifestError) Unwrap() error { return e.Err }

// manifestFiles lists the files a --manifests path stands for: the file
// itself, or every *.yaml, *.yml and *.json directly inside a directory.
func manifestFiles(path string) ([]string, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("manifests: %w", err)
	}
	if !fi.IsDir() {
		return []string{path}, nil
	}
	entries, err := os.ReadDir(path)
	if err != nil {
		return nil, fmt.Errorf("manifests: %w", err)
	}
	var files []string
	for _, e := range entries {
		if e.IsDir() || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		switch strings.ToLower(filepath.Ext(e.Name())) {
		case ".yaml", ".yml", ".json":
			files = append(files, filepath.Join(path, e.Name()))
		}
	}
	sort.Strings(files)
	return files, nil
}

// Skipped records an object that was read but is not proxied, and why.
type Skipped struct {
	Object string
	Reason string
	// Warning marks what the Service's owner asked for and does not get
	// (SCTP ports), logged as a warning rather than a note.
	Warning bool
}

// LoadManifests reads a manifests file or directory and builds the State for node.
// The first invalid document is returned as a *ManifestError.
func LoadManifests(path, node string) (*State, []Skipped, error) {
	return newManifestCache().load(path, node)
}

// ParseManifests parses one file's content (used by tests and the fuzz target).
func ParseManifests(name string, data []byte, node string) (*State, error) {
	fr, err := parseFile(name, data)
	if err != nil {
		return nil, err
	}
	st, _, err := combine([]*fileResult{fr}, node)
	return st, err
}

// manifestCache keeps each file's parsed objects while the file is unchanged,
// so that a reload re-parses only the files that changed: with 10k Services
// in one file and one in another, editing the small one costs milliseconds.
type manifestCache struct {
	files map[string]*fileResult
	state *State // what files combined to, for incremental reloads
	// racy: a file read less than this after its last change may change
	// again without its times moving (they advance in steps of the
	// filesystem's granularity, up to 2 s on FAT), so its stamp proves
	// nothing and its content is compared instead (git's "racily clean").
	racy time.Duration
	read func(string) ([]byte, error)
}

func newManifestCache() *manifestCache {
	return &manifestCache{files: map[string]*fileResult{}, racy: 2 * time.Second, read: os.ReadFile}
}

func (c *manifestCache) load(path, node string) (*State, []Skipped, error) {
	files, err := manifestFiles(path)
	if err != nil {
		return nil, nil, err
	}
	results := make([]*fileResult, 0, len(files))
	seen := make(map[string]*fileResult, len(files))
	var changed []*fileResult // old and new versions of changed, added and removed files
	for _, f := range files {
		// Stat before reading: a write in between leaves a stamp older
		// than the content, which only costs a re-read next time.
		readAt := time.Now()
		st, err := stampOf(f)
		if err != nil {
			return nil, nil, fmt.Errorf("manifests: %w", err)
		}
		fr := c.files[f]
		if fr != nil && fr.stamp == st && fr.settled(c.racy) {
			seen[f] = fr
			results = append(results, fr)
			continue
		}
		data, err := c.read(f)
		if err != nil {
			return nil, nil, fmt.Errorf("manifests: %w", err)
		}
		// Keyed by content when the stamp cannot tell: two saves within
		// one clock tick can leave the same size and mtime behind.
		sum := sha256.Sum256(data)
		if fr == nil || fr.sum != sum {
			changed = append(changed, fr)
			if fr, err = parseFile(f, data); err != nil {
				return nil, nil, err
			}
			fr.sum = sum
			changed = append(changed, fr)
		}
		fr.stamp, fr.readAt = st, readAt
		seen[f] = fr
		results = append(results, fr)
	}
	for f, fr := range c.files {
		if seen[f] == nil {
			changed = append(changed, fr)
		}
	}
	var st *State
	var skipped []Skipped
	if c.state != nil && c.state.Node == node {
		st, skipped, err = combineChanged(results, node, c.state, changed)
	} else {
		st, skipped, err = combine(results, node)
	}
	if err != nil {
		return nil, nil, err
	}
	st.Seq = 1
	if c.state != nil {
		st.Seq = c.state.Seq + 1 // Since stays 0 unless combineChanged set it
	}
	c.files, c.state = seen, st // only a fully good load replaces the cache
	return st, skipped, nil
}

// combineChanged is combine for a reload: only the Services named in the
// changed files (old or new versions) are joined again, every other port is
// taken from prev. At 10k Services a full join took ~20 ms, most of the
// reload. The skipped list has every file's skipped objects but the
// "EndpointSlices take precedence" notes only of the Services joined again.
func combineChanged(results []*fileResult, node string, prev *State, changed []*fileResult) (*State, []Skipped, error) {
	keys := map[ServiceName]bool{}
	for _, fr := range changed {
		if fr == nil {
			continue // a new file has no old version
		}
		for _, ps := range fr.services {
			keys[ps.key] = true
		}
		for _, sl := range fr.slices {
			keys[sl.key] = true
		}
	}
	var sub []*fileResult // results reduced to the objects of those Services
	var skipped []Skipped
	for _, fr := range results {
		skipped = append(skipped, fr.skipped...)
		part := &fileResult{}
		for _, ps := range fr.services {
			if keys[ps.key] {
				part.services = append(part.services, ps)
			}
		}
		for _, sl := range fr.slices {
			if keys[sl.key] {
				part.slices = append(part.slices, sl)
			}
		}
		sub = append(sub, part)
	}
	joined, subSkipped, err := combine(sub, node)
	if err != nil {
		return nil, nil, err
	}
	// Since and Changed tell the proxier which ports to look at: those of
	// the Services joined again, as they were and as they are.
	st := &State{Ports: make(map[ServicePortName]*ServicePort, len(prev.Ports)+len(joined.Ports)), Node: node, Since: prev.Seq}
	for name, sp := range prev.Ports {
		if !keys[ServiceName{name.Namespace, name.Name}] {
			st.Ports[name] = sp
		} else {
			st.Changed = append(st.Changed, name)
		}
	}
	for name, sp := range joined.Ports {
		st.Ports[name] = sp
		st.Changed = append(st.Changed, name)
	}
	applyNode(st, results)
	return st, append(skipped, subSkipped...), nil
}

// where locates an object for error messages.
type where struct {
	file   string
	doc    int
	item   string
	object string
}

func (w where) err(e error) *ManifestError {
	return &ManifestError{File: w.file, Document: w.doc, Item: w.item, Object: w.object, Err: e}
}

// fileStamp is what stat(2) says of a file; an unchanged stamp spares
// reading and hashing it (a 10k-Service file is 3 MB: ~2 ms and 3 MB of
// garbage per reload).
type fileStamp struct {
	dev, ino     uint64
	size         int64
	mtime, ctime time.Time
}

func stampOf(path string) (fileStamp, error) {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return fileStamp{}, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	return fileStamp{
		dev: st.Dev, ino: st.Ino, size: st.Size,
		mtime: time.Unix(st.Mtim.Unix()), ctime: time.Unix(st.Ctim.Unix()),
	}, nil
}

// settled reports whether the file had not changed for longer than racy
// when it was read: then any later change moves its stamp.
func (fr *fileResult) settled(racy time.Duration) bool {
	return fr.readAt.Sub(fr.stamp.mtime) > racy && fr.readAt.Sub(fr.stamp.ctime) > racy
}

// fileResult is one file's objects, already converted to the model.
type fileResult struct {
	stamp    fileStamp // as it was when last read
	readAt   time.Time
	sum      [sha256.Size]byte
	services []parsedService
	slices   []parsedSlice
	nodes    []parsedNode
	skipped  []Skipped
}

// parsedNode is a Node object: the one named like this node gives its zone
// and whether it is going away (NodeState).
type parsedNode struct {
	name     string
	zone     string
	deleting bool
	podCIDRs []netip.Prefix
}

// applyNode sets st's zone and NodeDeleting from the Node object of st's
// node, if the files have one.
func applyNode(st *State, results []*fileResult) {
	for _, fr := range results {
		for _, n := range fr.nodes {
			if n.name == st.Node {
				st.Zone, st.NodeDeleting, st.PodCIDRs = n.zone, n.deleting, n.podCIDRs
			}
		}
	}
}

type parsedService struct {
	at    where
	key   ServiceName
	ports []*ServicePort
}

type parsedSlice struct {
	at  where
	key ServiceName
	eps map[string][]Endpoint
	// legacy marks endpoints converted from v1 Endpoints. They are used only
	// for Services without EndpointSlices, so that `kubectl get
	// svc,ep,endpointslices -o yaml` does not count every endpoint twice.
	legacy bool
}

// combine joins the files' objects into a State.
func combine(results []*fileResult, node string) (*State, []Skipped, error) {
	b := NewBuilder(node)
	var skipped []Skipped
	hasSlices := map[ServiceName]bool{}
	for _, fr := range results {
		skipped = append(skipped, fr.skipped...)
		for _, ps := range fr.services {
			if err := b.addPorts(ps.key, ps.ports); err != nil {
				return nil, nil, ps.at.err(err)
			}
		}
		for _, sl := range fr.slices {
			if !sl.legacy {
				hasSlices[sl.key] = true
			}
		}
	}
	for _, fr := range results {
		for _, sl := range fr.slices {
			if sl.legacy && hasSlices[sl.key] {
				skipped = append(skipped, Skipped{Object: sl.at.object, Reason: "the Service has EndpointSlices, which take precedence"})
				continue
			}
			b.addEndpoints(sl.key, sl.eps)
		}
	}
	st := b.State()
	applyNode(st, results)
	return st, skipped, nil
}
