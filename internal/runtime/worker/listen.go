package worker

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"
	"strings"

	"github.com/containerd/errdefs"
)

// ListenTCP listens on addr (tcp://HOST:PORT) as t says: TLS where t
// has a certificate, which it must off loopback; with h2, TLS offers
// HTTP/2 too (the E2B front's, e2b.http2: its SDKs multiplex over it).
func ListenTCP(addr string, t TLS, h2 bool) (net.Listener, error) {
	hostport, ok := strings.CutPrefix(addr, "tcp://")
	if !ok {
		return nil, fmt.Errorf("bad listen address %q: give tcp://HOST:PORT: %w", addr, errdefs.ErrInvalidArgument)
	}
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return nil, fmt.Errorf("bad listen address %q: %v: give tcp://HOST:PORT: %w", addr, err, errdefs.ErrInvalidArgument)
	}
	if (t.Cert == "") != (t.Key == "") {
		return nil, fmt.Errorf("TLS needs both a certificate and its key (--tls-cert, --tls-key): %w", errdefs.ErrInvalidArgument)
	}
	if t.Cert == "" && !loopback(host) {
		return nil, fmt.Errorf("listening on %s, off loopback, needs TLS: give --tls-cert and --tls-key (dsec daemon certs DIR makes a CA and certificates), or listen on 127.0.0.1: %w",
			hostport, errdefs.ErrInvalidArgument)
	}
	if t.Cert == "" && t.ClientCA != "" {
		return nil, fmt.Errorf("--tls-client-ca needs TLS: give --tls-cert and --tls-key too: %w", errdefs.ErrInvalidArgument)
	}
	var cfg *tls.Config
	if t.Cert != "" {
		pair, err := tls.LoadX509KeyPair(t.Cert, t.Key)
		if err != nil {
			return nil, fmt.Errorf("TLS certificate %s and key %s: %v: %w", t.Cert, t.Key, err, errdefs.ErrInvalidArgument)
		}
		cfg = &tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12}
		if h2 {
			cfg.NextProtos = []string{"h2", "http/1.1"}
		}
		if t.ClientCA != "" {
			b, err := os.ReadFile(t.ClientCA)
			if err != nil {
				return nil, fmt.Errorf("client CA: %w", err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(b) {
				return nil, fmt.Errorf("client CA %s holds no PEM certificate: %w", t.ClientCA, errdefs.ErrInvalidArgument)
			}
			cfg.ClientCAs, cfg.ClientAuth = pool, tls.RequireAndVerifyClientCert
		}
	}
	l, err := net.Listen("tcp", hostport)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", hostport, err)
	}
	if cfg != nil {
		l = tls.NewListener(l, cfg)
	}
	return l, nil
}

// loopback says whether host names only this machine.
func loopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
