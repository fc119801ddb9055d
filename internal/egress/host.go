package egress

import (
	"bufio"
	"bytes"
	"fmt"
	"net"
	"net/http"
	"strings"

	"golang.org/x/net/http/httpguts"
)

// MaxHead bounds an HTTP request's head (its request line and header
// fields), as net/http's server does by default.
const MaxHead = 1 << 20

// Request is what an HTTP request's head tells of where it goes.
type Request struct {
	// Host is the request's target host, without its port: the host of
	// an absolute request target (which a server must prefer, RFC 9112
	// 3.2.2) or else the Host field's; as sent (Normalize it).
	Host string
	// Len is the head's length in the stream.
	Len int
}

// ParseRequest reads the head of an HTTP/1 request from the first bytes
// a client sent; ErrShort until the head's blank line is in. A request
// with no host, two Host fields or a malformed head is an error.
func ParseRequest(b []byte) (Request, error) {
	end := bytes.Index(b, []byte("\r\n\r\n"))
	if end < 0 {
		if len(b) >= MaxHead {
			return Request{}, fmt.Errorf("no end to an HTTP request's head in its first %d bytes", MaxHead)
		}
		return Request{}, ErrShort
	}
	head := b[:end+4]
	req, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(head)))
	if err != nil {
		return Request{}, fmt.Errorf("not an HTTP request: %v", err)
	}
	if len(req.Header.Values("Host")) > 1 {
		return Request{}, fmt.Errorf("an HTTP request with %d Host fields", len(req.Header.Values("Host")))
	}
	host := req.Host // the absolute target's host, else the Host field
	if host == "" || !httpguts.ValidHostHeader(host) {
		return Request{}, fmt.Errorf("an HTTP request with host %q", host)
	}
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	} else if strings.HasPrefix(host, "[") && strings.HasSuffix(host, "]") {
		host = host[1 : len(host)-1]
	}
	if host == "" {
		return Request{}, fmt.Errorf("an HTTP request with host %q", req.Host)
	}
	return Request{Host: host, Len: len(head)}, nil
}
