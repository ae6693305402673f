package daemon

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
)

// The admin socket serves what changes the daemon's state (drains today):
// a unix socket in a root-only folder, whose peers are checked with
// SO_PEERCRED, so that no local process but root — no hostNetwork pod, no
// page in a browser — can change anything. Reads stay on the metrics
// address.

// peerKey carries the peer's credentials in a request's context.
type peerKey struct{}

// peer is who is on the other end of an admin connection.
type peer struct{ uid, pid int32 }

func (p peer) String() string { return fmt.Sprintf("uid %d pid %d", p.uid, p.pid) }

func peerOf(r *http.Request) (peer, bool) {
	p, ok := r.Context().Value(peerKey{}).(peer)
	return p, ok
}

// listenAdmin opens the admin socket at path: its folder made root-only,
// a stale socket of a previous daemon replaced, the socket itself 0600.
func listenAdmin(path string) (*net.UnixListener, error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("admin socket folder %s: %w", dir, err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, fmt.Errorf("admin socket folder %s: %w", dir, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("replacing %s: %w", path, err)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("admin socket: %w", err)
	}
	ln.SetUnlinkOnClose(true)
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("admin socket %s: %w", path, err)
	}
	return ln, nil
}

// credentials reads the peer of a unix connection.
func credentials(c net.Conn) (peer, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return peer{}, errors.New("not a unix connection")
	}
	cred, err := kernel.PeerCred(uc)
	if err != nil {
		return peer{}, err
	}
	return peer{uid: int32(cred.UID), pid: int32(cred.PID)}, nil
}

// serveAdmin serves h on ln until ctx ends, to root (or this daemon's own
// user) only: any other peer is answered 403 before h sees the request.
func serveAdmin(ctx context.Context, ln *net.UnixListener, h http.Handler, log logrus.FieldLogger) <-chan struct{} {
	self := int32(os.Geteuid())
	srv := adminLimits.server(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, ok := peerOf(r)
		if !ok || (p.uid != 0 && p.uid != self) {
			log.WithField("peer", p.String()).Warn("Admin request from a user other than root refused")
			http.Error(w, "the admin socket is for root only", http.StatusForbidden)
			return
		}
		h.ServeHTTP(w, r)
	}))
	srv.ConnContext = func(ctx context.Context, c net.Conn) context.Context {
		if p, err := credentials(c); err == nil {
			return context.WithValue(ctx, peerKey{}, p)
		}
		return ctx
	}
	done := make(chan struct{})
	go shutdownWith(ctx, srv)
	go func() {
		defer close(done)
		log.WithField("socket", ln.Addr().String()).Info("Serving the admin socket")
		// No connection limit: only root can connect, and the peer's
		// credentials are read from the *net.UnixConn itself.
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.WithError(err).Error("Admin socket failed")
		}
	}()
	return done
}

// adminLimits are the admin socket's timeouts and header size.
var adminLimits = serverLimits{readHeader: 5 * time.Second, read: 10 * time.Second, write: 10 * time.Second,
	idle: 10 * time.Second, maxHeaderBytes: 8 << 10}

// who names the author of a change for the log: the admin socket's peer,
// or the address of a TCP client.
func who(r *http.Request) string {
	if p, ok := peerOf(r); ok {
		return "uid " + strconv.Itoa(int(p.uid)) + " pid " + strconv.Itoa(int(p.pid))
	}
	return r.RemoteAddr
}
