// Command webclient is the tests' web client inside a sandbox (busybox's
// wget needs a libc the test layers lack): it connects to ADDR:PORT,
// speaks TLS there with -sni (none: no server name) unless -http, sends
// a GET with -host as its Host, and prints the answer's body.
//
//	webclient [-http] [-sni NAME] [-host NAME] [-chunk N] [-ech-public NAME] ADDR:PORT
//
// -chunk writes the connection's bytes N at a time, 5 ms apart (a hello
// over many segments); -ech-public offers encrypted_client_hello with a
// made-up config whose public name is NAME.
package main

import (
	"bufio"
	"crypto/tls"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/dsec-project/dsec/internal/egress/egresstest"
)

func main() {
	plain := flag.Bool("http", false, "plain HTTP, no TLS")
	sni := flag.String("sni", "", "the TLS server name")
	host := flag.String("host", "", "the Host header (default: -sni)")
	chunk := flag.Int("chunk", 0, "write N bytes at a time")
	echPublic := flag.String("ech-public", "", "offer ECH with this public name")
	flag.Parse()
	if err := run(flag.Arg(0), *plain, *sni, *host, *chunk, *echPublic); err != nil {
		fmt.Fprintln(os.Stderr, "webclient:", err)
		os.Exit(1)
	}
}

func run(addr string, plain bool, sni, host string, chunk int, echPublic string) error {
	raw, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return err
	}
	raw.SetDeadline(time.Now().Add(10 * time.Second))
	var c net.Conn = raw
	if chunk > 0 {
		c = &chunked{Conn: raw, n: chunk}
	}
	if !plain {
		cfg := &tls.Config{ServerName: sni, InsecureSkipVerify: true}
		if echPublic != "" {
			cfg.MinVersion = tls.VersionTLS13
			cfg.EncryptedClientHelloConfigList = egresstest.ECHConfigList(echPublic)
		}
		tc := tls.Client(c, cfg)
		if err := tc.Handshake(); err != nil {
			return err
		}
		c = tc
	}
	if host == "" {
		host = sni
	}
	fmt.Fprintf(c, "GET / HTTP/1.0\r\nHost: %s\r\nConnection: close\r\n\r\n", host)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, err = io.Copy(os.Stdout, resp.Body)
	return err
}

type chunked struct {
	net.Conn
	n int
}

func (c *chunked) Write(b []byte) (int, error) {
	done := 0
	for done < len(b) {
		k := min(c.n, len(b)-done)
		if _, err := c.Conn.Write(b[done : done+k]); err != nil {
			return done, err
		}
		done += k
		time.Sleep(5 * time.Millisecond)
	}
	return done, nil
}
