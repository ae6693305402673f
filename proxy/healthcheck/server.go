// Package healthcheck serves Services' health check node ports
// (spec.healthCheckNodePort), as kube-proxy does: a cloud load balancer in
// front of a Service with externalTrafficPolicy Local asks every node, and
// sends traffic only to nodes that answer 200 — those with a ready endpoint
// of the Service on them, whose proxy is healthy.
//
// The Server is fed by the proxier's sync goroutine (Sync) and owns its
// listeners and their goroutines until Close. It imports nothing of this
// project.
package healthcheck

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sirupsen/logrus"
)

// Service is one Service's health check port and what it reports.
type Service struct {
	Namespace, Name string
	Port            int
	// LocalEndpoints is the number of ready endpoints of the Service on
	// this node.
	LocalEndpoints int
}

// Server serves every Service's health check port.
type Server struct {
	// Addrs are the addresses to listen on (--nodeport-addresses); empty
	// means every address.
	Addrs []netip.Addr
	// Healthy reports whether the proxy itself is healthy (its /healthz
	// without the node's own state); nil means always.
	Healthy func() bool
	Log     logrus.FieldLogger

	mu     sync.Mutex
	ports  map[int]*port
	failed map[int]string // ports that could not be opened, with the error logged
	wg     sync.WaitGroup
}

type port struct {
	svc     atomic.Pointer[Service]
	servers []*http.Server
}

// Sync opens the ports of services that have none yet, updates what the
// others report, and closes the ports of Services that are gone. A port
// that cannot be opened is logged (once per error) and tried again at the
// next Sync.
func (s *Server) Sync(services []Service) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ports == nil {
		s.ports, s.failed = map[int]*port{}, map[int]string{}
	}
	want := make(map[int]Service, len(services))
	for _, svc := range services {
		want[svc.Port] = svc
	}
	for n, p := range s.ports {
		if _, ok := want[n]; !ok {
			p.close()
			delete(s.ports, n)
			s.log().WithField("port", n).Info("Health check node port closed")
		}
	}
	for n, svc := range want {
		svc := svc
		if p := s.ports[n]; p != nil {
			p.svc.Store(&svc)
			continue
		}
		p, err := s.open(n, &svc)
		if err != nil {
			if s.failed[n] != err.Error() {
				s.log().WithFields(logrus.Fields{"port": n, "service": svc.Namespace + "/" + svc.Name}).WithError(err).
					Error("Cannot open the health check node port; load balancers will see this node as down; retrying")
				s.failed[n] = err.Error()
			}
			continue
		}
		delete(s.failed, n)
		s.ports[n] = p
		s.log().WithFields(logrus.Fields{"port": n, "service": svc.Namespace + "/" + svc.Name}).Info("Serving the health check node port")
	}
	for n := range s.failed {
		if _, ok := want[n]; !ok {
			delete(s.failed, n)
		}
	}
}

// Close closes every port and waits for their goroutines.
func (s *Server) Close() {
	s.mu.Lock()
	for n, p := range s.ports {
		p.close()
		delete(s.ports, n)
	}
	s.mu.Unlock()
	s.wg.Wait()
}

func (s *Server) log() logrus.FieldLogger {
	if s.Log != nil {
		return s.Log
	}
	return logrus.StandardLogger()
}

func (s *Server) open(n int, svc *Service) (*port, error) {
	addrs := []string{":" + strconv.Itoa(n)}
	if len(s.Addrs) > 0 {
		addrs = addrs[:0]
		for _, a := range s.Addrs {
			addrs = append(addrs, netip.AddrPortFrom(a, uint16(n)).String())
		}
	}
	p := &port{}
	p.svc.Store(svc)
	for _, a := range addrs {
		ln, err := net.Listen("tcp", a)
		if err != nil {
			p.close()
			return nil, fmt.Errorf("listening on %s: %w", a, err)
		}
		srv := &http.Server{Handler: s.handler(p), ReadHeaderTimeout: 5 * time.Second, IdleTimeout: 30 * time.Second}
		p.servers = append(p.servers, srv)
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				s.log().WithError(err).WithField("port", n).Warn("Health check node port stopped serving")
			}
		}()
	}
	return p, nil
}

// close stops the port's servers at once: a load balancer's probe in
// flight gets a reset, as if the node were gone.
func (p *port) close() {
	for _, srv := range p.servers {
		_ = srv.Close()
	}
}

// answer is kube-proxy's body.
type answer struct {
	Service struct {
		Namespace string `json:"namespace"`
		Name      string `json:"name"`
	} `json:"service"`
	LocalEndpoints      int  `json:"localEndpoints"`
	ServiceProxyHealthy bool `json:"serviceProxyHealthy"`
}

// handler answers any path: 200 when the Service has a ready endpoint on
// this node and the proxy is healthy, else 503, with kube-proxy's JSON body
// and endpoint-weight header.
func (s *Server) handler(p *port) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		svc := p.svc.Load()
		var a answer
		a.Service.Namespace, a.Service.Name = svc.Namespace, svc.Name
		a.LocalEndpoints = svc.LocalEndpoints
		a.ServiceProxyHealthy = s.Healthy == nil || s.Healthy()
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		w.Header().Set("X-Load-Balancing-Endpoint-Weight", strconv.Itoa(svc.LocalEndpoints))
		if a.LocalEndpoints == 0 || !a.ServiceProxyHealthy {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_ = json.NewEncoder(w).Encode(a)
	})
}
