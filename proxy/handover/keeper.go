package handover

// A keeper (kube-userspace-proxy keep) is a supervising process that holds
// a duplicate of every listening socket of the daemon it runs, its worker,
// so that the sockets outlive the worker's crash: connections wait in
// their backlogs, and the keeper hands the sockets to the next worker
// through the exchange of handover.go, as a predecessor that serves
// nothing would (Keeper is a Giver).
//
// The worker tells its keeper over an inherited unix socket
// (SOCK_SEQPACKET, its descriptor number in $KUP_KEEPER_FD), one JSON
// message per record, never answered (the keeper gives sockets back on
// another, $KUP_KEEPER_HANDOVER_FD, with the exchange of handover.go):
//
//	keep {sockets} + descriptors    sockets it opened (a name kept again replaces)
//	drop {names}                    sockets it closed
//	serving                         its first sync is done
//	alive                           its sync goroutine answers (every few seconds)
//	picks {data}                    pick states changed since (JSON: frontend → state, null: gone)
//	handed-over                     a successor took over: do not restart it
//
// Who owns what: the keeper's Receive goroutine changes what it holds, the
// exchange's goroutine lends duplicates of it; one lock, never held across
// a system call on the worker's socket. A KeeperLink belongs to the
// worker's caller, one message at a time.

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/kernel"
)

// Environment of a worker run by a keeper.
const (
	// EnvKeeperFD is the descriptor number of the worker's end of the
	// keeper's socket.
	EnvKeeperFD = "KUP_KEEPER_FD"
	// EnvKeeperHandover is the descriptor number of the worker's end of
	// a socket on which the keeper gives it the sockets it holds (the
	// exchange of handover.go), set when it holds any.
	EnvKeeperHandover = "KUP_KEEPER_HANDOVER_FD"
)

// keeperWriteTimeout bounds one message to the keeper: a keeper that does
// not read is given up on (the worker serves on, unkept).
const keeperWriteTimeout = 5 * time.Second

// KeeperLink is a worker's side of its keeper's socket.
type KeeperLink struct {
	c *net.UnixConn
}

// KeeperFromEnv is the link to the keeper that runs this process, or nil
// when none does.
func KeeperFromEnv() (*KeeperLink, error) {
	c, err := inheritedConn(EnvKeeperFD)
	if c == nil || err != nil {
		return nil, err
	}
	return &KeeperLink{c: c}, nil
}

// KeptFromEnv takes back the sockets the keeper that runs this process
// holds for it (a restart after a crash), or returns nil, nil when it
// holds none.
func KeptFromEnv(ctx context.Context, profile Profile) (*Predecessor, error) {
	c, err := inheritedConn(EnvKeeperHandover)
	if c == nil || err != nil {
		return nil, err
	}
	return TakeFrom(ctx, c, profile)
}

// inheritedConn is the unix socket whose descriptor number $env names
// (nil when unset), made close-on-exec.
func inheritedConn(env string) (*net.UnixConn, error) {
	v := os.Getenv(env)
	if v == "" {
		return nil, nil
	}
	os.Unsetenv(env) // once: not for this process's own children
	fd, err := strconv.Atoi(v)
	if err != nil || fd < 3 {
		return nil, fmt.Errorf("$%s=%q: not a descriptor number", env, v)
	}
	c, err := kernel.SeqpacketFromFD(fd, "keeper")
	if err != nil {
		return nil, fmt.Errorf("$%s: not the keeper's socket: %w", env, err)
	}
	return c, nil
}

// Keep gives the keeper a duplicate of each of socks (opened as sent).
func (k *KeeperLink) Keep(socks []Socket) error {
	_ = k.c.SetWriteDeadline(time.Now().Add(keeperWriteTimeout))
	return openSend(k.c, msgKeep, socks)
}

// Drop tells the keeper that the sockets named are closed.
func (k *KeeperLink) Drop(names []string) error {
	for len(names) > 0 {
		n := min(len(names), 1000)
		_ = k.c.SetWriteDeadline(time.Now().Add(keeperWriteTimeout))
		if err := send(k.c, message{Type: msgDrop, Names: names[:n]}, nil); err != nil {
			return err
		}
		names = names[n:]
	}
	return nil
}

// Serving tells the keeper that the worker serves (its first sync done).
func (k *KeeperLink) Serving() error { return k.say(msgServing) }

// Alive tells the keeper that the worker's sync goroutine answers.
func (k *KeeperLink) Alive() error { return k.say(msgAlive) }

// Picks gives the keeper the pick states that changed (frontend → state,
// JSON null for a frontend gone), in pieces that fit a message.
func (k *KeeperLink) Picks(changed map[string]json.RawMessage) error {
	piece := map[string]json.RawMessage{}
	size := 0
	flush := func() error {
		if len(piece) == 0 {
			return nil
		}
		b, err := json.Marshal(piece)
		if err != nil {
			return err
		}
		_ = k.c.SetWriteDeadline(time.Now().Add(keeperWriteTimeout))
		clear(piece)
		size = 0
		return send(k.c, message{Type: msgPicks, Data: b}, nil)
	}
	for name, st := range changed {
		if size+len(name)+len(st) > statePiece {
			if err := flush(); err != nil {
				return err
			}
		}
		piece[name] = st
		size += len(name) + len(st) + 8
	}
	return flush()
}

