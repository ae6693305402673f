package daemon

import (
	"net/http"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// The health server's answers, with kube-proxy's names.
var (
	healthzTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kubeproxy_proxy_healthz_total", Help: "Answers of /healthz on the health address, by HTTP status.",
	}, []string{"code"})
	livezTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kubeproxy_proxy_livez_total", Help: "Answers of /livez on the health address, by HTTP status.",
	}, []string{"code"})
)

// counted counts h's answers in c by status code.
func counted(c *prometheus.CounterVec, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sw := &statusWriter{ResponseWriter: w, code: http.StatusOK}
		h.ServeHTTP(sw, r)
		c.WithLabelValues(strconv.Itoa(sw.code)).Inc()
	})
}

type statusWriter struct {
	http.ResponseWriter
	code int
}

func (s *statusWriter) WriteHeader(code int) {
	s.code = code
	s.ResponseWriter.WriteHeader(code)
}

// buildInfo is Kubernetes components' kubernetes_build_info, for this
// binary: its module version and the commit it was built from, as the Go
// toolchain recorded them.
func buildInfo() prometheus.Collector {
	labels := prometheus.Labels{"major": "", "minor": "", "git_version": "(devel)", "git_commit": "", "git_tree_state": "",
		"build_date": "", "go_version": runtime.Version(), "compiler": runtime.Compiler, "platform": runtime.GOOS + "/" + runtime.GOARCH}
	if bi, ok := debug.ReadBuildInfo(); ok {
		if v := bi.Main.Version; v != "" {
			labels["git_version"] = v
			if major, rest, ok := strings.Cut(strings.TrimPrefix(v, "v"), "."); ok {
				minor, _, _ := strings.Cut(rest, ".")
				labels["major"], labels["minor"] = major, minor
			}
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				labels["git_commit"] = s.Value
			case "vcs.modified":
				labels["git_tree_state"] = map[string]string{"true": "dirty", "false": "clean"}[s.Value]
			case "vcs.time":
				if t, err := time.Parse(time.RFC3339, s.Value); err == nil {
					labels["build_date"] = t.UTC().Format(time.RFC3339)
				}
			}
		}
	}
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "kubernetes_build_info",
		Help: "1, labelled with the version this binary was built from (as Kubernetes components).", ConstLabels: labels})
	g.Set(1)
	return g
}
