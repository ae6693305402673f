package daemon

import "github.com/sirupsen/logrus"

// member is one part of the daemon's run: start brings it up and returns
// how to stop it (nil: nothing to stop), or why it could not start.
type member struct {
	name  string
	start func() (stop func(), err error)
}

// group runs members in the one order they are declared in: each starts
// once every member before it has; at stop (or when a member fails to
// start) the started ones stop in the reverse order, each once every
// member after it has stopped.
type group struct {
	members []member
	stops   []func() // of the members started, in their order
	names   []string
	log     logrus.FieldLogger
}

// start starts the members in order; when one fails, those started stop
// and its error is returned.
func (g *group) start() error {
	for _, m := range g.members {
		stop, err := m.start()
		if err != nil {
			g.stop()
			return err
		}
		if stop != nil {
			g.stops = append(g.stops, stop)
			g.names = append(g.names, m.name)
		}
	}
	return nil
}

// stop stops the started members, last started first.
func (g *group) stop() {
	for i := len(g.stops) - 1; i >= 0; i-- {
		if g.log != nil {
			g.log.WithField("part", g.names[i]).Debug("Stopping")
		}
		g.stops[i]()
	}
	g.stops, g.names = nil, nil
}