// Released tells the keeper that a successor took over: the worker's
// end is no crash.
func (k *KeeperLink) Released() error { return k.say(msgWorkerReleased) }

func (k *KeeperLink) say(what msgType) error {
	_ = k.c.SetWriteDeadline(time.Now().Add(keeperWriteTimeout))
	return send(k.c, message{Type: what}, nil)
}

// Close closes the worker's end.
func (k *KeeperLink) Close() error { return k.c.Close() }

// Keeper holds the sockets its workers keep, and lends them to the next
// worker (a Giver whose Release keeps them: the next worker keeps them
// again, and what it does not is dropped).
type Keeper struct {
	mu    sync.Mutex
	socks map[string]Socket          // File set: the keeper's own duplicate
	picks map[string]json.RawMessage // each frontend's pick state, as last given
	// The current worker's last "alive" (unix ns; 0: none yet) and
	// whether it was handed over, for the keeper's watch of a hung worker.
	alive    atomic.Int64
	released atomic.Bool
}

// NewKeeper holds nothing yet.
func NewKeeper() *Keeper {
	return &Keeper{socks: map[string]Socket{}, picks: map[string]json.RawMessage{}}
}

// WorkerSaid is what a worker said on its socket before it ended.
type WorkerSaid struct {
	Serving, Released bool
}

// Receive applies what the worker says on c until c ends (the worker
// exited or closed it).
func (k *Keeper) Receive(c *net.UnixConn) WorkerSaid {
	var said WorkerSaid
	k.alive.Store(0)
	k.released.Store(false)
	for {
		m, files, err := receive(c)
		if err != nil {
			return said
		}
		switch m.Type {
		case msgKeep:
			if len(files) != len(m.Sockets) {
				closeAll(files)
				continue
			}
			k.mu.Lock()
			for i, s := range m.Sockets {
				if old, ok := k.socks[s.Name]; ok {
					old.File.Close()
				}
				s.File = files[i]
				k.socks[s.Name] = s
			}
			k.mu.Unlock()
		case msgDrop:
			closeAll(files)
			k.mu.Lock()
			for _, name := range m.Names {
				if old, ok := k.socks[name]; ok {
					old.File.Close()
					delete(k.socks, name)
				}
			}
			k.mu.Unlock()
		case msgServing:
			said.Serving = true
		case msgAlive:
			k.alive.Store(time.Now().UnixNano())
		case msgPicks:
			var changed map[string]json.RawMessage
			if json.Unmarshal(m.Data, &changed) != nil {
				continue
			}
			k.mu.Lock()
			for name, st := range changed {
				if string(st) == "null" {
					delete(k.picks, name)
				} else {
					k.picks[name] = st
				}
			}
			k.mu.Unlock()
		case msgWorkerReleased:
			said.Released = true
			k.released.Store(true)
			k.closeAll()
		default:
			closeAll(files)
		}
	}
}

// Silent is how long the current worker has not said it is alive: 0
// before it first did, and once it was handed over (its end is no crash).
func (k *Keeper) Silent(now time.Time) time.Duration {
	at := k.alive.Load()
	if at == 0 || k.released.Load() {
		return 0
	}
	return now.Sub(time.Unix(0, at))
}

// Held is how many sockets the keeper holds.
func (k *Keeper) Held() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.socks)
}

func (k *Keeper) closeAll() {
	k.mu.Lock()
	defer k.mu.Unlock()
	for name, s := range k.socks {
		s.File.Close()
		delete(k.socks, name)
	}
	clear(k.picks)
}

// Close closes every socket held.
func (k *Keeper) Close() { k.closeAll() }

// Lend lends a duplicate of every socket held.
func (k *Keeper) Lend(context.Context) ([]Socket, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	socks := make([]Socket, 0, len(k.socks))
	for _, s := range k.socks {
		f := s.File
		s.File, s.Open = nil, func() (*os.File, error) { return kernel.Dup(f, f.Name()) }
		socks = append(socks, s)
	}
	return socks, nil
}

// Freeze: a keeper changes nothing; it returns the pick states it holds,
// as the worker gave them last (a few seconds old at most).
func (k *Keeper) Freeze(context.Context) (json.RawMessage, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if len(k.picks) == 0 {
		return nil, nil
	}
	return json.Marshal(k.picks)
}

// Thaw: nothing to do.
func (k *Keeper) Thaw() {}

// Release keeps every socket: the worker that took them keeps them again.
func (k *Keeper) Release(int) {}

// Transfer: a keeper carries no connection.
func (k *Keeper) Transfer(context.Context, func([]Socket) error) error { return nil }

// WorkerSocket makes the socket pair between a keeper and a worker: the
// keeper's end, and the worker's as a file to pass to it (close it in the
// keeper once the worker started).
func WorkerSocket() (*net.UnixConn, *os.File, error) {
	return kernel.SeqpacketPair("keeper", "worker")
}
