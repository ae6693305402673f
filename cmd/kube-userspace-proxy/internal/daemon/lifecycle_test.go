package daemon

import (
	"errors"
	"strings"
	"testing"
)

// Members start in their declared order and stop in the reverse one; a
// member that fails to start has the ones before it stopped, and nothing
// after it starts; members without a stop are skipped at stop.
func TestGroupOrder(t *testing.T) {
	for _, tc := range []struct {
		name    string
		failAt  string // the member whose start fails; "" none
		want    string // what happened, in order
		wantErr bool
	}{
		{"all start, then stop", "", "start a, start b, start c, start d, stop d, stop b, stop a", false},
		{"the third fails", "c", "start a, start b, start c, stop b, stop a", true},
		{"the first fails", "a", "start a", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var seen []string
			m := func(name string, stops bool) member {
				return member{name, func() (func(), error) {
					seen = append(seen, "start "+name)
					if name == tc.failAt {
						return func() { seen = append(seen, "stop of a failed start") }, errors.New("refused")
					}
					if !stops {
						return nil, nil
					}
					return func() { seen = append(seen, "stop "+name) }, nil
				}}
			}
			g := group{members: []member{m("a", true), m("b", true), m("c", false), m("d", true)}}
			err := g.start()
			if (err != nil) != tc.wantErr {
				t.Fatalf("start: %v", err)
			}
			if err == nil {
				g.stop()
				g.stop() // a second stop stops nothing again
			}
			if got := strings.Join(seen, ", "); got != tc.want {
				t.Fatalf("%s\nwant %s", got, tc.want)
			}
		})
	}
}
