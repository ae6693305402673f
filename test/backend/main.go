// Command backend is the lab's pod: an HTTP server on TCP that answers every
// request with its name, and a UDP server that answers every datagram with
// "name:" followed by the datagram. Used by make demo and the netns tests.
package main

import (
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
)

func main() {
	name := flag.String("name", "", "the name to answer with (default: the hostname)")
	tcp := flag.String("tcp", ":8080", "TCP listen address (HTTP); empty to disable")
	udp := flag.String("udp", ":8080", "UDP listen address; empty to disable")
	echo := flag.String("echo", "", "TCP echo listen address (benchmarks); empty to disable")
	flag.Parse()
	if *name == "" {
		*name, _ = os.Hostname()
	}
	errc := make(chan error, 3)
	if *echo != "" {
		ln, err := net.Listen("tcp", *echo)
		if err != nil {
			log.Fatal(err)
		}
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					errc <- err
					return
				}
				go func() { defer c.Close(); _, _ = io.Copy(c, c) }()
			}
		}()
	}
	if *udp != "" {
		c, err := net.ListenPacket("udp", *udp)
		if err != nil {
			log.Fatal(err)
		}
		go func() {
			buf := make([]byte, 65536)
			for {
				n, from, err := c.ReadFrom(buf)
				if err != nil {
					errc <- err
					return
				}
				_, _ = c.WriteTo(append([]byte(*name+":"), buf[:n]...), from)
			}
		}()
	}
	if *tcp != "" {
		go func() {
			errc <- http.ListenAndServe(*tcp, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				fmt.Fprintf(w, "%s (client %s)\n", *name, r.RemoteAddr)
			}))
		}()
	}
	log.Fatal(<-errc)
}
