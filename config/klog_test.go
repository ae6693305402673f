package config

import (
	"io"
	"testing"

	"github.com/sirupsen/logrus"
	"github.com/sirupsen/logrus/hooks/test"
)

// client-go asks Enabled before it formats a line: the sink answers by the
// logger's level, V(0)-V(2) at debug and the rest at trace.
func TestKlogSinkHonoursVerbosity(t *testing.T) {
	for _, tc := range []struct {
		level      logrus.Level
		v2, v4, v9 bool
	}{
		{logrus.InfoLevel, false, false, false},
		{logrus.DebugLevel, true, false, false},
		{logrus.TraceLevel, true, true, true},
	} {
		log := logrus.New()
		log.SetOutput(io.Discard)
		log.SetLevel(tc.level)
		s := &klogSink{log: logrus.NewEntry(log)}
		if s.Enabled(2) != tc.v2 || s.Enabled(4) != tc.v4 || s.Enabled(9) != tc.v9 {
			t.Errorf("at %s: V(2) %v, V(4) %v, V(9) %v; want %v, %v, %v", tc.level, s.Enabled(2), s.Enabled(4), s.Enabled(9), tc.v2, tc.v4, tc.v9)
		}
	}
}

// A sink's values are shared by every line it writes (client-go calls it
// from many goroutines): a line's own key-values never land in them.
func TestKlogSinkNeverWritesItsValues(t *testing.T) {
	log, hook := test.NewNullLogger()
	log.SetLevel(logrus.TraceLevel)
	values := make([]any, 2, 8) // room to append into, as WithValues may leave
	values[0], values[1] = "shared", 1
	s := &klogSink{log: logrus.NewEntry(log), values: values}
	s.Info(0, "first", "own", "a")
	s.Info(0, "second", "other", "b")
	if spare := values[:cap(values)]; spare[2] != nil || spare[3] != nil {
		t.Fatalf("a line wrote into the sink's values: %v", spare)
	}
	entries := hook.AllEntries()
	if len(entries) != 2 || entries[1].Data["own"] != nil || entries[1].Data["other"] != "b" || entries[1].Data["shared"] != 1 {
		t.Fatalf("lines %v", entries)
	}
}
