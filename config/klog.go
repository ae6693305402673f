package config

import (
	"fmt"
	"slices"
	"sync"

	"github.com/go-logr/logr"
	"github.com/sirupsen/logrus"
	"k8s.io/klog/v2"
)

// quietKlog routes client-go's klog output to logrus at debug level: the
// reflectors log every failed retry, which during an outage is a flood; the
// source logs an outage once itself.
func quietKlog(log logrus.FieldLogger) {
	klogOnce.Do(func() {
		klog.SetLogger(logr.New(&klogSink{log: log.WithField("from", "client-go")}))
	})
}

var klogOnce sync.Once

type klogSink struct {
	log    logrus.FieldLogger
	name   string
	values []any
}

func (s *klogSink) Init(logr.RuntimeInfo) {}

// Enabled says whether a line of klog verbosity level is written: client-go
// asks before it formats one, and most of its lines are V(4) and up.
func (s *klogSink) Enabled(level int) bool { return enabled(s.log, klogLevel(level)) }

func (s *klogSink) Info(level int, msg string, kv ...any) {
	s.log.WithFields(kvFields(s.values, kv)).Log(klogLevel(level), msg)
}

func (s *klogSink) Error(err error, msg string, kv ...any) {
	s.log.WithFields(kvFields(s.values, kv)).WithError(err).Debug(msg)
}

func (s *klogSink) WithValues(kv ...any) logr.LogSink {
	return &klogSink{log: s.log, name: s.name, values: slices.Concat(s.values, kv)}
}
func (s *klogSink) WithName(name string) logr.LogSink {
	return &klogSink{log: s.log.WithField("logger", name), name: name, values: s.values}
}

// klogLevel maps klog's verbosity to logrus: V(0)-V(2), what kube-proxy
// shows at its default --v=2, to debug; the rest to trace.
func klogLevel(v int) logrus.Level {
	if v <= 2 {
		return logrus.DebugLevel
	}
	return logrus.TraceLevel
}

// enabled says whether log writes lines of level.
func enabled(log logrus.FieldLogger, level logrus.Level) bool {
	switch l := log.(type) {
	case *logrus.Entry:
		return l.Logger.IsLevelEnabled(level)
	case *logrus.Logger:
		return l.IsLevelEnabled(level)
	}
	return true
}

// kvFields makes fields of key-value lists, the later value of a key
// winning; it never writes to the lists.
func kvFields(lists ...[]any) logrus.Fields {
	f := logrus.Fields{}
	for _, kv := range lists {
		for i := 0; i+1 < len(kv); i += 2 {
			f[fmt.Sprint(kv[i])] = kv[i+1]
		}
	}
	return f
}
