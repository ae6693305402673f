// Package sock is the proxy's raw socket layer: every system call the data
// path makes, errno handling, socket addresses in the kernel's layout and
// descriptor ownership live here, so that the data path (package
// dataplane) reads as ordinary Go. It imports the kernel layer (package
// kernel: conntrack requests, sysctls) and nothing else of this project.
//
// What it offers:
//
//   - TCP: ListenTCP, and an Acceptor that accepts on many listeners from
//     one goroutine (Listener.Serve; a listener costs no goroutine), DialTCP (a
//     non-blocking connect that often finishes without a park), Copy (one
//     direction of a proxied connection: small messages through a pooled
//     buffer, bulk data through splice(2) and a pooled pipe; with an idle
//     time it returns ErrIdle when its source stays quiet), a Parker (an
//     epoll set that holds idle sockets without a goroutine each and wakes
//     them on data or Abort), and on a Conn the calls a proxy needs:
//     CloseWrite, SetResetOnClose, OriginalDst, WaitPeerReset.
//   - UDP: ListenUDP and DialUDP (with the buffers and IP_PKTINFO the proxy
//     needs), Sender (sendmsg with the source address, runs of a flow as
//     one GSO send) and Receiver (recvmmsg into a pooled batch borrowed
//     only while datagrams are taken, with the sender's and local
//     addresses), without an allocation per datagram.
//   - DialTCPFrom: DialTCP with the client's own address (and port) on the
//     backend connection (a Source: bound when it is the node's, else
//     through a ClientNAT, which creates the connection's conntrack entry
//     with a source NAT before its first packet, taking over the entry of
//     the client's earlier connection from that port once it is in
//     TIME_WAIT, never a live connection's, and checking after the
//     handshake that conntrack kept it).
//     DialUDPFrom does the same for a UDP flow's socket. The ClientNAT owns
//     its netlink sockets and the ports of its range (sourceports.go), each
//     lent to one dial and given back when its Conn is closed (a UDP
//     socket's by the release DialUDPFrom returns, which its owner calls
//     after closing it); the entries are the kernel's, each released by the
//     dial that made it if it fails, and a UDP flow's when it ends.
//   - The ClientNAT's conntrack requests go through package kernel's
//     Conntrack (which also answers UDPOriginalDst, a new UDP flow's
//     destination before NAT, for the data path's guard); IsLocalAddr
//     (conn.go) says whether a peer is this node.
//   - For a handover to another process (inherit.go): duplicates of a
//     Listener's, a UDP socket's and a Conn's descriptor (File, UDPFile)
//     and their way back (FileListener, FileUDP, FileConn), and
//     Conn.Detach, which has a Copy from the Conn stop at its next pause
//     with ErrDetached, everything it read written on; HoldUDPFrom makes
//     a transferred flow socket's release in its new process (its port
//     taken from the range, its conntrack entry deleted when it ends),
//     Conn.HoldSourcePort takes a transferred backend connection's port
//     of the range until its Close.
//   - HoldPort (a bound, non-listening socket that keeps a port from other
//     processes), RefusePort (the same, refusing what arrives: a TCP reset,
//     a UDP port unreachable).
//
// # Ownership
//
// A Conn has one owner: the goroutine that got it from an Acceptor or DialTCP, or
// the one it handed it to. Other goroutines may use it only as follows.
//
//   - Copy, CloseWrite, WaitPeerReset and the setters may run on other
//     goroutines while the owner holds the Conn (one Copy per direction).
//   - Detach and Undetach may be called by anyone, as Abort; a detached
//     Copy's owner keeps the Conn (and closes it once a duplicate went to
//     another process: the connection lives on there).
//   - Abort may be called by anyone, any number of times, at any time, also
//     after Close. It never waits: it marks the Conn done and wakes every
//     read or write waiting on it, now or later, which then return
//     net.ErrClosed, and a Conn parked in a Parker is woken. A Copy parked writing to a peer that stopped reading
//     returns as promptly as one parked in a read. The descriptor stays open.
//   - Close is the owner's, once, after every goroutine using the Conn has
//     returned (abort first if they may be parked). Like os.File.Close it
//     would otherwise wait for their system calls: closing one socket must
//     never wait for I/O parked on another, which is what Abort is for.
//
// So the teardown of a pair of sockets is: Abort both (from wherever the
// end is decided), let the copies return, then the owner closes both.
package sock
