package daemon

// The live page at / on the metrics address, and the two JSON views only it
// needs: the latest connection log lines and the rules with their counters.
// The page is one embedded file with no external assets: it works offline,
// on a node without a route to anywhere.

import (
	_ "embed"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
)

//go:embed ui/index.html
var indexHTML []byte

// page serves the live page at / (and 404 for every other unknown path).
func page(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/" {
		http.NotFound(w, r)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	// Everything the page uses is inline: forbid anything else.
	w.Header().Set("Content-Security-Policy", "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	_, _ = w.Write(indexHTML)
}

// logLine is one connection log line, as /debug/log serves it.
type logLine struct {
	Time    time.Time      `json:"time"`
	Level   string         `json:"level"`
	Message string         `json:"msg"`
	Fields  map[string]any `json:"fields"`
}

// recentLog keeps the latest connection log lines (component=conn) for the
// page. It is a logrus hook: it sees exactly what the log writes, so
// --connection-log decides what it holds.
type recentLog struct {
	mu    sync.Mutex
	lines []logLine // a ring of size cap(lines)
	next  int
	full  bool
}

func newRecentLog(n int) *recentLog { return &recentLog{lines: make([]logLine, n)} }

func (r *recentLog) Levels() []logrus.Level { return logrus.AllLevels }

// Fire implements logrus.Hook: a copy of the fields into the ring.
func (r *recentLog) Fire(e *logrus.Entry) error {
	if e.Data["component"] != "conn" {
		return nil
	}
	fields := make(map[string]any, len(e.Data))
	for k, v := range e.Data {
		if k == "component" {
			continue
		}
		if err, ok := v.(error); ok {
			v = err.Error()
		}
		fields[k] = v
	}
	r.mu.Lock()
	r.lines[r.next] = logLine{Time: e.Time, Level: e.Level.String(), Message: e.Message, Fields: fields}
	r.next = (r.next + 1) % len(r.lines)
	r.full = r.full || r.next == 0
	r.mu.Unlock()
	return nil
}

// latest returns up to n lines, newest first.
func (r *recentLog) latest(n int) []logLine {
	r.mu.Lock()
	defer r.mu.Unlock()
	size := r.next
	if r.full {
		size = len(r.lines)
	}
	n = min(n, size)
	out := make([]logLine, 0, n)
	for i := 1; i <= n; i++ {
		out = append(out, r.lines[(r.next-i+len(r.lines))%len(r.lines)])
	}
	return out
}

// connLog is GET /debug/log?n=50: the latest connection log lines, newest first.
func (d *debugServer) connLog(w http.ResponseWriter, r *http.Request) {
	n := 50
	if s := r.URL.Query().Get("n"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 1 {
			http.Error(w, "n: want a positive number", http.StatusBadRequest)
			return
		}
		n = v
	}
	lines := []logLine{}
	if d.log != nil {
		lines = d.log.latest(n)
	}
	writeJSON(w, lines)
}

// ruleView is one rule of ours with the kernel's counters.
type ruleView struct {
	Family  int    `json:"family"`
	Table   string `json:"table"`
	Chain   string `json:"chain"`
	Rule    string `json:"rule"`
	Packets uint64 `json:"packets"`
	Bytes   uint64 `json:"bytes"`
}

// ruleViews lists the rules as last written with their packet counters,
// read from the kernel now (errors: the counters that could not be read).
func (d *debugServer) ruleViews() (out []ruleView, errs []string) {
	out = []ruleView{}
	for _, fam := range []int{4, 6} {
		if d.rules == nil {
			break
		}
		in, ok, err := d.rules.TraceInput(fam, true)
		if err != nil {
			errs = append(errs, err.Error())
		}
		if !ok {
			continue
		}
		for _, t := range []struct {
			name   string
			chains map[string][]string
		}{{"nat", in.Rules.Nat}, {"filter", in.Rules.Filter}} {
			chains := make([]string, 0, len(t.chains))
			for c := range t.chains {
				chains = append(chains, c)
			}
			sort.Strings(chains)
			for _, c := range chains {
				for _, rule := range t.chains[c] {
					v := ruleView{Family: fam, Table: t.name, Chain: c, Rule: rule}
					if cnt, ok := in.Counters[t.name+"/"+c+" "+rule]; ok {
						v.Packets, v.Bytes = cnt.Packets, cnt.Bytes
					}
					out = append(out, v)
				}
			}
		}
	}
	return out, errs
}
