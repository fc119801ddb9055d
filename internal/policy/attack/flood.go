//go:build linux

package main

import (
	"fmt"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// flood takes kernel memory without end, as an agent could: pipes each
// filled to its 64 KiB buffer, or loopback TCP connections each holding
// what it sent unread. It prints how many it holds every 256 and when
// the kernel refuses one, then holds them all for hold.
func flood(kind string, n int, hold time.Duration) {
	report := func(i int, err error) {
		fmt.Printf("%s\t%d\t%v\n", kind, i, err)
	}
	buf := make([]byte, 64<<10)
	switch kind {
	case "pipes":
		for i := range n {
			var p [2]int
			if err := unix.Pipe2(p[:], unix.O_NONBLOCK|unix.O_CLOEXEC); err != nil {
				report(i, err)
				break
			}
			for { // to the buffer's end
				if _, err := unix.Write(p[1], buf); err != nil {
					break
				}
			}
			if i%256 == 0 {
				report(i, nil)
			}
		}
	case "tcp":
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			report(0, err)
			return
		}
		var held, accepted []net.Conn
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				accepted = append(accepted, c) // never read
			}
		}()
		for i := range n {
			c, err := net.Dial("tcp", l.Addr().String())
			if err != nil {
				report(i, err)
				break
			}
			c.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
			for { // until the peer's receive and our send buffers are full
				if _, err := c.Write(buf); err != nil {
					break
				}
			}
			held = append(held, c)
			if i%256 == 0 {
				report(i, nil)
			}
		}
	default:
		fmt.Fprintln(os.Stderr, "attack: -flood pipes or tcp")
		os.Exit(2)
	}
	report(n, nil)
	time.Sleep(hold)
}
