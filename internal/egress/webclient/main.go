// Command webclient is the tests' and benchmarks' web client inside a
// sandbox (busybox's wget needs a libc the test layers lack): it
// connects to ADDR:PORT, speaks TLS there with -sni (none: no server
// name) unless -http, sends a GET for -path with -host as its Host, and
// prints the answer's body.
//
//	webclient [-http] [-sni NAME] [-host NAME] [-path P] [-chunk N] [-ech-public NAME] [-port N] [-n N] ADDR:PORT
//	webclient -h3 [-sni NAME] [-path P] ADDR:PORT
//	webclient -dns NAME [-tcp] [-unique] [-n N] SERVER:PORT
//
// -unique asks each time for a name not asked before, under NAME
// (qPID-I.NAME): no cache answers it.
// -h3 is a browser's way: HTTP/3 over QUIC (UDP) first, and over TCP
// once that fails; it prints "via HTTP/3" or "via TCP (HTTP/3: why)"
// before the body.
// -chunk writes the connection's bytes N at a time, 5 ms apart (a hello
// over many segments); -ech-public offers encrypted_client_hello with a
// made-up config whose public name is NAME; -port connects from that
// local port. With -n, it makes N requests
// (or DNS queries) one after another and prints, instead of a body, the
// p50 and p99 of the time to the answer's first byte (connect included)
// and the body's bytes per second: "ttfb-p50-us N", "ttfb-p99-us N",
// "bytes-per-second N" (DNS: "dns-p50-us N", "dns-p99-us N").
package main

import (
	"bufio"
	"cmp"
	"crypto/tls"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"time"

	"github.com/miekg/dns"
	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"

	"github.com/dsec-project/dsec/internal/egress/egresstest"
)

type options struct {
	plain                      bool
	sni, host, path, echPublic string
	chunk, port                int
}

func main() {
	var o options
	flag.BoolVar(&o.plain, "http", false, "plain HTTP, no TLS")
	flag.StringVar(&o.sni, "sni", "", "the TLS server name")
	flag.StringVar(&o.host, "host", "", "the Host header (default: -sni)")
	flag.StringVar(&o.path, "path", "/", "the path asked for")
	flag.IntVar(&o.chunk, "chunk", 0, "write N bytes at a time")
	flag.IntVar(&o.port, "port", 0, "connect from this local port")
	flag.StringVar(&o.echPublic, "ech-public", "", "offer ECH with this public name")
	n := flag.Int("n", 0, "make N requests and print their timings")
	query := flag.String("dns", "", "ask SERVER for NAME's A records")
	overTCP := flag.Bool("tcp", false, "ask over TCP (-dns)")
	unique := flag.Bool("unique", false, "ask for a new name under NAME each time (-dns)")
	h3 := flag.Bool("h3", false, "HTTP/3 first, TCP after it fails")
	flag.Parse()
	var err error
	switch {
	case *query != "":
		err = lookups(flag.Arg(0), *query, max(*n, 1), *overTCP, *unique)
	case *n > 0:
		err = timed(flag.Arg(0), o, *n)
	case *h3:
		if err = getH3(flag.Arg(0), o, os.Stdout); err != nil {
			fmt.Printf("via TCP (HTTP/3: %v)\n", err)
			_, _, err = get(flag.Arg(0), o, os.Stdout)
		}
	default:
		_, _, err = get(flag.Arg(0), o, os.Stdout)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "webclient:", err)
		os.Exit(1)
	}
}

// get makes one request, copies its body to w, and returns the time to
// its first byte and the body's length.
func get(addr string, o options, w io.Writer) (time.Duration, int64, error) {
	start := time.Now()
	d := net.Dialer{Timeout: 5 * time.Second}
	if o.port > 0 {
		d.LocalAddr = &net.TCPAddr{Port: o.port}
	}
	raw, err := d.Dial("tcp", addr)
	if err != nil {
		return 0, 0, err
	}
	defer raw.Close()
	raw.SetDeadline(time.Now().Add(60 * time.Second))
	var c net.Conn = raw
	if o.chunk > 0 {
		c = &chunked{Conn: raw, n: o.chunk}
	}
	if !o.plain {
		cfg := &tls.Config{ServerName: o.sni, InsecureSkipVerify: true}
		if o.echPublic != "" {
			cfg.MinVersion = tls.VersionTLS13
			cfg.EncryptedClientHelloConfigList = egresstest.ECHConfigList(o.echPublic)
		}
		tc := tls.Client(c, cfg)
		if err := tc.Handshake(); err != nil {
			return 0, 0, err
		}
		c = tc
	}
	host := o.host
	if host == "" {
		host = o.sni
	}
	fmt.Fprintf(c, "GET %s HTTP/1.0\r\nHost: %s\r\nConnection: close\r\n\r\n", o.path, host)
	br := bufio.NewReader(c)
	if _, err := br.Peek(1); err != nil {
		return 0, 0, err
	}
	ttfb := time.Since(start)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	n, err := io.Copy(w, resp.Body)
	return ttfb, n, err
}

// getH3 makes one request over HTTP/3 and copies its body to w.
func getH3(addr string, o options, w io.Writer) error {
	tr := &http3.Transport{TLSClientConfig: &tls.Config{ServerName: o.sni, InsecureSkipVerify: true},
		QUICConfig: &quic.Config{HandshakeIdleTimeout: 3 * time.Second}}
	defer tr.Close()
	req, err := http.NewRequest("GET", "https://"+addr+o.path, nil)
	if err != nil {
		return err
	}
	req.Host = cmp.Or(o.host, o.sni)
	resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	fmt.Fprintln(w, "via HTTP/3")
	_, err = io.Copy(w, resp.Body)
	return err
}

// timed makes n requests and prints their timings.
func timed(addr string, o options, n int) error {
	var ttfbs []time.Duration
	var bytes int64
	var spent time.Duration
	for range n {
		start := time.Now()
		ttfb, b, err := get(addr, o, io.Discard)
		if err != nil {
			return err
		}
		spent += time.Since(start)
		ttfbs = append(ttfbs, ttfb)
		bytes += b
	}
	p50, p99 := quantiles(ttfbs)
	fmt.Printf("ttfb-p50-us %d\nttfb-p99-us %d\nbytes-per-second %.0f\n", p50.Microseconds(), p99.Microseconds(), float64(bytes)/spent.Seconds())
	return nil
}

// lookups asks server for name's A records n times and prints the
// timings.
func lookups(server, name string, n int, overTCP, unique bool) error {
	var took []time.Duration
	c := &dns.Client{Timeout: 5 * time.Second}
	if overTCP {
		c.Net = "tcp"
	}
	for i := range n {
		q := name
		if unique {
			q = fmt.Sprintf("q%d-%d.%s", os.Getpid(), i, name)
		}
		m := new(dns.Msg)
		m.SetQuestion(dns.Fqdn(q), dns.TypeA)
		start := time.Now()
		r, _, err := c.Exchange(m, server)
		if err != nil {
			return err
		}
		if len(r.Answer) == 0 {
			return fmt.Errorf("%s: no answer (%s)", name, dns.RcodeToString[r.Rcode])
		}
		took = append(took, time.Since(start))
	}
	p50, p99 := quantiles(took)
	fmt.Printf("dns-p50-us %d\ndns-p99-us %d\n", p50.Microseconds(), p99.Microseconds())
	return nil
}

func quantiles(d []time.Duration) (p50, p99 time.Duration) {
	slices.Sort(d)
	return d[len(d)/2], d[min(len(d)-1, len(d)*99/100)]
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
